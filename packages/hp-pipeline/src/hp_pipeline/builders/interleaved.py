"""Interleaved 1F1B: several stages per rank shrink the bubble by their number.

Details: [Note: interleaved rounds].
"""

from __future__ import annotations

from hp_pipeline.builders._common import B, F, check_count, check_ranks_and_micros
from hp_pipeline.ir import MetaStep, MetaStepType, Order

__all__ = ["build_interleaved_1f1b_order", "interleaved_round_size"]

_NAME = "build_interleaved_1f1b_order"


# [Note: interleaved rounds]
# The micro-batches are cut into rounds of ``g`` consecutive micro-batches, and a
# rank walks each round through its local stages: forwards of round 0 on local
# stage 0, then round 0 on local stage 1, ..., then round 1 on local stage 0 and
# so on; backwards do the same with the local stages reversed. Rounds must be
# equal, which is what makes the order well defined (torch's
# ``ScheduleInterleaved1F1B`` uses the same rule):
#
# * ``m <= p``: one round of all ``m`` micro-batches;
# * ``m > p``: ``m // p`` rounds of ``g = m / (m // p)`` micro-batches each, so
#   ``m`` must be a multiple of ``m // p`` (every multiple of ``p`` qualifies, and
#   so does e.g. ``m = 6`` for ``p = 4``: one round of 6).
#
# Rank ``r`` warms up with ``(v-1)*g + 2*(p-1-r)`` forwards, enough for the first
# backward of its last local stage to have everything it needs, then alternates
# forward and backward, then drains the remaining backwards (Megatron-LM's
# schedule, Narayanan et al., 2021).


def interleaved_round_size(num_ranks: int, n_microbatches: int) -> int:
    """The round size ``g`` of [Note: interleaved rounds], or a ValueError saying which ``m`` work."""
    return round_size(_NAME, num_ranks, n_microbatches)


def round_size(builder: str, num_ranks: int, n_microbatches: int) -> int:
    """:func:`interleaved_round_size` for any builder that walks rounds; errors name ``builder``."""
    p, m = check_ranks_and_micros(builder, num_ranks, n_microbatches)
    rounds = max(1, m // p)
    if m % rounds:
        below = _nearest_valid(p, m, -1)
        above = _nearest_valid(p, m, +1)
        raise ValueError(
            f"{builder}: n_microbatches={m} cannot be split into equal rounds over num_ranks={p} "
            f"(m // p = {rounds} rounds, and {m} is not a multiple of {rounds}); use "
            f"n_microbatches <= {p}, a multiple of {p}, or another value whose rounds are "
            f"equal, e.g. {below} or {above}"
        )
    return m // rounds


def _nearest_valid(p: int, m: int, direction: int) -> int:
    candidate = m + direction
    while candidate > 1 and candidate % max(1, candidate // p):
        candidate += direction
    return max(candidate, 1)


def build_interleaved_1f1b_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Order:
    """Interleaved 1F1B's order: ``v = stages_per_rank`` stages per rank, loop placement.

    Stage ``s`` runs on rank ``s % p``, so the model is cut into ``v*p`` smaller
    stages and a micro-batch visits every rank ``v`` times. The bubble shrinks
    ``v``-fold: with ``F = B`` per stage and ``m`` a multiple of ``p`` it is
    exactly ``(p-1)/(v*m)`` of the ideal compute time, for ``v`` times the
    point-to-point traffic. See [Note: interleaved rounds] for which ``m`` are
    accepted; others raise a ValueError that names values that work.
    """
    p, m = check_ranks_and_micros(_NAME, num_ranks, n_microbatches)
    v = check_count(_NAME, "stages_per_rank", stages_per_rank, "use 1 (plain 1F1B placement) or more")
    g = interleaved_round_size(p, m)
    total = v * m
    order: Order = {}
    for rank in range(p):
        warmup = min((v - 1) * g + 2 * (p - 1 - rank), total)
        fwd = [interleaved_op(k, rank, p, v, g, F) for k in range(total)]
        bwd = [interleaved_op(k, rank, p, v, g, B) for k in range(total)]
        steps = fwd[:warmup]
        for k in range(total - warmup):
            steps += [fwd[warmup + k], bwd[k]]
        steps += bwd[total - warmup :]
        order[rank] = steps
    return order


def interleaved_op(k: int, rank: int, p: int, v: int, g: int, kind: MetaStepType) -> MetaStep:
    """The ``k``-th forward (or backward) of ``rank`` under [Note: interleaved rounds]."""
    round_index, within = divmod(k, g * v)
    local = within // g
    if kind is not F:
        local = v - 1 - local
    return MetaStep(round_index * g + within % g, kind, local * p + rank)

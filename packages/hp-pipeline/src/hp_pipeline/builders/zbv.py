"""ZB-V: two stages per rank folded into a V, split backward, 1F1B's memory.

Details: [Note: ZB-V construction].
"""

from __future__ import annotations

from hp_pipeline.builders._common import F, I, W, check_ranks_and_micros
from hp_pipeline.ir import MetaStep, MetaStepType, Order

__all__ = ["build_zbv_order"]


class _Chunk:
    """One of a rank's two stages: the next micro-batch of each kind to list."""

    __slots__ = ("next", "stage")

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.next = {F: 0, I: 0, W: 0}

    def step(self, kind: MetaStepType) -> MetaStep:
        i = self.next[kind]
        self.next[kind] = i + 1
        return MetaStep(i, kind, self.stage)


# [Note: ZB-V construction]
# Rank ``r`` holds stages ``r`` (its first chunk, ``a``) and ``2p-1-r`` (its
# second, ``b``): the ``"v"`` placement, so a micro-batch runs down the ranks
# through the first chunks, turns on rank ``p-1`` and comes back up through the
# second ones, and the last stage (the loss) is on rank 0 again. The order is
# the hand-made one of the ZB-V paper (Qi et al., 2024, section 6), the same
# phases as torch's ``ScheduleZBVZeroBubble``. With ``n = max(m, 2p-1)``
# micro-batches (the extra ones are dropped at the end, so a short batch keeps
# the shape of the order), rank ``r``:
#
# 1. stays idle ``r`` slots (nothing is listed: it just waits for its input);
# 2. runs ``2(p-r)-1`` forwards of ``a``;
# 3. ``r`` times: ``F`` of ``b``, ``F`` of ``a``;
# 4. ``p-r`` times: ``F``, ``I``, ``W`` of ``b`` (the turn of the V is busy);
# 5. the steady phase, while ``b`` has forwards left: ``F`` of ``a`` (while it
#    has any), ``I`` and ``W`` of ``a``, then ``F``, ``I`` and ``W`` of ``b``;
# 6. ``r`` times: ``I`` of ``a``, ``I`` of ``b`` (input gradients first: they
#    are on every upstream rank's critical path);
# 7. ``p-r`` times: ``I`` of ``a``, then the oldest ``W`` of ``a``;
# 8. the ``W`` steps of ``b`` left, then those of ``a``.
#
# Why this order rather than a greedy list scheduler tuned for free
# communication (what this module built before): each rank runs a
# micro-batch's ``F``, ``I`` and ``W`` of a chunk back to back and hands the
# result on at once, so every transfer has a whole ``F``/``I``/``W`` triple of
# the other chunk to arrive in. Timed by ``simulate`` with ``F = I = W = 1``,
# both reach the fill bound ``6m + p - 1`` with free transfers (``m >= 2p``),
# but with a transfer latency of one ``F`` the greedy order took 83 units for
# ``p = 4, m = 8`` and this one takes 65 (``comm = 2``: 115 against 83): on real
# links (and on CPU ranks, where each hop is a wake-up) that is the step time.
# Peak memory is 1F1B's: at most ``2p`` live activations per rank, each half a
# 1F1B stage's.


def _rank_order(rank: int, p: int, n: int) -> list[MetaStep]:
    """Rank ``rank``'s list over ``n`` micro-batches ([Note: ZB-V construction], phases 2 to 8)."""
    a, b = _Chunk(rank), _Chunk(2 * p - 1 - rank)
    steps: list[MetaStep] = []
    steps += [a.step(F) for _ in range(2 * (p - rank) - 1)]
    for _ in range(rank):
        steps += [b.step(F), a.step(F)]
    for _ in range(p - rank):
        steps += [b.step(F), b.step(I), b.step(W)]
    while b.next[F] < a.next[F] or a.next[F] < n:
        if a.next[F] < n:
            steps.append(a.step(F))
        steps += [a.step(I), a.step(W), b.step(F), b.step(I), b.step(W)]
    for _ in range(rank):
        steps += [a.step(I), b.step(I)]
    for _ in range(p - rank):
        steps += [a.step(I), a.step(W)]
    steps += [b.step(W) for _ in range(b.next[I] - b.next[W])]
    steps += [a.step(W) for _ in range(a.next[I] - a.next[W])]
    return steps


def build_zbv_order(num_ranks: int, n_microbatches: int) -> Order:
    """ZB-V's order over ``2 * num_ranks`` stages in the V placement.

    See [Note: ZB-V construction]. Any ``p, m >= 1`` works; the order depends
    only on ``(p, m)``. Time it with real costs through ``simulate``.
    """
    p, m = check_ranks_and_micros("build_zbv_order", num_ranks, n_microbatches)
    n = max(m, 2 * p - 1)
    order: Order = {}
    for rank in range(p):
        steps = _rank_order(rank, p, n)
        order[rank] = [s for s in steps if s.micro_index is not None and s.micro_index < m]
    return order

"""Interleaved zero bubble (ZB1P): interleaved 1F1B with the backward split into ``I`` and ``W``.

Details: [Note: interleaved zero bubble].
"""

from __future__ import annotations

from collections import deque

from hp_pipeline.builders._common import F, I, W, check_count, check_ranks_and_micros
from hp_pipeline.builders.interleaved import interleaved_op, round_size
from hp_pipeline.ir import MetaStep, Order

__all__ = ["build_interleaved_zero_bubble_order"]

_NAME = "build_interleaved_zero_bubble_order"


# [Note: interleaved zero bubble]
# The zero-bubble paper's ZB-1p (Qi et al., 2024) applied to the interleaved
# placement, as torch's ``ScheduleInterleavedZeroBubble`` does. Stages and
# rounds are those of interleaved 1F1B (loop placement, [Note: interleaved
# rounds]: the same ``m`` are accepted), and each rank walks its forwards and
# input-gradient backwards in the same chunk order. What changes:
#
# * the warm-up is one forward per hop shorter: rank ``r`` runs
#   ``(v-1)*g + (p-1-r)`` forwards (interleaved 1F1B needs ``2*(p-1-r)`` more,
#   because its full backward is twice as long as the ``I`` the upstream rank
#   waits for here);
# * the steady phase runs ``F`` then ``I``; rank ``r`` postpones the weight
#   gradients of its first ``r`` steady iterations and afterwards runs the
#   oldest postponed ``W`` after each ``I``, so the ``W`` steps, which nobody
#   waits for, fill the slots where interleaved 1F1B idles;
# * the cool-down runs the remaining ``I`` steps, each followed by the oldest
#   ``W`` once ``r`` of them are held back, then the ``W`` steps left.
#
# With one stage per rank this is ZB-H1's order with torch's cool-down rule.


def build_interleaved_zero_bubble_order(
    num_ranks: int, n_microbatches: int, stages_per_rank: int = 2
) -> Order:
    """Interleaved zero bubble's order: ``v = stages_per_rank`` stages per rank, split backward.

    See [Note: interleaved zero bubble]. ``m`` must split into equal rounds
    (``m <= p`` or a multiple of ``m // p``, as for interleaved 1F1B); other
    values raise a ValueError naming values that work.
    """
    p, m = check_ranks_and_micros(_NAME, num_ranks, n_microbatches)
    v = check_count(_NAME, "stages_per_rank", stages_per_rank, "use 1 (ZB-H1's placement) or more")
    g = round_size(_NAME, p, m)
    total = v * m
    order: Order = {}
    for rank in range(p):
        warmup = min((v - 1) * g + (p - 1 - rank), total)
        steps = [interleaved_op(k, rank, p, v, g, F) for k in range(warmup)]
        postponed: deque[MetaStep] = deque()
        for k in range(total):
            if warmup + k < total:
                steps.append(interleaved_op(warmup + k, rank, p, v, g, F))
            backward = interleaved_op(k, rank, p, v, g, I)
            steps.append(backward)
            postponed.append(MetaStep(backward.micro_index, W, backward.stage_index))
            if k >= rank:
                steps.append(postponed.popleft())
        steps += postponed
        order[rank] = steps
    return order

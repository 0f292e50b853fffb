"""ZB-H1: split the backward so weight gradients fill 1F1B's bubble (Qi et al., 2024).

Details: [Note: ZB-H1].
"""

from __future__ import annotations

from collections import deque

from hp_pipeline.builders._common import F, I, W, check_ranks_and_micros
from hp_pipeline.ir import MetaStep, Order

__all__ = ["build_zero_bubble_h1_order"]


# [Note: ZB-H1]
# The backward of a stage is split into ``I`` (the input gradient, which the
# previous stage is waiting for) and ``W`` (the weight gradient, which nobody
# waits for). Running ``I`` at once and ``W`` later shortens the critical path of
# the cool-down, and the postponed ``W`` steps fill the idle slots.
#
# Rank ``r`` (stage ``r``):
#
# * warms up with ``min(p-1-r, m)`` forwards, like 1F1B;
# * in the steady phase runs ``F`` then ``I``; it postpones the ``W`` of its first
#   ``r`` steady iterations and afterwards runs the oldest postponed ``W`` after
#   each ``I``;
# * in the cool-down runs each remaining ``I`` followed by the oldest postponed
#   ``W``, then the ``W`` steps still left.
#
# Rank ``r`` postpones ``r`` weight gradients while it has ``p-1-r`` warm-up
# micro-batches in flight, so no rank holds more than ``p`` micro-batches, the
# same peak as 1F1B. With ``F = I = W`` and ``m >= p``, every rank idles
# ``(p-1)*F`` instead of 1F1B's ``3*(p-1)*F``: a third.


def build_zero_bubble_h1_order(num_ranks: int, n_microbatches: int) -> Order:
    """ZB-H1's order: stage ``r`` on rank ``r``, backward split into ``I`` and ``W``.

    Same activation memory as 1F1B and about a third of its bubble when
    ``F = I = W`` (see [Note: ZB-H1]). Any ``p, m >= 1`` works.
    """
    p, m = check_ranks_and_micros("build_zero_bubble_h1_order", num_ranks, n_microbatches)
    order: Order = {}
    for rank in range(p):
        warmup = min(p - 1 - rank, m)
        steps = [MetaStep(i, F, rank) for i in range(warmup)]
        postponed: deque[int] = deque()
        for k in range(m - warmup):
            steps += [MetaStep(warmup + k, F, rank), MetaStep(k, I, rank)]
            postponed.append(k)
            if k >= rank:
                steps.append(MetaStep(postponed.popleft(), W, rank))
        for k in range(m - warmup, m):
            steps.append(MetaStep(k, I, rank))
            postponed.append(k)
            steps.append(MetaStep(postponed.popleft(), W, rank))
        steps += [MetaStep(i, W, rank) for i in postponed]
        order[rank] = steps
    return order

"""GPipe: all forwards, then all backwards (Huang et al., 2019)."""

from __future__ import annotations

from hp_pipeline.builders._common import B, F, check_ranks_and_micros
from hp_pipeline.ir import MetaStep, Order

__all__ = ["build_gpipe_order"]


def build_gpipe_order(num_ranks: int, n_microbatches: int) -> Order:
    """GPipe's order: stage ``r`` on rank ``r``, ``F`` for every micro-batch, then ``B``.

    The simplest schedule and the reference the others are measured against:
    every rank keeps all ``m`` micro-batches' activations alive at the turn, and
    with ``F = B`` the bubble is ``(p-1)/(m+p-1)`` of the step. Any ``p, m >= 1``
    works. Backwards run in micro-batch order, as torch's ``ScheduleGPipe`` does.
    """
    p, m = check_ranks_and_micros("build_gpipe_order", num_ranks, n_microbatches)
    return {
        rank: [MetaStep(i, F, rank) for i in range(m)] + [MetaStep(i, B, rank) for i in range(m)]
        for rank in range(p)
    }

"""Looped BFS: several stages per rank, each run breadth-first over all micro-batches.

Details: [Note: looped BFS].
"""

from __future__ import annotations

from hp_pipeline.builders._common import B, F, check_count, check_ranks_and_micros
from hp_pipeline.ir import MetaStep, Order

__all__ = ["build_looped_bfs_order"]

_NAME = "build_looped_bfs_order"


# [Note: looped BFS]
# Breadth-first pipeline parallelism (Lamy-Poirier, 2023) places stages like
# interleaved 1F1B (loop: stage ``s`` on rank ``s % p``) but orders them like
# GPipe: rank ``r`` runs the forward of *every* micro-batch through its first
# local stage, then through its next, and so on; then the backwards, last local
# stage first, each over the micro-batches in reverse order (the most recent
# activations first, as torch's ``ScheduleLoopedBFS``). A micro-batch's
# activation reaches the next rank while that rank is still busy with the
# previous chunk, so for ``m >= p`` the pipeline never drains between chunks
# and the bubble is interleaved 1F1B's, ``(p-1)/(v*m)`` of the ideal time with
# ``F = B``; the price is GPipe's memory (every micro-batch of every local
# stage is alive at the turn), which in exchange lets FSDP gather each stage
# once and run it over all micro-batches back to back.


def build_looped_bfs_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Order:
    """Looped BFS's order: ``v = stages_per_rank`` stages per rank, loop placement.

    See [Note: looped BFS]. Any ``p, m, v >= 1`` works; with ``m < p`` a rank
    waits between its chunks (the bubble grows as for GPipe).
    """
    p, m = check_ranks_and_micros(_NAME, num_ranks, n_microbatches)
    v = check_count(_NAME, "stages_per_rank", stages_per_rank, "use 1 (GPipe's order) or more")
    order: Order = {}
    for rank in range(p):
        local = [rank + j * p for j in range(v)]
        forwards = [MetaStep(i, F, s) for s in local for i in range(m)]
        backwards = [MetaStep(i, B, s) for s in reversed(local) for i in reversed(range(m))]
        order[rank] = forwards + backwards
    return order

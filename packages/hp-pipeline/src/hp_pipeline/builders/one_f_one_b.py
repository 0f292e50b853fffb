"""1F1B: bound activation memory by starting backwards as early as possible (PipeDream-Flush)."""

from __future__ import annotations

from hp_pipeline.builders._common import check_ranks_and_micros, one_f_one_b_rank
from hp_pipeline.ir import Order

__all__ = ["build_1f1b_order"]


def build_1f1b_order(num_ranks: int, n_microbatches: int) -> Order:
    """1F1B's order: stage ``r`` on rank ``r``; warm up, alternate, cool down.

    Rank ``r`` runs ``min(p-1-r, m)`` forwards (the warm-up, which fills the
    pipeline below it), then alternates one forward and one backward, then runs
    the backwards left. The bubble equals GPipe's, but rank ``r`` never holds
    more than ``min(p-r, m)`` micro-batches' activations (``p`` on the first
    stage) instead of ``m``. Any ``p, m >= 1`` works; with ``m < p`` the warm-up
    is cut to ``m`` and the order degenerates gracefully to GPipe's.
    """
    p, m = check_ranks_and_micros("build_1f1b_order", num_ranks, n_microbatches)
    return {rank: one_f_one_b_rank(rank, min(p - 1 - rank, m), m) for rank in range(p)}

"""ZB-V: two stages per rank folded into a V, split backward, 1F1B's memory.

[Note: ZB-V construction]
Rank ``r`` holds stages ``r`` and ``2p-1-r`` (the ``"v"`` placement), so a
micro-batch runs down the ranks and back up, and the last stage (the loss) is
on rank 0 again. The order is not transcribed from a figure; it is produced
by a list scheduler that plays the pipeline in unit time (``F = I = W = 1``,
free communication) and, whenever a rank is free, starts the first ready step
in this priority:

1. ``F`` of the second chunk, then of the first, while the rank holds fewer
   than ``2p`` live micro-batch activations: that is 1F1B's peak memory (a
   ZB-V stage is half a 1F1B stage). Forwards keep the V full, and the cap is
   what makes backwards start in time;
2. ``I`` of the first chunk, then of the second: when both are ready the first
   chunk's belongs to the older micro-batch, and input gradients are on the
   critical path of every upstream stage;
3. ``W``, oldest first: nobody waits for weight gradients, so they fill gaps
   (and free the activations that the cap counts).

Within a stage, forwards and input gradients run in micro-batch order. In unit
time every rank ``r`` is idle at least ``r`` slots before its first forward, so
the makespan is at least ``6m + p - 1``; the scheduler reaches that bound for
``m >= 2p`` (checked in the tests for ``p <= 8``), i.e. the last rank has no
bubble beyond the unavoidable fill.
"""

from __future__ import annotations

from collections import deque

from hp_pipeline.builders._common import F, I, W, check_ranks_and_micros
from hp_pipeline.ir import MetaStep, Order

__all__ = ["build_zbv_order"]


def build_zbv_order(num_ranks: int, n_microbatches: int) -> Order:
    """ZB-V's order over ``2 * num_ranks`` stages in the V placement.

    See [Note: ZB-V construction]. Any ``p, m >= 1`` works. The order depends
    only on ``(p, m)``; time it with real costs through ``simulate``.
    """
    p, m = check_ranks_and_micros("build_zbv_order", num_ranks, n_microbatches)
    num_stages = 2 * p
    limit = 2 * p
    local = {rank: (rank, num_stages - 1 - rank) for rank in range(p)}
    fwd_end: dict[tuple[int, int], int] = {}
    inp_end: dict[tuple[int, int], int] = {}
    next_fwd = [0] * num_stages
    next_inp = [0] * num_stages
    postponed: dict[int, deque[tuple[int, int]]] = {rank: deque() for rank in range(p)}
    live = [0] * p
    order: Order = {rank: [] for rank in range(p)}
    remaining = 3 * num_stages * m

    def done(ends: dict[tuple[int, int], int], key: tuple[int, int], now: int) -> bool:
        end = ends.get(key)
        return end is not None and end <= now

    def forward_ready(stage: int, now: int) -> bool:
        i = next_fwd[stage]
        return i < m and (stage == 0 or done(fwd_end, (stage - 1, i), now))

    def input_grad_ready(stage: int, now: int) -> bool:
        i = next_inp[stage]
        return (
            i < m
            and done(fwd_end, (stage, i), now)
            and (stage == num_stages - 1 or done(inp_end, (stage + 1, i), now))
        )

    now = 0
    while remaining:
        before = remaining
        for rank in range(p):
            first, second = local[rank]
            step = None
            if live[rank] < limit:
                for stage in (second, first):
                    if forward_ready(stage, now):
                        i = next_fwd[stage]
                        next_fwd[stage] += 1
                        fwd_end[stage, i] = now + 1
                        live[rank] += 1
                        step = MetaStep(i, F, stage)
                        break
            if step is None:
                for stage in (first, second):
                    if input_grad_ready(stage, now):
                        i = next_inp[stage]
                        next_inp[stage] += 1
                        inp_end[stage, i] = now + 1
                        postponed[rank].append((stage, i))
                        step = MetaStep(i, I, stage)
                        break
            if step is None and postponed[rank]:
                stage, i = postponed[rank].popleft()
                live[rank] -= 1
                step = MetaStep(i, W, stage)
            if step is not None:
                order[rank].append(step)
                remaining -= 1
        if remaining == before:  # pragma: no cover - nothing changes in later slots either
            raise RuntimeError(f"build_zbv_order stalled for p={p}, m={m}; please report this")
        now += 1
    return order

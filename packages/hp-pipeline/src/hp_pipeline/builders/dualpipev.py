"""DualPipeV: the V placement with overlapped forward/backward pairs (DeepSeek-V3's DualPipe, folded).

Details: [Note: DualPipeV].
"""

from __future__ import annotations

from collections import deque

from hp_pipeline.builders._common import B, F, I, W, check_ranks_and_micros
from hp_pipeline.ir import MetaStep, Order

__all__ = ["build_dualpipev_order", "dualpipev_min_microbatches"]

_NAME = "build_dualpipev_order"


def dualpipev_min_microbatches(num_ranks: int) -> int:
    """The fewest micro-batches DualPipeV runs over ``num_ranks`` ranks: one per stage, ``2p``."""
    return 2 * num_ranks


class _RankOrder:
    """One rank's list while it is built: the next micro-batch of each stage and kind, the held ``W``."""

    def __init__(self, first: int, second: int) -> None:
        self.steps: list[MetaStep] = []
        self._next_forward = {first: 0, second: 0}
        self._next_backward = {first: 0, second: 0}
        self._postponed: deque[MetaStep] = deque()

    def forward(self, stage: int) -> MetaStep:
        micro = self._next_forward[stage]
        self._next_forward[stage] = micro + 1
        return MetaStep(micro, F, stage)

    def backward(self, stage: int, *, split: bool = False) -> MetaStep:
        """The stage's next backward: ``B``, or ``I`` with its ``W`` held back for :meth:`weight`."""
        micro = self._next_backward[stage]
        self._next_backward[stage] = micro + 1
        if split:
            self._postponed.append(MetaStep(micro, W, stage))
            return MetaStep(micro, I, stage)
        return MetaStep(micro, B, stage)

    def add(self, *steps: MetaStep) -> None:
        self.steps.extend(steps)

    def pair(self, forward_stage: int, backward_stage: int) -> None:
        self.steps.append(MetaStep.overlap(self.forward(forward_stage), self.backward(backward_stage)))

    def weight(self) -> None:
        """Run the oldest postponed ``W``, if any."""
        if self._postponed:
            self.steps.append(self._postponed.popleft())


# [Note: DualPipeV]
# DualPipe (DeepSeek-AI, 2024) runs two pipelines in opposite directions and
# pairs, on each rank, the forward of one micro-batch with the backward of
# another ("F&B"), so that the expensive communication of each hides behind
# the other's compute. DualPipeV is its "cut in half" form
# (github.com/deepseek-ai/DualPipe): one pipeline over ``2p`` stages in the V
# placement, rank ``r`` holding stages ``r`` (its first chunk) and ``2p-1-r``
# (its second), so a micro-batch goes down the ranks through the first chunks
# and back up through the second ones. Same phases as torch's
# ``ScheduleDualPipeV``, for rank ``r`` with ``a`` its first stage and ``b``
# its second:
#
# 1. ``2*(p-1-r)`` forwards of ``a`` (the deeper the rank, the fewer);
# 2. ``r+1`` times: ``F`` of ``a``, ``F`` of ``b``;
# 3. ``p-1-r`` times: ``I`` of ``b``, its ``W``, ``F`` of ``b`` (zero bubble);
# 4. the steady phase, ``m - 2p + r + 1`` times: the pair (``F`` of ``a``,
#    ``B`` of ``b``), then the pair (``F`` of ``b``, ``B`` of ``a``); on the
#    last rank the very first of these runs as two plain steps, which starts
#    the turn of the V one step sooner;
# 5. ``p-1-r`` times: ``B`` of ``b``, then the pair (``F`` of ``b``, ``B`` of ``a``);
# 6. ``r+1`` times: a backward of ``b``, then of ``a``; from the middle of
#    this phase on, backwards are split (``I`` now, ``W`` later);
# 7. ``p-1-r`` times: the oldest postponed ``W``, then a backward of ``a``;
# 8. the ``r+1`` postponed ``W`` steps left.
#
# Every pair joins a forward with the backward of an older micro-batch, so its
# halves never wait for each other. The steady phase needs
# ``m >= 2p`` micro-batches (as torch requires), which also makes the pipeline
# full before the first pair.


def build_dualpipev_order(num_ranks: int, n_microbatches: int) -> Order:
    """DualPipeV's order over ``2 * num_ranks`` stages in the V placement, with ``OVERLAP_F_B`` pairs.

    See [Note: DualPipeV]. Needs ``n_microbatches >= 2 * num_ranks``; fewer
    raise a ValueError naming the smallest ``m`` that works.
    """
    p, m = check_ranks_and_micros(_NAME, num_ranks, n_microbatches)
    least = dualpipev_min_microbatches(p)
    if m < least:
        raise ValueError(
            f"{_NAME}: n_microbatches={m} is fewer than the {least} stages of DualPipeV over "
            f"num_ranks={p} (2 per rank); its steady phase pairs each forward with the backward of "
            f"an older micro-batch, so it needs at least one micro-batch per stage: use "
            f"n_microbatches >= {least}"
        )
    return {rank: _rank_order(rank, p, m) for rank in range(p)}


def _rank_order(rank: int, p: int, m: int) -> list[MetaStep]:
    """Phases 1-8 of [Note: DualPipeV] for one rank."""
    a, b = rank, 2 * p - 1 - rank
    deeper = p - 1 - rank  # ranks below this one, to the turn of the V
    out = _RankOrder(a, b)
    for _ in range(2 * deeper):  # 1
        out.add(out.forward(a))
    for _ in range(rank + 1):  # 2
        out.add(out.forward(a), out.forward(b))
    for _ in range(deeper):  # 3
        out.add(out.backward(b, split=True))
        out.weight()
        out.add(out.forward(b))
    for k in range(m - 2 * p + rank + 1):  # 4
        if k == 0 and rank == p - 1:
            out.add(out.forward(a), out.backward(b))
        else:
            out.pair(a, b)
        out.pair(b, a)
    for _ in range(deeper):  # 5
        out.add(out.backward(b))
        out.pair(b, a)
    split = False
    middle = (rank + 1) // 2
    for k in range(rank + 1):  # 6
        split = split or (k == middle and rank % 2 == 1)
        out.add(out.backward(b, split=split))
        split = split or (k == middle and rank % 2 == 0)
        out.add(out.backward(a, split=split))
    for _ in range(deeper):  # 7
        out.weight()
        out.add(out.backward(a, split=split))
    for _ in range(rank + 1):  # 8
        out.weight()
    return out.steps

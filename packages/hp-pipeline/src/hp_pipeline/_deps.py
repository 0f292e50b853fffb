"""The data-flow model every pass shares: which step needs which, and over which wire.

[Note: dependency model]
A step on stage ``s`` for micro-batch ``i`` depends on:

* ``F(s, i)`` on ``F(s-1, i)`` (the activation), and on the loaded micro-batch
  when ``s`` is the loading stage or receives the data (``RECV_D``);
* ``B(s, i)`` / ``I(s, i)`` on ``F(s, i)`` and on the input-gradient backward
  (``B`` or ``I``) of ``s+1`` for the same micro-batch (the output gradient);
* ``W(s, i)`` on ``I(s, i)``;
* a send on the step that produced its payload, and the consumer of a payload
  on the receive that brought it.

An edge between stages on different ranks is carried by a SEND/RECV pair once
communication is inserted; an edge within a rank is a local hand-off, ordered
by the rank's list alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hp_pipeline.errors import ScheduleError
from hp_pipeline.ir import MATCHING_TYPE, MetaStep, MetaStepType

F = MetaStepType.FWD
B = MetaStepType.BWD
I = MetaStepType.BWD_INPUT  # noqa: E741 - the torch-pipelining name of the step
W = MetaStepType.BWD_WEIGHT


@dataclass(frozen=True)
class Edge:
    """``consumer`` needs what ``producer`` made; ``send``/``recv`` would carry it across ranks."""

    producer: MetaStep
    consumer: MetaStep
    send: MetaStep
    recv: MetaStep


class OrderView:
    """Index of an order: where each step sits and which rank hosts each stage.

    Raises :class:`ScheduleError` when a step appears twice or a stage's steps
    are spread over several ranks, since no other question about the order has
    a meaningful answer then.
    """

    def __init__(self, order: Mapping[int, Sequence[MetaStep]]) -> None:
        self.order = {rank: list(steps) for rank, steps in order.items()}
        for rank, steps in self.order.items():
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise ScheduleError(f"ranks must be ints >= 0, got {rank!r}", self.order)
            for pos, step in enumerate(steps):
                if not isinstance(step, MetaStep):
                    raise ScheduleError(
                        f"rank {rank} position {pos} holds {step!r}, not a MetaStep",
                        self.order,
                    )
        self.position: dict[MetaStep, tuple[int, int]] = {}
        self.stage_rank: dict[int, int] = {}
        duplicates, misplaced = [], []
        for rank in sorted(self.order):
            for pos, step in enumerate(self.order[rank]):
                if step in self.position:
                    first = self.position[step]
                    duplicates.append(((rank, pos), first, step))
                    continue
                self.position[step] = (rank, pos)
                host = self.stage_rank.setdefault(step.stage_index, rank)
                if host != rank:
                    misplaced.append(((rank, pos), host, step))
        if duplicates:
            raise ScheduleError(
                "a step appears more than once; each step must run exactly once",
                self.order,
                [
                    f"{s} at rank {r} position {p} repeats rank {fr} position {fp}"
                    for (r, p), (fr, fp), s in duplicates
                ],
                [m for d in duplicates for m in d[:2]],
            )
        if misplaced:
            raise ScheduleError(
                "a stage has steps on more than one rank; each stage lives on exactly one rank",
                self.order,
                [
                    f"{s} is on rank {r} but stage {s.stage_index} already runs on rank {h}"
                    for (r, _), h, s in misplaced
                ],
                [m[0] for m in misplaced],
            )
        stages = set(self.stage_rank)
        stages.update(s.peer_stage for s in self.position if s.peer_stage is not None)
        self.num_stages = max(stages) + 1 if stages else 0
        self.has_comms = any(s.type.is_comm for s in self.position)
        loaders = sorted({s.stage_index for s in self.position if s.type is MetaStepType.DATA_LOAD})
        self.loader_stage = loaders[0] if len(loaders) == 1 else None
        self.loader_stages = loaders
        self._edges: dict[MetaStep, list[Edge]] = {}

    # -- lookups --------------------------------------------------------------

    def rank_of(self, stage: int) -> int | None:
        return self.stage_rank.get(stage)

    def pos(self, step: MetaStep) -> tuple[int, int] | None:
        return self.position.get(step)

    def backward_input(self, stage: int, micro: int) -> MetaStep:
        """The step that makes stage's input gradient: ``I`` when the order splits backward."""
        split = MetaStep(micro, I, stage)
        return split if split in self.position else MetaStep(micro, B, stage)

    def same_rank(self, a: int, b: int) -> bool:
        ra, rb = self.rank_of(a), self.rank_of(b)
        return ra is not None and ra == rb

    # -- the dependency model (see the module note) ---------------------------

    def edges_into(self, step: MetaStep) -> list[Edge]:
        """The edges from other stages into a local (non-comm) step (memoised: the passes ask often)."""
        edges = self._edges.get(step)
        if edges is None:
            edges = self._edges[step] = self._find_edges(step)
        return edges

    def _find_edges(self, step: MetaStep) -> list[Edge]:
        i, s = step.micro_index, step.stage_index
        if i is None:
            return []
        edges = []
        if step.type is F:
            if s > 0:
                edges.append(
                    Edge(
                        MetaStep(i, F, s - 1),
                        step,
                        MetaStep(i, MetaStepType.FWD_SEND, s - 1),
                        MetaStep(i, MetaStepType.FWD_RECV, s),
                    )
                )
            loader = self.loader_stage
            if loader is not None and loader != s:
                recv = MetaStep(i, MetaStepType.DATA_RECV, s, loader)
                if recv in self.position:
                    edges.append(
                        Edge(
                            MetaStep(i, MetaStepType.DATA_LOAD, loader),
                            step,
                            MetaStep(i, MetaStepType.DATA_SEND, loader, s),
                            recv,
                        )
                    )
        elif step.type.is_backward and s + 1 < self.num_stages:
            edges.append(
                Edge(
                    self.backward_input(s + 1, i),
                    step,
                    MetaStep(i, MetaStepType.BWD_SEND, s + 1),
                    MetaStep(i, MetaStepType.BWD_RECV, s),
                )
            )
        return edges

    def local_inputs(self, step: MetaStep) -> list[MetaStep]:
        """Same-stage steps that must come earlier in the same rank's list."""
        i, s, t = step.micro_index, step.stage_index, step.type
        if i is None:
            return []
        if t.is_backward:
            return [MetaStep(i, F, s)]
        if t is W:
            return [MetaStep(i, I, s)]
        if t is F and s == self.loader_stage:
            return [MetaStep(i, MetaStepType.DATA_LOAD, s)]
        if t is MetaStepType.FWD_SEND:
            return [MetaStep(i, F, s)]
        if t is MetaStepType.BWD_SEND:
            return [self.backward_input(s, i)]
        if t is MetaStepType.DATA_SEND:
            return [MetaStep(i, MetaStepType.DATA_LOAD, s)]
        return []

    def local_consumer(self, step: MetaStep) -> MetaStep | None:
        """For a RECV: the same-stage step that uses what it received."""
        i, s, t = step.micro_index, step.stage_index, step.type
        assert i is not None
        if t is MetaStepType.FWD_RECV or t is MetaStepType.DATA_RECV:
            return MetaStep(i, F, s)
        if t is MetaStepType.BWD_RECV:
            return self.backward_input(s, i)
        return None


def matching(step: MetaStep) -> MetaStep:
    """The other half of a SEND/RECV pair: same micro-batch, stage and peer swapped."""
    assert step.peer_stage is not None
    return MetaStep(step.micro_index, MATCHING_TYPE[step.type], step.peer_stage, step.stage_index)

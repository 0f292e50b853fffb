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

The loaded micro-batch comes from the stage whose ``LOAD`` names it; a plain
order loads everything on stage 0, an MPipe order loads each micro-batch on
its owning rank. MPipe adds (see :mod:`hp_pipeline.mpipe.order`):

* ``F(0, i)`` on ``PF(o, i)``, the tower's features of micro-batch ``i`` made
  on its owner stage ``o`` (``SEND_P``/``RECV_P`` when ``o`` is on another rank);
* ``PF(o, i)`` on ``LOAD(o, i)`` when the owner loads the micro-batch;
* ``PB(s, i)`` on the input-gradient backward of stage 0 (the gradient of the
  features, ``SEND_PG``/``RECV_PG`` when ``s`` is on another rank) and on
  ``PF(s, i)`` when the same stage ran the tower forward;
* ``REDUCE_P`` (a collective over every rank) on every ``PB`` of its rank.

An edge between stages on different ranks is carried by a SEND/RECV pair once
communication is inserted; an edge within a rank is a local hand-off, ordered
by the rank's list alone.

An ``OVERLAP_F_B`` step is a *node* of its rank's list that holds two steps
(its ``parts``). The index places both halves at the pair's position, so every
question about a half (where it runs, what it needs) has its usual answer;
the pair itself needs what its halves need (:meth:`OrderView.node_edges`).
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
PF = MetaStepType.PREPROCESS_FWD
PB = MetaStepType.PREPROCESS_BWD


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
        #: the half of an OVERLAP_F_B step -> the pair (the node of the rank's list)
        self.parent: dict[MetaStep, MetaStep] = {}
        duplicates, misplaced = [], []
        first_at: dict[int, tuple[int, int]] = {}  # stage -> where it first appeared
        for rank in sorted(self.order):
            for pos, node in enumerate(self.order[rank]):
                for step in (node, *node.sub_steps) if node.sub_steps is not None else (node,):
                    if step in self.position:
                        first = self.position[step]
                        duplicates.append(((rank, pos), first, step))
                        continue
                    self.position[step] = (rank, pos)
                    if step is not node:
                        self.parent[step] = node
                    host = self.stage_rank.setdefault(step.stage_index, rank)
                    first_at.setdefault(step.stage_index, (rank, pos))
                    if host != rank:
                        misplaced.append(((rank, pos), first_at[step.stage_index], step))
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
                    f"{s} is on rank {r} but stage {s.stage_index} already runs on rank {h} "
                    f"({self.order[h][p]} at position {p})"
                    for (r, _), (h, p), s in misplaced
                ],
                [m for d in misplaced for m in d[:2]],
            )
        stages = set(self.stage_rank)
        stages.update(s.peer_stage for s in self.position if s.peer_stage is not None)
        self.num_stages = max(stages) + 1 if stages else 0
        self.has_comms = any(s.type.is_comm for s in self.position)
        loaders = sorted({s.stage_index for s in self.position if s.type is MetaStepType.DATA_LOAD})
        self.loader_stage = loaders[0] if len(loaders) == 1 else None
        self.loader_stages = loaders
        # micro-batch -> the stage that loads it / runs its tower forward (first one found).
        self.loader_of: dict[int, int] = {}
        self.preprocess_of: dict[int, int] = {}
        self.preprocess_bwd_of_rank: dict[int, list[MetaStep]] = {}
        for step, (rank, _) in self.position.items():
            i = step.micro_index
            if step.type is MetaStepType.DATA_LOAD and i is not None:
                self.loader_of.setdefault(i, step.stage_index)
            elif step.type is PF and i is not None:
                self.preprocess_of.setdefault(i, step.stage_index)
            elif step.type is PB:
                self.preprocess_bwd_of_rank.setdefault(rank, []).append(step)
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

    def node(self, step: MetaStep) -> MetaStep:
        """The entry of a rank's list that runs ``step``: its pair, or the step itself."""
        return self.parent.get(step, step)

    @property
    def has_overlaps(self) -> bool:
        return bool(self.parent)

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

    def node_edges(self, node: MetaStep) -> list[Edge]:
        """The edges into an entry of a list: into each half of a pair, else into the step."""
        if node.sub_steps is None:
            return self.edges_into(node)
        return [edge for part in node.sub_steps for edge in self.edges_into(part)]

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
            loader = self.loader_of.get(i)
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
            owner = self.preprocess_of.get(i)
            if s == 0 and owner is not None:
                edges.append(
                    Edge(
                        MetaStep(i, PF, owner),
                        step,
                        MetaStep(i, MetaStepType.PREPROCESS_SEND, owner, 0) if owner else MetaStep(i, PF, 0),
                        MetaStep(i, MetaStepType.PREPROCESS_RECV, 0, owner) if owner else MetaStep(i, PF, 0),
                    )
                )
        elif step.type is PB and 0 in self.stage_rank:
            edges.append(
                Edge(
                    self.backward_input(0, i),
                    step,
                    MetaStep(i, MetaStepType.PREPROCESS_GRAD_SEND, 0, s) if s else step,
                    MetaStep(i, MetaStepType.PREPROCESS_GRAD_RECV, s, 0) if s else step,
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
        if t is MetaStepType.PREPROCESS_REDUCE:
            where = self.position.get(step)
            return list(self.preprocess_bwd_of_rank.get(where[0], ())) if where else []
        if i is None:
            return []
        if t is PF:
            return [MetaStep(i, MetaStepType.DATA_LOAD, s)] if self.loader_of.get(i) == s else []
        if t is PB:
            fwd = MetaStep(i, PF, s)
            return [fwd] if fwd in self.position else []
        if t is MetaStepType.PREPROCESS_SEND:
            return [MetaStep(i, PF, s)]
        if t is MetaStepType.PREPROCESS_GRAD_SEND:
            return [self.backward_input(s, i)]
        if t.is_backward:
            return [MetaStep(i, F, s)]
        if t is W:
            return [MetaStep(i, I, s)]
        if t is F and s == self.loader_of.get(i):
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
        if t is MetaStepType.PREPROCESS_RECV:
            return MetaStep(i, F, s)
        if t is MetaStepType.PREPROCESS_GRAD_RECV:
            return MetaStep(i, PB, s)
        return None


def matching(step: MetaStep) -> MetaStep:
    """The other half of a SEND/RECV pair: same micro-batch, stage and peer swapped."""
    assert step.peer_stage is not None
    return MetaStep(step.micro_index, MATCHING_TYPE[step.type], step.peer_stage, step.stage_index)

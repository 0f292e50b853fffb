"""MPipe's order: the tower's steps woven into a base pipeline order (:data:`MPIPE_BASES`).

Details in the [Note]s below: MPipe steps, MPipe bases, MPipe over overlapped
pairs, MPipe receive posting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

from hp_pipeline.builders import (
    build_1f1b_order,
    build_dualpipev_order,
    build_interleaved_1f1b_order,
    build_interleaved_zero_bubble_order,
    build_looped_bfs_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    stages_on_rank,
)
from hp_pipeline.builders.placement import Style
from hp_pipeline.comms import insert_comms
from hp_pipeline.ir import MetaStep, MetaStepType, Order
from hp_pipeline.mpipe.kinds import is_mpipe_kind
from hp_pipeline.mpipe.ownership import OverflowMode, mpipe_owned_micros, mpipe_owner
from hp_pipeline.mpipe.placement import place_tower_backward, place_tower_forward
from hp_pipeline.validate import validate_order

__all__ = [
    "MPIPE_BASES",
    "MPipeBase",
    "build_mpipe_order",
    "mpipe_base_layout",
    "mpipe_base_schedules",
    "mpipe_order",
    "mpipe_receives_lead",
    "strip_mpipe",
]

T = MetaStepType
# Codes, not kinds: this module is imported before MPipe's kinds are registered.
_DATA = frozenset({"LOAD", "SEND_D", "RECV_D"})
_MPIPE_RECVS = frozenset({"RECV_P", "RECV_D"})
# The step of stage 0 after which dL/dfeatures exists ([Note: MPipe bases]).
_INPUT_GRAD = frozenset({"B", "I"})


MPipeBase = Literal["1f1b", "interleaved", "looped-bfs", "zb-h1", "interleaved-zb", "zbv", "dualpipev"]


# [Note: MPipe bases]
# The MPipe steps only need three things of the base order: stage 0 lives on
# rank 0, each rank has a first ("home") stage that can name the rank's tower
# steps (rank ``r``'s is stage ``r`` in the loop and in the V placement), and
# stage 0 has exactly one step that produces the gradient of its inputs for
# each micro-batch: ``B``, or ``I`` when the base splits the backward.
# dL/dfeatures is ready after that step, so the tower's backward (``PB``, or
# the ``SEND_PG`` that feeds it) hangs off stage 0's ``I``, not its ``W``: the
# tower's backward then overlaps stage 0's deferred weight gradients, like any
# other input gradient in a zero-bubble schedule. These bases have all three:
#
# ====================  =================================  ===============  =========
# name                  schedule class                     stages per rank  placement
# ====================  =================================  ===============  =========
# ``"1f1b"``            ``Schedule1F1B``                   1                loop
# ``"interleaved"``     ``ScheduleInterleaved1F1B``        ``v >= 1``       loop
# ``"looped-bfs"``      ``ScheduleLoopedBFS``              ``v >= 2``       loop
# ``"zb-h1"``           ``ScheduleZeroBubble``             1                loop
# ``"interleaved-zb"``  ``ScheduleInterleavedZeroBubble``  ``v >= 1``       loop
# ``"zbv"``             ``ScheduleZBVZeroBubble``          2                V
# ``"dualpipev"``       ``ScheduleDualPipeV``              2                V
# ====================  =================================  ===============  =========
#
# GPipe is not offered: it has 1F1B's bubble with ``m`` live micro-batches
# instead of ``p``, and MPipe would keep every owner's tower graphs alive just
# as long. Looped BFS with one stage per rank *is* GPipe's order, so it needs
# two stages or more; with them it keeps GPipe's memory (every owner's tower
# graph lives until the backward pass) in exchange for interleaved 1F1B's
# bubble, which is its point.


@dataclass(frozen=True)
class _Base:
    """What MPipe needs to know of a base ([Note: MPipe bases]): its builder, class and layout."""

    build: Callable[[int, int, int], Order]  # (p, m, stages per rank) -> compute-only order
    schedule: str  # the schedule class of hp_pipeline.schedules that runs the base alone
    fixed: int | None  # the one stage count per rank it runs, or None: any count from `least`
    default: int  # the stage count per rank when the caller gives none
    style: Style
    least: int = 1


_BASES: dict[str, _Base] = {
    "1f1b": _Base(lambda p, m, v: build_1f1b_order(p, m), "Schedule1F1B", 1, 1, "loop"),
    "interleaved": _Base(build_interleaved_1f1b_order, "ScheduleInterleaved1F1B", None, 2, "loop"),
    # One stage per rank would be GPipe's order ([Note: MPipe bases]).
    "looped-bfs": _Base(build_looped_bfs_order, "ScheduleLoopedBFS", None, 2, "loop", least=2),
    "zb-h1": _Base(lambda p, m, v: build_zero_bubble_h1_order(p, m), "ScheduleZeroBubble", 1, 1, "loop"),
    "interleaved-zb": _Base(
        build_interleaved_zero_bubble_order, "ScheduleInterleavedZeroBubble", None, 2, "loop"
    ),
    "zbv": _Base(lambda p, m, v: build_zbv_order(p, m), "ScheduleZBVZeroBubble", 2, 2, "v"),
    "dualpipev": _Base(lambda p, m, v: build_dualpipev_order(p, m), "ScheduleDualPipeV", 2, 2, "v"),
}

#: The base orders MPipe weaves its steps into ([Note: MPipe bases]).
MPIPE_BASES: tuple[str, ...] = tuple(_BASES)


def mpipe_base_schedules() -> dict[str, str]:
    """Base name -> the name of the schedule class that runs that base alone (for ``base=`` as a class)."""
    return {name: spec.schedule for name, spec in _BASES.items()}


def mpipe_base_layout(base: str | None, stages_per_rank: int | None) -> tuple[MPipeBase, int, Style]:
    """``(base, stages_per_rank, placement)`` for a base name, checked; ``None`` picks by the stage count.

    ``base=None`` keeps the historical choice: 1F1B for one stage per rank,
    interleaved 1F1B for more. ``stages_per_rank=None`` means the base's own
    count (1 for 1F1B and ZB-H1, 2 for the others). Each base's table row in
    [Note: MPipe bases] says which counts it runs; a mismatch is an error
    naming the fix.
    """
    if stages_per_rank is None:
        stages_per_rank = _BASES[base].default if base in _BASES else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"MPipe: stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
    if base is None:
        return ("1f1b" if stages_per_rank == 1 else "interleaved"), stages_per_rank, "loop"
    spec = _BASES.get(base) if isinstance(base, str) else None
    if spec is None:
        raise ValueError(
            f"MPipe cannot build on base {base!r}; it weaves its steps into one of {list(MPIPE_BASES)} "
            "(see [Note: MPipe bases] in hp_pipeline.mpipe.order)"
        )
    fits = stages_per_rank == spec.fixed if spec.fixed is not None else stages_per_rank >= spec.least
    if not fits:
        want = spec.fixed if spec.fixed is not None else f">= {spec.least}"
        if spec.fixed == 1:
            hint = "pass this rank's single PipelineStage"
        elif spec.style == "v":
            hint = "pass [PipelineStage(chunk_a, r, 2 * p), PipelineStage(chunk_b, 2 * p - 1 - r, 2 * p)]"
        else:
            hint = f"pass a list of {spec.least} or more PipelineStages (loop placement)"
        others = [
            n
            for n, b in _BASES.items()
            if (b.fixed == stages_per_rank if b.fixed is not None else stages_per_rank >= b.least)
        ]
        raise ValueError(
            f"MPipe over base {base!r} runs {want} stage(s) per rank, got stages_per_rank="
            f"{stages_per_rank}; {hint}, or pick a base for {stages_per_rank} stage(s) per rank "
            f"({' or '.join(others)})"
        )
    return cast(MPipeBase, base), stages_per_rank, spec.style


# [Note: MPipe over overlapped pairs]
# DualPipeV runs most backwards inside ``OVERLAP_F_B`` pairs ([Note: DualPipeV]
# in :mod:`hp_pipeline.builders.dualpipev`): on rank 0 the pair
# ``(F of stage 2p-1; B of stage 0)`` holds stage 0's input-gradient step, so
# dL/dfeatures is made *inside* a pair. Nothing in the weave needs the pair
# taken apart: the dependency model already places both halves at the pair's
# position ([Note: dependency model] in :mod:`hp_pipeline._deps`), so the half
# ``0Bi`` is the producer of dL/dfeatures like a plain ``0Bi``, and the tower's
# backward goes after the *pair* (``PB`` on rank 0, or ``SEND_PG``, which the
# executor keeps after the backward half because its kind says it carries the
# backward's result: [Note: running overlapped steps] in
# :mod:`hp_pipeline.overlap`). The pair itself stays whole, so its forward's
# communication still hides behind its backward. The weave only has to look
# into the halves (a pair carries its *forward's* micro-batch) and never put a
# tower step between them; the placement ([Note: tower placement over pairs]
# in :mod:`hp_pipeline.mpipe.placement`) also keeps every pair runnable with
# both halves started at once, which is what ``validate_order`` demands.


def _input_grad_of_stage0(node: MetaStep) -> MetaStep | None:
    """Stage 0's input-gradient step in ``node`` (itself, or the backward half of a pair), else ``None``.

    A pair carries its forward's micro-batch, so the half is what names the
    micro-batch whose dL/dfeatures is ready ([Note: MPipe over overlapped pairs]).
    """
    for part in node.parts:
        if part.type.code in _INPUT_GRAD and part.stage_index == 0:
            return part
    return None


# [Note: MPipe steps]
# A multimodal model runs a *preprocess tower* (a vision encoder) on each
# micro-batch before the text stages. Plain pipelining puts the tower on stage
# 0, which then does the tower's work for every micro-batch. MPipe gives each
# micro-batch an owner rank ([Note: MPipe ownership]) that runs the tower for it
# and ships the features to stage 0. For each micro-batch ``i`` owned by rank
# ``r`` (whose first stage is ``o``; in the loop placement ``o == r``):
#
# * ``oLOADi`` (in-schedule loading only): rank ``r`` reads micro-batch ``i``;
#   the tensors stage 0 and the last stage need go to them (``SEND_D``/``RECV_D``);
# * ``oPFi``: the tower's forward, first at the start of rank ``r``'s list,
#   where the tower's work fills the warm-up bubble of the ranks below stage 0;
#   then each ``PF`` moves to the slot where it shortens the step most
#   ([Note: tower forward placement] in :mod:`hp_pipeline.mpipe.placement`):
#   stage 0's rank, for one, runs most of its own ``PF`` in its warm-up wait
#   for the first gradient instead of before its first forward;
# * ``oSEND_Pi->0`` / ``0RECV_Pi<-o``: the features, before stage 0's ``0Fi``;
# * ``oPBi``: the tower's backward. With the owner backward, stage 0 sends
#   dL/dfeatures back (``0SEND_PGi->o`` / ``oRECV_PGi<-0``) and the owner
#   backpropagates through the graph it kept. Without it, stage 0 recomputes
#   the tower from the inputs that travelled with the features: every ``PB``
#   is ``0PBi``. Each ``PB`` first goes where it is surely ready (rank 0's
#   right after its ``0Bi``, or ``0Ii`` on a zero-bubble base, see [Note:
#   MPipe bases], or after the pair that holds it on DualPipeV, see [Note:
#   MPipe over overlapped pairs]; another owner's at the end of its list), then moves to the
#   slot where it shortens the step most ([Note: tower backward placement]
#   in :mod:`hp_pipeline.mpipe.placement`): an owner's idle slot in the
#   steady state instead of a tail after its last pipeline step;
# * ``oREDUCE_P``: one per rank, last: the tower's gradients of this step are
#   summed over the pipeline group (a collective).
#
# A frozen tower has no ``PB``, ``SEND_PG``/``RECV_PG`` or ``REDUCE_P``. Removing
# the MPipe steps and the data steps (:func:`strip_mpipe`) from any rank's
# compute-only order gives the base builder's order exactly: MPipe only adds.
# Transfers are placed by :func:`~hp_pipeline.insert_comms`, so the order cannot
# deadlock, and ``validate_order`` checks the MPipe rules too.


def build_mpipe_order(
    num_ranks: int,
    n_microbatches: int,
    *,
    stages_per_rank: int | None = None,
    overflow_mode: OverflowMode = "full",
    owner_backward: bool = True,
    tower_backward: bool = True,
    load_data: bool = False,
    base: str | None = None,
    place_forward: bool = True,
    place_backward: bool = True,
) -> Order:
    """The compute-only MPipe order ([Note: MPipe steps]) over one of :data:`MPIPE_BASES`.

    Args:
        num_ranks, n_microbatches: ``p`` and ``m``.
        stages_per_rank: 1 for 1F1B / ZB-H1, ``v >= 1`` for interleaved 1F1B
            and interleaved zero bubble, ``v >= 2`` for looped BFS (loop
            placement), 2 for ZB-V and DualPipeV (V placement); ``None``: the
            base's own (1 for 1F1B and ZB-H1, else 2).
        overflow_mode: ``"full"`` or ``"min"`` ([Note: MPipe ownership]).
        owner_backward: the owner backpropagates through its kept graph
            (``True``) or stage 0 recomputes the tower (``False``).
        tower_backward: ``False`` for a frozen tower: no ``PB`` and no ``REDUCE_P``.
        load_data: each owner loads its micro-batches (``LOAD`` before ``PF``).
        base: a name in :data:`MPIPE_BASES`; ``None`` picks 1F1B or
            interleaved by ``stages_per_rank`` ([Note: MPipe bases]).
        place_forward: move each ``PF`` to the slot that shortens the simulated
            step most ([Note: tower forward placement]); ``False`` keeps every
            ``PF`` at the start of its owner's list.
        place_backward: move each ``PB`` to the slot that shortens the simulated
            step most ([Note: tower backward placement]); ``False`` keeps them
            where they are first put (after ``0Bi`` / ``0Ii``, or the pair that
            holds it, on rank 0; at the end of the list on the other owners).
    """
    kind, v, style = mpipe_base_layout(base, stages_per_rank)
    p, m = num_ranks, n_microbatches
    order: Order = {}
    for rank, steps in _BASES[kind].build(p, m, v).items():
        home = stages_on_rank(rank, p, v, style=style)[0]
        owned = mpipe_owned_micros(p, m, rank, overflow_mode)
        out: list[MetaStep] = []
        for i in owned:
            if load_data:
                out.append(MetaStep(i, T.DATA_LOAD, home))
            out.append(MetaStep(i, T.PREPROCESS_FWD, home))
        for step in steps:
            out.append(step)
            grad = _input_grad_of_stage0(step) if tower_backward and rank == 0 else None
            if grad is not None and (
                not owner_backward or mpipe_owner(p, m, grad.micro_index or 0, overflow_mode) == 0
            ):
                # After the pair, when the half is in one ([Note: MPipe over overlapped pairs]).
                out.append(MetaStep(grad.micro_index, T.PREPROCESS_BWD, 0))
        if tower_backward:
            if owner_backward and rank != 0:
                out += [MetaStep(i, T.PREPROCESS_BWD, home) for i in owned]
            out.append(MetaStep(None, T.PREPROCESS_REDUCE, home))
        order[rank] = out
    # Backward first: a forward pass never lengthens what it starts from, so the result is
    # never worse than placing the backward alone ([Note: tower forward placement]).
    if tower_backward and place_backward:
        order = place_tower_backward(order)
    if place_forward:
        order = place_tower_forward(order)
    return order


def mpipe_order(
    num_ranks: int,
    n_microbatches: int,
    *,
    stages_per_rank: int | None = None,
    overflow_mode: OverflowMode = "full",
    owner_backward: bool = True,
    tower_backward: bool = True,
    load_data: bool = False,
    base: str | None = None,
    place_forward: bool = True,
    place_backward: bool = True,
) -> Order:
    """:func:`build_mpipe_order` with communication inserted and validated: what the schedule runs.

    With ``load_data`` the data goes from each owner to stage 0 and to the last
    stage (``SEND_D``/``RECV_D``), unless they share the owner's rank.
    """
    order = build_mpipe_order(
        num_ranks,
        n_microbatches,
        stages_per_rank=stages_per_rank,
        overflow_mode=overflow_mode,
        owner_backward=owner_backward,
        tower_backward=tower_backward,
        load_data=load_data,
        base=base,
        place_forward=place_forward,
        place_backward=place_backward,
    )
    num_stages = num_ranks * mpipe_base_layout(base, stages_per_rank)[1]
    runnable = insert_comms(order, data_stages=[0, num_stages - 1] if load_data else None)
    validate_order(runnable, n_microbatches=n_microbatches, num_stages=num_stages, require_comms=True)
    return runnable


def strip_mpipe(order: Mapping[int, Sequence[MetaStep]]) -> Order:
    """``order`` without the MPipe steps and the data-loading steps (``LOAD``, ``SEND_D``, ``RECV_D``)."""
    return {
        rank: [s for s in steps if not is_mpipe_kind(s.type) and s.type.code not in _DATA]
        for rank, steps in order.items()
    }


# [Note: MPipe receive posting]
# Every MPipe transfer into stage 0 (features and data) is sent before its
# owner's first pipeline step whose output goes to stage 0's rank: the data
# from the start of the owner's list, the features after a ``PF`` that the
# placement keeps ahead of that step ([Note: tower forward placement] in
# :mod:`hp_pipeline.mpipe.placement`). So on stage 0's rank these receives
# come before any other receive from each peer in the step, and they can all
# be posted at once, in list order, at the start of the step, and each waited
# right before the forward that needs it (never earlier than the list order
# would wait it). :func:`mpipe_receives_lead` checks this property of an
# order, and the executor batches only when it holds.
#
# This is safe on gloo, where every operation progresses on its own. Backends
# that coalesce (NCCL, HCCL) run a rank's ``batch_isend_irecv`` groups one after
# another, each until all its operations are matched ([Note: coalesced batches]
# in :mod:`hp_pipeline.executor`), so a group of receives posted first holds
# back the rank's own later sends. With in-schedule loading an owner is also a
# receiver (the last stage's rank receives its targets), and two ranks that
# each post their receives from the other ahead of their sends to it wait for
# each other forever (found with hp-testing's ``nccl-emu``). There the MPipe
# receives are posted in list order like every other transfer: the executor
# does not batch them (``ScheduleMPipe.batched`` is ``False``).


def mpipe_receives_lead(steps: Sequence[MetaStep], peer_of: Mapping[int, int]) -> bool:
    """Whether every MPipe receive in ``steps`` precedes every other receive from the same peer rank.

    ``peer_of`` maps a stage to its rank. This is what lets the executor post
    all feature and data receives at the start of a step ([Note: MPipe receive posting]).
    """
    other_seen: set[int] = set()
    for step in steps:
        if not step.type.is_recv or step.peer_stage is None:
            continue
        peer = peer_of[step.peer_stage]
        if step.type.code in _MPIPE_RECVS:
            if peer in other_seen:
                return False
        else:
            other_seen.add(peer)
    return True

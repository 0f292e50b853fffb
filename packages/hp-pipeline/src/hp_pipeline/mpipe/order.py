"""MPipe's order: the tower's steps woven into a 1F1B or interleaved 1F1B order.

[Note: MPipe steps]
A multimodal model runs a *preprocess tower* (a vision encoder) on each
micro-batch before the text stages. Plain pipelining puts the tower on stage
0, which then does the tower's work for every micro-batch. MPipe gives each
micro-batch an owner rank ([Note: MPipe ownership]) that runs the tower for it
and ships the features to stage 0. For each micro-batch ``i`` owned by rank
``r`` (whose first stage is ``o``; in the loop placement ``o == r``):

* ``oLOADi`` (in-schedule loading only): rank ``r`` reads micro-batch ``i``;
  the tensors stage 0 and the last stage need go to them (``SEND_D``/``RECV_D``);
* ``oPFi``: the tower's forward, at the start of rank ``r``'s list, so the
  tower's work fills the warm-up bubble of the ranks below stage 0;
* ``oSEND_Pi->0`` / ``0RECV_Pi<-o``: the features, before stage 0's ``0Fi``;
* ``oPBi``: the tower's backward. With the owner backward, stage 0 sends
  dL/dfeatures back (``0SEND_PGi->o`` / ``oRECV_PGi<-0``) and the owner
  backpropagates through the graph it kept; the owner's ``PB`` steps go at
  the end of its list (rank 0's right after its ``0Bi``). Without it, stage 0
  recomputes the tower from the inputs that travelled with the features:
  every ``PB`` is ``0PBi``, right after ``0Bi``;
* ``oREDUCE_P``: one per rank, last: the tower's gradients of this step are
  summed over the pipeline group (a collective).

A frozen tower has no ``PB``, ``SEND_PG``/``RECV_PG`` or ``REDUCE_P``. Removing
the MPipe steps and the data steps (:func:`strip_mpipe`) from any rank's
compute-only order gives the base builder's order exactly: MPipe only adds.
Transfers are placed by :func:`~hp_pipeline.insert_comms`, so the order cannot
deadlock, and ``validate_order`` checks the MPipe rules too.

[Note: MPipe receive posting]
Every MPipe transfer into stage 0 (features and data) is sent from the start
of its owner's list, before the owner's first step that depends on another
rank. So on stage 0's rank these receives are the first receives from each
peer in the step, and they can all be posted at once, in list order, at the
start of the step, and each waited right before the forward that needs it
(on backends that coalesce a batch: the batch's one handle, waited before the
first such forward): the owners send them without waiting for anything.
:func:`mpipe_receives_lead` checks this property of an order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hp_pipeline.builders import build_1f1b_order, build_interleaved_1f1b_order, stages_on_rank
from hp_pipeline.comms import insert_comms
from hp_pipeline.ir import MetaStep, MetaStepType, Order
from hp_pipeline.mpipe.ownership import OverflowMode, mpipe_owned_micros, mpipe_owner
from hp_pipeline.validate import validate_order

__all__ = [
    "build_mpipe_order",
    "mpipe_order",
    "mpipe_receives_lead",
    "strip_mpipe",
]

T = MetaStepType
_DATA = frozenset({T.DATA_LOAD, T.DATA_SEND, T.DATA_RECV})
_MPIPE_RECVS = frozenset({T.PREPROCESS_RECV, T.DATA_RECV})


def _base(num_ranks: int, n_microbatches: int, stages_per_rank: int) -> Order:
    if stages_per_rank == 1:
        return build_1f1b_order(num_ranks, n_microbatches)
    return build_interleaved_1f1b_order(num_ranks, n_microbatches, stages_per_rank)


def build_mpipe_order(
    num_ranks: int,
    n_microbatches: int,
    *,
    stages_per_rank: int = 1,
    overflow_mode: OverflowMode = "full",
    owner_backward: bool = True,
    tower_backward: bool = True,
    load_data: bool = False,
) -> Order:
    """The compute-only MPipe order ([Note: MPipe steps]) over the 1F1B or interleaved base.

    Args:
        num_ranks, n_microbatches: ``p`` and ``m``.
        stages_per_rank: 1 for 1F1B, ``v > 1`` for interleaved 1F1B (loop placement).
        overflow_mode: ``"full"`` or ``"min"`` ([Note: MPipe ownership]).
        owner_backward: the owner backpropagates through its kept graph
            (``True``) or stage 0 recomputes the tower (``False``).
        tower_backward: ``False`` for a frozen tower: no ``PB`` and no ``REDUCE_P``.
        load_data: each owner loads its micro-batches (``LOAD`` before ``PF``).
    """
    base = _base(num_ranks, n_microbatches, stages_per_rank)
    p, m = num_ranks, n_microbatches
    order: Order = {}
    for rank, steps in base.items():
        home = stages_on_rank(rank, p, stages_per_rank)[0]
        owned = mpipe_owned_micros(p, m, rank, overflow_mode)
        out: list[MetaStep] = []
        for i in owned:
            if load_data:
                out.append(MetaStep(i, T.DATA_LOAD, home))
            out.append(MetaStep(i, T.PREPROCESS_FWD, home))
        for step in steps:
            out.append(step)
            if (
                tower_backward
                and rank == 0
                and step.type is T.BWD
                and step.stage_index == 0
                and (not owner_backward or mpipe_owner(p, m, step.micro_index or 0, overflow_mode) == 0)
            ):
                out.append(MetaStep(step.micro_index, T.PREPROCESS_BWD, 0))
        if tower_backward:
            if owner_backward and rank != 0:
                out += [MetaStep(i, T.PREPROCESS_BWD, home) for i in owned]
            out.append(MetaStep(None, T.PREPROCESS_REDUCE, home))
        order[rank] = out
    return order


def mpipe_order(
    num_ranks: int,
    n_microbatches: int,
    *,
    stages_per_rank: int = 1,
    overflow_mode: OverflowMode = "full",
    owner_backward: bool = True,
    tower_backward: bool = True,
    load_data: bool = False,
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
    )
    num_stages = num_ranks * stages_per_rank
    runnable = insert_comms(order, data_stages=[0, num_stages - 1] if load_data else None)
    validate_order(runnable, n_microbatches=n_microbatches, num_stages=num_stages, require_comms=True)
    return runnable


def strip_mpipe(order: Mapping[int, Sequence[MetaStep]]) -> Order:
    """``order`` without the MPipe steps and the data-loading steps (``LOAD``, ``SEND_D``, ``RECV_D``)."""
    return {
        rank: [s for s in steps if not s.type.is_preprocess and s.type not in _DATA]
        for rank, steps in order.items()
    }


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
        if step.type in _MPIPE_RECVS:
            if peer in other_seen:
                return False
        else:
            other_seen.add(peer)
    return True

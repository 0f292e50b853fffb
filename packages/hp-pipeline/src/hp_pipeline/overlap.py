"""How an ``OVERLAP_F_B`` step runs, is timed, and takes part in the FSDP steps.

Details: [Note: running overlapped steps].
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from hp_pipeline.fsdp import add_fsdp_steps
from hp_pipeline.ir import MetaStep, MetaStepType, Order

__all__ = ["add_fsdp_steps_with_overlaps", "has_overlaps", "split_order", "split_overlaps"]


def has_overlaps(order: Mapping[int, Sequence[MetaStep]]) -> bool:
    """Whether any rank of ``order`` runs an ``OVERLAP_F_B`` step."""
    return any(step.sub_steps is not None for steps in order.values() for step in steps)


def _carries(step: MetaStep, backward: MetaStep) -> bool:
    """Whether ``step`` sends what ``backward`` produces (so it must stay after the backward)."""
    # Kinds declare it: the input gradient's SEND_B, MPipe's SEND_PG ([Note: step-kind registry]).
    return (
        step.type.spec.carries_backward
        and step.stage_index == backward.stage_index
        and step.micro_index == backward.micro_index
    )


# [Note: running overlapped steps]
# An ``OVERLAP_F_B`` pairs a forward with the backward of another micro-batch
# ([Note: overlapped steps] in :mod:`hp_pipeline.ir`). The passes that check an
# order (``validate_order``, ``insert_comms``) hold it to the strict meaning
# that a runtime may start both halves at once: neither half may need the
# other, directly or through other ranks, and everything either half receives
# arrives before the pair. The executor then runs the pair in its *split form*
# (:func:`split_overlaps`): the forward, then the transfers that follow the pair
# in the rank's list up to the first one that carries the backward's result
# (the forward's outgoing activation among them), then the backward. So, in
# one training step:
#
# * the backward's incoming gradient (its receive was posted before the pair)
#   travels while the forward computes, and the forward's outgoing activation
#   is posted as soon as the forward ends and travels while the backward
#   computes: each half's communication hides behind the other's compute;
# * the two computations themselves run one after the other on the rank's one
#   compute thread. On CPU with gloo that is all there is to overlap (gloo
#   moves the bytes on its own threads); on an accelerator the halves could
#   also share the device through two streams, which this executor does not
#   do (torch.distributed.pipelining runs them one after the other too).
#
# The split form is still deadlock-free: it only moves the backward, a local
# compute step whose results leave the rank through sends that stay after it,
# later past some transfers, and a rank's compute can always be moved later in
# the global sequence of [Note: deadlock-free placement] in
# :mod:`hp_pipeline.comms`. Receives and sends keep their list order, so the
# argument of [Note: coalesced batches] in :mod:`hp_pipeline.executor` holds too.
# ``simulate`` times the split form (the forward's outputs leave when the
# forward ends, the backward starts when the forward is done and its own inputs
# are there), so simulated and executed orders are the same.


def split_overlaps(steps: Sequence[MetaStep]) -> list[MetaStep]:
    """One rank's list in the split form of [Note: running overlapped steps].

    Each ``OVERLAP_F_B`` becomes its forward, then the transfers that follow it
    up to the first that carries the backward's result (or the next step that is
    not a transfer), then its backward. Lists without pairs come back unchanged.
    """
    out: list[MetaStep] = []
    k, n = 0, len(steps)
    while k < n:
        step = steps[k]
        k += 1
        if step.sub_steps is None:
            out.append(step)
            continue
        forward, backward = step.sub_steps
        out.append(forward)
        while k < n and steps[k].type.is_comm and not _carries(steps[k], backward):
            out.append(steps[k])
            k += 1
        out.append(backward)
    return out


def split_order(order: Mapping[int, Sequence[MetaStep]]) -> Order:
    """Every rank's list in the split form (:func:`split_overlaps`)."""
    return {rank: split_overlaps(steps) for rank, steps in order.items()}


def add_fsdp_steps_with_overlaps(order: Mapping[int, Sequence[MetaStep]], stages: Collection[int]) -> Order:
    """:func:`~hp_pipeline.add_fsdp_steps` for an order that may pair steps.

    ``add_fsdp_steps`` places ``UNSHARD`` before a stage's first compute step
    and ``REDUCE_GRAD``/``RESHARD`` after its last; a pair holds compute of two
    stages. So the pairs are opened into their halves, the FSDP steps placed,
    and the pairs closed again, with any ``UNSHARD`` that fell between the
    halves moved before the pair and any other FSDP step after it: every stage
    is then unsharded for both halves and reduced after its last backward.
    """
    if not has_overlaps(order):
        return add_fsdp_steps(order, stages)
    opened = {rank: [part for step in steps for part in step.parts] for rank, steps in order.items()}
    placed = add_fsdp_steps(opened, stages)
    result: Order = {}
    for rank, steps in placed.items():
        pair_of = {step.sub_steps[0]: step for step in order[rank] if step.sub_steps is not None}
        out: list[MetaStep] = []
        k = 0
        while k < len(steps):
            step = steps[k]
            k += 1
            pair = pair_of.get(step)
            if pair is None:
                out.append(step)
                continue
            before: list[MetaStep] = []
            after: list[MetaStep] = []
            while steps[k] != pair.parts[1]:  # only FSDP steps can sit between the halves
                (before if steps[k].type is MetaStepType.UNSHARD else after).append(steps[k])
                k += 1
            k += 1
            out += [*before, pair, *after]
        result[rank] = out
    return result

"""insert_comms: pairs never cross, inputs are left alone, bad input is refused."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    Order,
    StepCosts,
    build_1f1b_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    insert_comms,
    validate_order,
)
from hp_pipeline.builders import stage_to_rank

T = MetaStepType
P = MetaStep.parse

BUILDS: dict[str, Callable[[], Order]] = {
    "gpipe": lambda: build_gpipe_order(4, 6),
    "1f1b": lambda: build_1f1b_order(4, 7),
    "interleaved": lambda: build_interleaved_1f1b_order(3, 6, 3),
    "zb-h1": lambda: build_zero_bubble_h1_order(4, 5),
    "zbv": lambda: build_zbv_order(3, 7),
}


_MATCH = {
    T.FWD_SEND: T.FWD_RECV,
    T.FWD_RECV: T.FWD_SEND,
    T.BWD_SEND: T.BWD_RECV,
    T.BWD_RECV: T.BWD_SEND,
    T.DATA_SEND: T.DATA_RECV,
    T.DATA_RECV: T.DATA_SEND,
}


def _peer(step: MetaStep) -> int:
    assert step.peer_stage is not None
    return step.peer_stage


def _peer_rank(step: MetaStep, order: Order) -> int:
    return next(r for r, steps in order.items() if any(s.stage_index == _peer(step) for s in steps))


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_two_ranks_see_their_transfers_in_the_same_order(name: str) -> None:
    order = insert_comms(BUILDS[name](), data_stages=[1])
    for a in order:
        for b in order:
            if a >= b:
                continue
            on_a = [s for s in order[a] if s.type.is_comm and _peer_rank(s, order) == b]
            on_b = [s for s in order[b] if s.type.is_comm and _peer_rank(s, order) == a]
            # The k-th transfer a posts towards b is the k-th one b posts towards a.
            as_seen_by_b = [MetaStep(s.micro_index, _MATCH[s.type], _peer(s), s.stage_index) for s in on_a]
            assert as_seen_by_b == on_b


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_any_costs_give_a_valid_order(name: str) -> None:
    order = BUILDS[name]()
    for costs in (
        StepCosts(forward=0, backward=0, backward_input=0, backward_weight=0),
        StepCosts(forward=5, backward=1, backward_input=1, backward_weight=3, comm=2),
    ):
        validate_order(insert_comms(order, costs=costs), require_comms=True)


def test_input_is_not_modified() -> None:
    order = build_1f1b_order(3, 4)
    before = copy.deepcopy(order)
    insert_comms(order, data_stages=[2])
    assert order == before


def test_one_rank_needs_no_comms() -> None:
    order = build_interleaved_1f1b_order(1, 3, 3)
    assert insert_comms(order) == order
    with_data = insert_comms(order, data_stages=[2])
    assert [s for s in with_data[0] if s.type is not T.DATA_LOAD] == order[0]


def test_fsdp_steps_are_kept_in_place() -> None:
    order = {
        r: [MetaStep(None, T.UNSHARD, r), *steps, MetaStep(None, T.REDUCE_GRAD, r)]
        for r, steps in build_1f1b_order(2, 3).items()
    }
    result = insert_comms(order)
    for rank in order:
        assert result[rank][0] == MetaStep(None, T.UNSHARD, rank)
        assert result[rank][-1].type in (T.REDUCE_GRAD, T.BWD_SEND)
        assert [s for s in result[rank] if not s.type.is_comm] == order[rank]


def test_v_turn_and_loss_stage_are_local() -> None:
    p = 3
    order = insert_comms(build_zbv_order(p, 4), data_stages=[2 * p - 1])
    comm_links = {
        (stage_to_rank(s.stage_index, p, style="v"), stage_to_rank(_peer(s), p, style="v"))
        for steps in order.values()
        for s in steps
        if s.type.is_comm
    }
    assert all(a != b for a, b in comm_links)
    assert not any(s.type in (T.DATA_SEND, T.DATA_RECV) for steps in order.values() for s in steps)


def test_refuses_orders_that_already_have_comms() -> None:
    order = insert_comms(build_1f1b_order(2, 2))
    with pytest.raises(ValueError, match=r"already has \['BWD_RECV', 'BWD_SEND', 'FWD_RECV', 'FWD_SEND'\]"):
        insert_comms(order)


@pytest.mark.parametrize("bad", [[2], [-1], ["1"], [True]])
def test_refuses_unknown_data_stages(bad: list[object]) -> None:
    with pytest.raises(ValueError, match=r"data_stages must be stage indices in 0 \.\. 1"):
        insert_comms(build_1f1b_order(2, 2), data_stages=bad)  # type: ignore[arg-type]


def test_refuses_invalid_orders_with_the_grid() -> None:
    order = build_1f1b_order(2, 2)
    order[1].reverse()
    with pytest.raises(ValueError, match=r"runs before(.|\n)*rank 1 \|"):
        insert_comms(order)

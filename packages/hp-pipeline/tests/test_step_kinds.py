"""The step-kind registry: a kind registered here goes through every pass like a built-in one.

The test kinds are registered at import (registering the same declaration
twice is a no-op, so re-imports are harmless); their codes are unlikely to
clash with a real plug-in's.
"""

from __future__ import annotations

import io
import pickle
from fractions import Fraction

import pytest
from hp_pipeline import (
    Edge,
    MetaStep,
    MetaStepType,
    ScheduleError,
    StepCosts,
    StepKind,
    build_1f1b_order,
    insert_comms,
    read_order_csv,
    register_step_handler,
    register_step_kind,
    render_order,
    simulate,
    step_kinds,
    validate_order,
    write_order_csv,
)
from hp_pipeline._deps import OrderView

T = MetaStepType


def _after_forward(view: OrderView, step: MetaStep) -> list[MetaStep]:
    return [MetaStep(step.micro_index, T.FWD, step.stage_index)]


def _one_per_forward(view: OrderView, expected: set[int]) -> list[tuple[str, list[tuple[int, int]]]]:
    forwards = {(s.stage_index, s.micro_index) for s in view.of_type.get(T.FWD, [])}
    ticks = {(s.stage_index, s.micro_index) for s in view.of_type.get(T.TEST_TICK, [])}
    missing = sorted(forwards - ticks)
    return [(f"TICK missing after the forwards {missing}", [])] if missing else []


def _tick_feeds_next_forward(view: OrderView, step: MetaStep) -> list[Edge]:
    """A tick of stage ``s`` is an input of the forward of stage ``s + 1`` (over TSEND/TRECV)."""
    i, s = step.micro_index, step.stage_index
    if s + 1 >= view.num_stages:
        return []
    send, recv = MetaStep(i, T.TEST_SEND, s, s + 1), MetaStep(i, T.TEST_RECV, s + 1, s)
    return [Edge(step, MetaStep(i, T.FWD, s + 1), send, recv)]


TICK = register_step_kind(
    StepKind(
        "TEST_TICK",
        "TK",
        "a test kind: local work after each forward",
        group="test",
        busy=True,
        needs=_after_forward,
        check=_one_per_forward,
        cost=3,
        colour="#123456",
    )
)
# A transfer pair with a required peer, fed by nothing (only its text form is tested).
register_step_kind(StepKind("TEST_SEND", "TSEND", group="test", transfer="send", matching="TRECV"))
register_step_kind(StepKind("TEST_RECV", "TRECV", group="test", transfer="recv", matching="TSEND"))


def _with_ticks(order: dict[int, list[MetaStep]]) -> dict[int, list[MetaStep]]:
    out = {}
    for rank, steps in order.items():
        row: list[MetaStep] = []
        for step in steps:
            row.append(step)
            if step.type is T.FWD:
                row.append(MetaStep(step.micro_index, TICK, step.stage_index))
        out[rank] = row
    return out


def test_a_registered_kind_is_a_member_and_round_trips_as_text() -> None:
    assert T.TEST_TICK is TICK and T("TK") is TICK and T["TEST_TICK"] is TICK
    assert TICK in list(T) and TICK in step_kinds("test") and TICK.name == "TEST_TICK" == TICK.spec.name
    step = MetaStep(2, TICK, 1)
    assert str(step) == "1TK2" and MetaStep.parse("1TK2") == step
    assert eval(repr(step), {"MetaStep": MetaStep, "MetaStepType": MetaStepType}) == step
    send = MetaStep(3, T.TEST_SEND, 0, 5)
    assert str(send) == "0TSEND3->5" and MetaStep.parse("5TRECV3<-0") == MetaStep(3, T.TEST_RECV, 5, 0)
    with pytest.raises(ValueError, match="must name its peer_stage"):
        MetaStep(3, T.TEST_SEND, 0)
    # By code across processes: the unpickled kind is this process's member, and hashes agree.
    again = pickle.loads(pickle.dumps(step))
    assert again == step and again.type is TICK and hash(again) == hash(step)


def test_registration_is_checked_and_idempotent() -> None:
    assert register_step_kind(TICK.spec) is TICK
    with pytest.raises(ValueError, match="code is taken by FWD"):
        register_step_kind(StepKind("TEST_OTHER", "F"))
    with pytest.raises(ValueError, match="name is taken by TEST_TICK"):
        register_step_kind(StepKind("TEST_TICK", "TKX"))
    with pytest.raises(ValueError, match="no digits"):
        StepKind("TEST_BAD", "T2")
    with pytest.raises(ValueError, match="names its matching code"):
        StepKind("TEST_BAD", "TBAD", transfer="send")
    with pytest.raises(ValueError, match="not a registered step code"):
        MetaStepType("NOPE")
    with pytest.raises(AttributeError, match="has no kind 'NOPE'"):
        _ = MetaStepType.NOPE
    with pytest.raises(TypeError, match="its handler is a Transfer with payload="):
        register_step_handler(T.TEST_SEND, lambda runner, step: None)


def test_csv_round_trip_with_a_plugin_kind() -> None:
    order = _with_ticks(build_1f1b_order(2, 3))
    buffer = io.StringIO()
    write_order_csv(order, buffer)
    assert "0TK0" in buffer.getvalue()
    buffer.seek(0)
    assert read_order_csv(buffer) == order


def test_validator_follows_the_declared_rules() -> None:
    order = _with_ticks(build_1f1b_order(2, 3))
    validate_order(order)
    validate_order(insert_comms(order), require_comms=True)
    early = {rank: list(steps) for rank, steps in order.items()}
    tick = early[0].pop(1)  # 0TK0, after 0F0
    early[0].insert(0, tick)
    with pytest.raises(ScheduleError, match=r"0TK0 \(rank 0, position 0\) runs before 0F0"):
        validate_order(early)
    missing = {rank: [s for s in steps if s != MetaStep(1, TICK, 1)] for rank, steps in order.items()}
    with pytest.raises(ScheduleError, match=r"TICK missing after the forwards \[\(1, 1\)\]"):
        validate_order(missing)


def test_feeds_rule_adds_an_input_to_a_builtin_step() -> None:
    """A plug-in makes stage 1's F wait for stage 0's tick, and insert_comms carries it."""
    kind = TICK.spec
    register_step_handler(TICK, None)  # the handler slot does not change the declaration's identity
    from dataclasses import replace

    fed = replace(kind, name="TEST_FED", code="TFED", feeds=_tick_feeds_next_forward, check=None)
    FED = register_step_kind(fed)
    order = {
        r: [MetaStep(s.micro_index, FED, s.stage_index) if s.type is TICK else s for s in row]
        for r, row in _with_ticks(build_1f1b_order(2, 2)).items()
    }
    with_comms = insert_comms(order)
    assert MetaStep(0, T.TEST_SEND, 0, 1) in with_comms[0] and MetaStep(0, T.TEST_RECV, 1, 0) in with_comms[1]
    row1 = with_comms[1]
    assert row1.index(MetaStep(0, T.TEST_RECV, 1, 0)) < row1.index(MetaStep(0, T.FWD, 1))
    # Without the transfer, stage 1's F has an input that never arrives.
    broken = {
        r: [s for s in row if s.type is not T.TEST_SEND and s.type is not T.TEST_RECV]
        for r, row in with_comms.items()
    }
    with pytest.raises(ScheduleError, match=r"TSEND0->1 is missing|needs 0TFED0"):
        validate_order(broken)


def test_simulator_uses_the_declared_cost_and_busy_flag() -> None:
    order = _with_ticks(build_1f1b_order(2, 2))
    result = simulate(order)  # F=1, B=2, TK=3
    plain = simulate(build_1f1b_order(2, 2))
    assert result.compute_time[0] == plain.compute_time[0] + 2 * 3
    timed = {t.step: t for t in result.timeline[0]}
    assert timed[MetaStep(0, TICK, 0)].end - timed[MetaStep(0, TICK, 0)].start == 3
    cheaper = simulate(order, StepCosts(by_code={"TK": Fraction(1, 2)}))
    assert {t.end - t.start for t in cheaper.timeline[1] if t.step.type is TICK} == {Fraction(1, 2)}
    with pytest.raises(ValueError, match=r"by_code\['TK'\] must be >= 0"):
        StepCosts(by_code={"TK": -1})


def test_render_draws_the_declared_colour(tmp_path) -> None:
    order = _with_ticks(build_1f1b_order(2, 2))
    text = render_order(order, tmp_path / "ticks.svg")
    assert "0TK0" in text
    svg = (tmp_path / "ticks.svg").read_text()
    assert 'fill="#123456"' in svg and "TK TEST_TICK" in svg

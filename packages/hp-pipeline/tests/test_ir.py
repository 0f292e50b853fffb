"""The IR: MetaStep's invariants and text form, the grid, and CSV round-trips."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    build_dualpipev_order,
    build_interleaved_1f1b_order,
    build_zbv_order,
    format_order,
    insert_comms,
    read_order_csv,
    write_order_csv,
)

T = MetaStepType

EXAMPLES = [
    (MetaStep(0, T.FWD, 2), "2F0"),
    (MetaStep(13, T.BWD, 0), "0B13"),
    (MetaStep(3, T.BWD_INPUT, 1), "1I3"),
    (MetaStep(3, T.BWD_WEIGHT, 1), "1W3"),
    (MetaStep(1, T.FWD_SEND, 0), "0SEND_F1"),
    (MetaStep(1, T.FWD_RECV, 1), "1RECV_F1"),
    (MetaStep(4, T.BWD_SEND, 3), "3SEND_B4"),
    (MetaStep(4, T.BWD_RECV, 2), "2RECV_B4"),
    (MetaStep(5, T.DATA_LOAD, 0), "0LOAD5"),
    (MetaStep(3, T.DATA_SEND, 0, 5), "0SEND_D3->5"),
    (MetaStep(3, T.DATA_RECV, 5, 0), "5RECV_D3<-0"),
    (MetaStep(None, T.UNSHARD, 1), "1UNSHARD"),
    (MetaStep(None, T.RESHARD, 1), "1RESHARD"),
    (MetaStep(None, T.REDUCE_GRAD, 12), "12REDUCE_GRAD"),
    (MetaStep(2, T.UNSHARD, 1), "1UNSHARD2"),
    (MetaStep(7, T.FWD_SEND, 0, 3), "0SEND_F7->3"),
    (MetaStep(7, T.BWD_RECV, 2, 0), "2RECV_B7<-0"),
    (MetaStep.overlap(MetaStep(3, T.FWD, 0), MetaStep(1, T.BWD, 7)), "(0F3;7B1)OVERLAP_F_B"),
    (MetaStep.overlap(MetaStep(12, T.FWD, 5), MetaStep(0, T.BWD_INPUT, 2)), "(5F12;2I0)OVERLAP_F_B"),
]


@pytest.mark.parametrize(("step", "text"), EXAMPLES, ids=[t for _, t in EXAMPLES])
def test_text_form_round_trips(step: MetaStep, text: str) -> None:
    assert str(step) == text
    assert MetaStep.parse(text) == step
    assert MetaStep.parse(str(step)) == step
    assert eval(repr(step), {"MetaStep": MetaStep, "MetaStepType": MetaStepType}) == step


def test_every_type_has_a_distinct_code() -> None:
    codes = [t.code for t in MetaStepType]
    assert len(set(codes)) == len(codes)
    # 14 base types + OVERLAP_F_B + 7 MPipe types; plug-ins registered by other tests come on top.
    ours = [t for t in MetaStepType if t.group in ("pipeline", "data", "fsdp", "mpipe")]
    assert len(ours) == 22
    assert all(MetaStepType(t.code) is t for t in MetaStepType)


def test_overlap_step_mirrors_its_forward_and_lists_its_halves() -> None:
    forward, backward = MetaStep(3, T.FWD, 0), MetaStep(1, T.BWD, 7)
    pair = MetaStep.overlap(forward, backward)
    assert pair.type is T.OVERLAP_F_B and pair.type.is_overlap and pair.type.is_compute
    assert (pair.micro_index, pair.stage_index, pair.peer_stage) == (3, 0, None)
    assert pair.sub_steps == pair.parts == (forward, backward)
    assert forward.parts == (forward,) and forward.sub_steps is None
    # Equal pairs hash equally (the hash is built from ints only, so it is the same on every rank).
    assert {pair, MetaStep.overlap(MetaStep(3, T.FWD, 0), MetaStep(1, T.BWD, 7))} == {pair}
    assert pair != MetaStep.overlap(forward, MetaStep(1, T.BWD_INPUT, 7))
    assert pair != forward


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MetaStep(3, T.OVERLAP_F_B, 0), r"pairs a forward \(F\) with a backward \(B or I\)"),
        (
            lambda: MetaStep.overlap(MetaStep(1, T.BWD, 7), MetaStep(3, T.FWD, 0)),
            r"in that order; got sub_steps=",
        ),
        (
            lambda: MetaStep.overlap(MetaStep(3, T.FWD, 0), MetaStep(1, T.BWD_WEIGHT, 7)),
            r"a backward \(B or I\)",
        ),
        (lambda: MetaStep.overlap(MetaStep(3, T.FWD, 0), MetaStep(3, T.BWD, 0)), "0B3 needs 0F3"),
        (
            lambda: MetaStep(2, T.OVERLAP_F_B, 0, None, (MetaStep(3, T.FWD, 0), MetaStep(1, T.BWD, 7))),
            r"carries its forward's micro-batch and stage \(3, 0\), got \(2, 0\)",
        ),
        (
            lambda: MetaStep(3, T.FWD, 0, None, (MetaStep(3, T.FWD, 0), MetaStep(1, T.BWD, 7))),
            "FWD has no sub_steps",
        ),
        (lambda: MetaStep.overlap("0F3", MetaStep(1, T.BWD, 7)), "takes two MetaSteps, got str"),  # type: ignore[arg-type]
    ],
)
def test_invalid_overlap_steps_are_rejected(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_steps_are_immutable_and_hashable() -> None:
    step = MetaStep(0, T.FWD, 2)
    with pytest.raises(AttributeError):
        step.stage_index = 3  # type: ignore[misc]
    assert {step, MetaStep(0, T.FWD, 2)} == {step}
    assert MetaStep(0, T.FWD, 2) != MetaStep(0, T.BWD, 2)


def test_positional_constructor_order() -> None:
    step = MetaStep(4, T.BWD, 1)
    assert (step.micro_index, step.type, step.stage_index) == (4, T.BWD, 1)


def test_adjacent_peer_is_implicit() -> None:
    assert MetaStep(1, T.FWD_SEND, 0) == MetaStep(1, T.FWD_SEND, 0, 1)
    assert MetaStep(1, T.FWD_SEND, 0).peer_stage == 1
    assert MetaStep(1, T.BWD_SEND, 3).peer_stage == 2
    assert str(MetaStep(1, T.BWD_SEND, 3, 2)) == "3SEND_B1"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, "F", 1), "must be a MetaStepType"),
        ((0, T.FWD, -1), "stage_index must be an int >= 0"),
        ((-1, T.FWD, 0), "micro_index must be an int >= 0"),
        ((None, T.FWD, 0), "needs a micro_index"),
        ((0, T.FWD, 0, 1), "has no peer"),
        ((0, T.DATA_SEND, 0), "must name its peer_stage"),
        ((0, T.FWD_RECV, 0), "peer must be a stage index >= 0"),
        ((0, T.DATA_SEND, 2, 2), "names itself"),
        ((True, T.FWD, 0), "micro_index must be an int"),
    ],
)
def test_invalid_steps_are_rejected(args: tuple, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        MetaStep(*args)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("F0", "cannot parse"),
        ("2X0", "unknown step code 'X'"),
        ("2F", "needs a micro_index"),
        ("0F1->2", "'->peer' belongs to SEND"),
        ("0SEND_F1<-2", "'->peer' belongs to SEND"),
        ("0SEND_D1", "must name its peer_stage"),
        ("0OVERLAP_F_B3", r"written with its two halves, e.g. '\(0F3;7B1\)OVERLAP_F_B'"),
        ("(0F3)OVERLAP_F_B", r"written '\(forward;backward\)OVERLAP_F_B'"),
        ("(0F3;7B1;1F0)OVERLAP_F_B", r"written '\(forward;backward\)OVERLAP_F_B'"),
        ("(0F3;7B1)OVERLAP", r"written '\(forward;backward\)OVERLAP_F_B'"),
        ("(0F3;7X1)OVERLAP_F_B", "unknown step code 'X'"),
        ("(7B1;0F3)OVERLAP_F_B", "in that order"),
    ],
)
def test_parse_errors_say_what_is_expected(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MetaStep.parse(text)


def test_format_order_marks_and_windows() -> None:
    order = build_interleaved_1f1b_order(2, 8, 2)
    grid = format_order(order, [(1, 20)])
    assert ">" + str(order[1][20]) + "<" in grid
    assert grid.count("\n") == 2  # header + one row per rank
    assert "... " in grid  # columns before the window are elided
    full = format_order(order)
    assert all(str(step) in full for step in order[0])
    assert format_order({}) == "(empty order)"


@pytest.mark.parametrize("with_data", [False, True])
def test_csv_round_trip_through_a_file(tmp_path: Path, with_data: bool) -> None:
    order = insert_comms(build_zbv_order(3, 5), data_stages=[1, 5] if with_data else None)
    path = tmp_path / "zbv.csv"
    write_order_csv(order, path)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("0,")
    assert read_order_csv(path) == order


@pytest.mark.parametrize("p", [2, 3])
def test_csv_round_trip_of_overlapped_steps(tmp_path: Path, p: int) -> None:
    order = insert_comms(build_dualpipev_order(p, 2 * p + 1), data_stages=[2 * p - 1])
    assert any(step.type is T.OVERLAP_F_B for steps in order.values() for step in steps)
    path = tmp_path / "dualpipev.csv"
    write_order_csv(order, path)
    assert "(0F" in path.read_text() and ")OVERLAP_F_B" in path.read_text()  # one cell per pair
    assert read_order_csv(path) == order
    grid = format_order(order)
    assert all(str(step) in grid for step in order[0])


def test_csv_round_trip_through_a_stream_keeps_empty_ranks() -> None:
    order = {0: [MetaStep(0, T.FWD, 0), MetaStep(None, T.UNSHARD, 0)], 2: []}
    buffer = io.StringIO()
    write_order_csv(order, buffer)
    assert buffer.getvalue() == "0,0F0,0UNSHARD\n2\n"
    assert read_order_csv(io.StringIO(buffer.getvalue())) == order


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x,0F0\n", "line 1: the first cell must be the rank"),
        ("0,0F0\n0,0B0\n", "rank 0 is negative or appears twice"),
        ("0,0F0,0Q1\n", "line 1, column 3: unknown step code 'Q'"),
    ],
)
def test_csv_errors_name_the_cell(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_order_csv(io.StringIO(text))

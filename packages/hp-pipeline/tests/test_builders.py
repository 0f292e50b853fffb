"""Every builder over the p x m (x v) grid: valid after insert_comms, or a clear error."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    Order,
    build_1f1b_order,
    build_dualpipev_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_interleaved_zero_bubble_order,
    build_looped_bfs_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    insert_comms,
    interleaved_round_size,
    stage_to_rank,
    stages_on_rank,
    validate_order,
)

T = MetaStepType
RANKS = [1, 2, 3, 4, 8]
MICROS = list(range(1, 17))

SINGLE_STAGE = {
    "gpipe": build_gpipe_order,
    "1f1b": build_1f1b_order,
    "zb-h1": build_zero_bubble_h1_order,
}


def _interleaved_is_valid(p: int, m: int) -> bool:
    rounds = max(1, m // p)
    return m % rounds == 0


def _check(order: dict[int, list[MetaStep]], p: int, m: int, num_stages: int) -> dict[int, list[MetaStep]]:
    """insert_comms (which validates its input) then validate, plus a few more facts."""
    with_comms = insert_comms(order)
    validate_order(with_comms, n_microbatches=m, num_stages=num_stages, require_comms=True)
    assert sorted(order) == list(range(p))
    compute = [[s for s in with_comms[r] if s.type.is_compute] for r in range(p)]
    assert compute == [order[r] for r in range(p)], "insert_comms must keep the compute order"
    kinds = Counter(s.type for steps in with_comms.values() for s in steps)
    assert kinds[T.FWD_SEND] == kinds[T.FWD_RECV]
    assert kinds[T.BWD_SEND] == kinds[T.BWD_RECV]
    return with_comms


@pytest.mark.parametrize("m", MICROS)
@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("name", sorted(SINGLE_STAGE))
def test_single_stage_builders_over_the_grid(name: str, p: int, m: int) -> None:
    order = SINGLE_STAGE[name](p, m)
    _check(order, p, m, num_stages=p)
    kinds = Counter(s.type for steps in order.values() for s in steps)
    if name == "zb-h1":
        assert kinds == {T.FWD: p * m, T.BWD_INPUT: p * m, T.BWD_WEIGHT: p * m}
    else:
        assert kinds == {T.FWD: p * m, T.BWD: p * m}
    assert all({s.stage_index for s in order[r]} == {r} for r in range(p))


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", MICROS)
@pytest.mark.parametrize("p", RANKS)
def test_interleaved_over_the_grid(p: int, m: int, v: int) -> None:
    if not _interleaved_is_valid(p, m):
        with pytest.raises(ValueError, match=f"n_microbatches={m} cannot be split"):
            build_interleaved_1f1b_order(p, m, v)
        return
    order = build_interleaved_1f1b_order(p, m, v)
    _check(order, p, m, num_stages=v * p)
    for rank in range(p):
        assert {s.stage_index for s in order[rank]} == set(stages_on_rank(rank, p, v))
        assert all(stage_to_rank(s.stage_index, p) == rank for s in order[rank])


@pytest.mark.parametrize("m", MICROS)
@pytest.mark.parametrize("p", RANKS)
def test_zbv_over_the_grid(p: int, m: int) -> None:
    order = build_zbv_order(p, m)
    with_comms = _check(order, p, m, num_stages=2 * p)
    for rank in range(p):
        assert {s.stage_index for s in order[rank]} == {rank, 2 * p - 1 - rank}
        assert all(stage_to_rank(s.stage_index, p, style="v") == rank for s in order[rank])
    # The turn of the V (stages p-1 and p, both on rank p-1) is a local hand-off.
    turn = [s for s in with_comms[p - 1] if s.type.is_comm and {s.stage_index, s.peer_stage} == {p - 1, p}]
    assert turn == []


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", MICROS)
@pytest.mark.parametrize("p", RANKS)
def test_looped_bfs_over_the_grid(p: int, m: int, v: int) -> None:
    order = build_looped_bfs_order(p, m, v)
    _check(order, p, m, num_stages=v * p)
    for rank in range(p):
        local = stages_on_rank(rank, p, v)
        # breadth first: all of a chunk's forwards before the next chunk's
        assert [s.stage_index for s in order[rank][: v * m]] == [s for s in local for _ in range(m)]
        assert [s.stage_index for s in order[rank][v * m :]] == [s for s in reversed(local) for _ in range(m)]


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", MICROS)
@pytest.mark.parametrize("p", RANKS)
def test_interleaved_zero_bubble_over_the_grid(p: int, m: int, v: int) -> None:
    if not _interleaved_is_valid(p, m):
        with pytest.raises(
            ValueError, match=f"build_interleaved_zero_bubble_order: n_microbatches={m} cannot"
        ):
            build_interleaved_zero_bubble_order(p, m, v)
        return
    order = build_interleaved_zero_bubble_order(p, m, v)
    _check(order, p, m, num_stages=v * p)
    kinds = Counter(s.type for steps in order.values() for s in steps)
    assert kinds == {T.FWD: v * p * m, T.BWD_INPUT: v * p * m, T.BWD_WEIGHT: v * p * m}
    for rank in range(p):
        assert {s.stage_index for s in order[rank]} == set(stages_on_rank(rank, p, v))


@pytest.mark.parametrize("m", MICROS)
@pytest.mark.parametrize("p", RANKS)
def test_dualpipev_over_the_grid(p: int, m: int) -> None:
    if m < 2 * p:
        with pytest.raises(ValueError, match=rf"n_microbatches={m} is fewer than the {2 * p} stages"):
            build_dualpipev_order(p, m)
        return
    order = build_dualpipev_order(p, m)
    with_comms = insert_comms(order)
    validate_order(with_comms, n_microbatches=m, num_stages=2 * p, require_comms=True)
    assert [[s for s in with_comms[r] if s.type.is_compute] for r in range(p)] == [order[r] for r in range(p)]
    halves = [part for steps in order.values() for s in steps for part in s.parts]
    assert len(halves) == len(set(halves))
    forwards = Counter(s.stage_index for s in halves if s.type is T.FWD)
    assert forwards == {s: m for s in range(2 * p)}
    pairs = [s for steps in order.values() for s in steps if s.type is T.OVERLAP_F_B]
    if p > 1 or m > 2:
        assert pairs, "DualPipeV's steady phase runs overlapped pairs"
    for pair in pairs:
        forward, backward = pair.sub_steps or ()
        assert backward.type is T.BWD and backward.micro_index < forward.micro_index + (
            backward.stage_index < forward.stage_index
        ), pair
    for rank in range(p):
        hosted = {part.stage_index for s in order[rank] for part in s.parts}
        assert hosted == {rank, 2 * p - 1 - rank}


def _torch_order(name: str, p: int, m: int, v: int) -> dict[int, list[str]]:
    """torch.distributed.pipelining's per-rank compute order, without a process group.

    Its schedule classes compute every rank's actions in ``_calculate_single_rank_operations``
    from a handful of attributes; we set those on a bare instance (private API, pinned torch).
    """
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, name)
    obj = object.__new__(cls)
    rounds = max(1, m // p)
    attributes = {
        "pp_group_size": p,
        "_n_microbatches": m,
        "_stages": [None] * v,
        "n_local_stages": v,
        "_num_stages": v * p,
        "num_stages": v * p,
        "number_of_rounds": rounds,
        "microbatches_per_round": m // rounds,
    }
    for key, value in attributes.items():
        object.__setattr__(obj, key, value)
    try:
        actions = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
    except AttributeError as exc:  # pragma: no cover - torch's internals moved
        pytest.skip(f"torch's {name} internals changed: {exc}")
    return {r: [str(a) for a in row if a is not None] for r, row in actions.items()}


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8, 9, 12, 16])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_same_orders_as_torch(p: int, m: int) -> None:
    """The new builders give each rank exactly torch's compute order (text forms included)."""

    def ours(order: Order) -> dict[int, list[str]]:
        return {r: [str(s) for s in steps] for r, steps in order.items()}

    for v in (1, 2, 3):
        assert ours(build_looped_bfs_order(p, m, v)) == _torch_order("ScheduleLoopedBFS", p, m, v)
        if _interleaved_is_valid(p, m):
            got = ours(build_interleaved_zero_bubble_order(p, m, v))
            assert got == _torch_order("ScheduleInterleavedZeroBubble", p, m, v)
    if m >= 2 * p:
        assert ours(build_dualpipev_order(p, m)) == _torch_order("ScheduleDualPipeV", p, m, 2)
    assert ours(build_zbv_order(p, m)) == _torch_order("ScheduleZBVZeroBubble", p, m, 2)


@pytest.mark.parametrize(
    "build",
    [build_1f1b_order, build_zero_bubble_h1_order, build_zbv_order, build_dualpipev_order],
    ids=["1f1b", "zb-h1", "zbv", "dualpipev"],
)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_data_steps_reach_the_last_stage(build: Callable[[int, int], Order], p: int) -> None:
    m = 2 * p + 1
    order = build(p, m)
    last = max(part.stage_index for steps in order.values() for s in steps for part in s.parts)
    with_data = insert_comms(order, data_stages=[last])
    validate_order(with_data, require_comms=True)
    loads = [s for s in with_data[0] if s.type is T.DATA_LOAD]
    assert loads == [MetaStep(i, T.DATA_LOAD, 0) for i in range(m)]
    sends = [s for steps in with_data.values() for s in steps if s.type is T.DATA_SEND]
    if build in (build_zbv_order, build_dualpipev_order):
        assert sends == []  # the V puts the last stage on the loading rank
    else:
        assert sends == [MetaStep(i, T.DATA_SEND, 0, last) for i in range(m)]
        recvs = [s for s in with_data[p - 1] if s.type is T.DATA_RECV]
        assert recvs == [MetaStep(i, T.DATA_RECV, last, 0) for i in range(m)]


def test_golden_1f1b() -> None:
    order = build_1f1b_order(2, 3)
    assert [str(s) for s in order[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert [str(s) for s in order[1]] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]


def test_golden_gpipe() -> None:
    assert [str(s) for s in build_gpipe_order(2, 2)[1]] == ["1F0", "1F1", "1B0", "1B1"]


def test_golden_interleaved() -> None:
    order = build_interleaved_1f1b_order(2, 2, 2)
    assert " ".join(map(str, order[0])) == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"
    assert " ".join(map(str, order[1])) == "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"


def test_golden_zero_bubble_h1() -> None:
    order = build_zero_bubble_h1_order(2, 3)
    assert " ".join(map(str, order[0])) == "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2"
    assert " ".join(map(str, order[1])) == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"


def test_golden_looped_bfs() -> None:
    order = build_looped_bfs_order(2, 2, 2)
    assert " ".join(map(str, order[0])) == "0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0"
    assert " ".join(map(str, order[1])) == "1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0"


def test_golden_interleaved_zero_bubble() -> None:
    order = build_interleaved_zero_bubble_order(2, 2, 2)
    assert " ".join(map(str, order[0])) == "0F0 0F1 2F0 2F1 2I0 2W0 2I1 2W1 0I0 0W0 0I1 0W1"
    assert " ".join(map(str, order[1])) == "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1I0 3W1 1I1 1W0 1W1"


def test_golden_dualpipev() -> None:
    order = build_dualpipev_order(2, 4)
    assert " ".join(map(str, order[0])) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 "
        "(3F3;0B1)OVERLAP_F_B 3B3 0I2 0W2 0I3 0W3"
    )
    assert " ".join(map(str, order[1])) == (
        "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B (2F3;1B1)OVERLAP_F_B "
        "2B2 1B2 2I3 1I3 2W3 1W3"
    )


def test_golden_insert_comms_1f1b() -> None:
    order = insert_comms(build_1f1b_order(2, 2))
    assert " ".join(map(str, order[0])) == ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1")
    assert " ".join(map(str, order[1])) == ("1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1")


@pytest.mark.parametrize(
    ("p", "m", "expected"),
    [(4, 1, 1), (4, 3, 3), (4, 4, 4), (4, 6, 6), (4, 8, 4), (4, 10, 5), (3, 16, None)],
)
def test_interleaved_round_size(p: int, m: int, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(ValueError):
            interleaved_round_size(p, m)
    else:
        assert interleaved_round_size(p, m) == expected


@pytest.mark.parametrize(
    "build", [build_interleaved_1f1b_order, build_interleaved_zero_bubble_order], ids=["1f1b", "zero-bubble"]
)
def test_interleaved_error_names_values_that_work(build: Callable[[int, int, int], Order]) -> None:
    with pytest.raises(ValueError) as info:
        build(4, 9, 2)
    message = str(info.value)
    assert message.startswith(build.__name__)
    assert "n_microbatches=9" in message and "num_ranks=4" in message
    assert "e.g. 8 or 10" in message
    for suggestion in (8, 10):
        build(4, suggestion, 2)


def test_dualpipev_error_names_the_fewest_micro_batches() -> None:
    with pytest.raises(ValueError) as info:
        build_dualpipev_order(4, 7)
    message = str(info.value)
    assert "n_microbatches=7 is fewer than the 8 stages" in message and "num_ranks=4" in message
    assert message.endswith("use n_microbatches >= 8")
    build_dualpipev_order(4, 8)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: build_gpipe_order(0, 4), r"build_gpipe_order: num_ranks must be an int >= 1, got 0"),
        (lambda: build_1f1b_order(2, 0), r"build_1f1b_order: n_microbatches must be an int >= 1"),
        (
            lambda: build_zbv_order(2.0, 4),  # type: ignore[arg-type]
            r"build_zbv_order: num_ranks must be an int >= 1, got 2.0",
        ),
        (lambda: build_zero_bubble_h1_order(True, 4), r"num_ranks must be an int >= 1, got True"),
        (lambda: build_interleaved_1f1b_order(2, 4, 0), r"stages_per_rank must be an int >= 1, got 0"),
        (lambda: build_looped_bfs_order(2, 4, 0), r"build_looped_bfs_order: stages_per_rank must be an int"),
        (
            lambda: build_interleaved_zero_bubble_order(2, 0, 2),
            r"build_interleaved_zero_bubble_order: n_microbatches must be an int >= 1, got 0",
        ),
        (lambda: build_dualpipev_order(0, 4), r"build_dualpipev_order: num_ranks must be an int >= 1, got 0"),
        (lambda: stages_on_rank(0, 2, 3, style="v"), r"exactly 2 stages on each rank"),
        (lambda: stages_on_rank(2, 2), r"rank must be in 0 .. 1, got 2"),
        (lambda: stage_to_rank(4, 2, style="v"), r"stages 0 .. 3, got stage 4"),
        (
            lambda: stage_to_rank(1, 2, style="x"),  # type: ignore[arg-type]
            r"style must be 'loop' or 'v'",
        ),
    ],
)
def test_bad_arguments_are_named(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_placements() -> None:
    assert stages_on_rank(1, 4, 3) == [1, 5, 9]
    assert stages_on_rank(1, 4, 2, style="v") == [1, 6]
    assert [stage_to_rank(s, 4, style="v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_to_rank(s, 3) for s in range(6)] == [0, 1, 2, 0, 1, 2]

"""validate_order catches planted bugs and prints the grid with the culprit marked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    Order,
    ScheduleError,
    add_fsdp_steps,
    build_1f1b_order,
    build_dualpipev_order,
    build_interleaved_1f1b_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    insert_comms,
    stages_on_rank,
    validate_order,
)
from hp_pipeline.overlap import add_fsdp_steps_with_overlaps

T = MetaStepType
P = MetaStep.parse


def _order(rows: dict[int, str]) -> dict[int, list[MetaStep]]:
    return {rank: [P(text) for text in row.split()] for rank, row in rows.items()}


def _fails(order: Order, match: str, marked: Sequence[str] = (), **kwargs: Any) -> ScheduleError:
    with pytest.raises(ScheduleError, match=match) as info:
        validate_order(order, **kwargs)
    message = str(info.value)
    assert "rank 0 |" in message, "the message must carry the rank x step grid"
    for text in marked:
        assert f">{text}<" in message, f"{text} should be marked in\n{message}"
    assert isinstance(info.value, ValueError)
    return info.value


def test_a_correct_crossing_free_order_passes() -> None:
    validate_order(
        _order(
            {
                0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                1: "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
            }
        ),
        require_comms=True,
    )


def test_crossing_sends_deadlock() -> None:
    # Rank 1 sends the gradient of micro-batch 0 before taking micro-batch 1's
    # activation, while rank 0 sends that activation before taking the gradient:
    # with blocking sends both wait forever.
    error = _fails(
        _order(
            {
                0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
            }
        ),
        "deadlocks",
        marked=["0SEND_F1", "1SEND_B0"],
    )
    assert "rank 0 waits in 0SEND_F1 for rank 1 to reach 1RECV_F1" in str(error)


def test_compute_only_cycle_deadlocks() -> None:
    # Rank 1 wants the backward of micro-batch 1 first, but rank 0 only sends
    # micro-batch 1's forward after its own backward of micro-batch 0... which
    # needs rank 1's backward of micro-batch 0, queued behind.
    _fails(_order({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B1 1B0"}), "deadlocks", marked=["0B0", "1F1"])


def test_backward_before_its_forward() -> None:
    order = build_1f1b_order(3, 4)
    steps = order[1]
    f0 = steps.index(P("1F0"))
    steps.insert(0, steps.pop(steps.index(P("1B0"))))
    assert steps[f0 + 1] == P("1F0")
    _fails(order, "runs before a step it depends on", marked=["1B0", "1F0"])


def test_weight_gradient_before_input_gradient() -> None:
    order = build_zero_bubble_h1_order(2, 3)
    i0, w0 = order[0].index(P("0I0")), order[0].index(P("0W0"))
    order[0][i0], order[0][w0] = order[0][w0], order[0][i0]
    _fails(order, "runs before", marked=["0W0", "0I0"])


def test_downstream_forward_before_upstream_on_one_rank() -> None:
    # One rank running the whole (2-stage) model must run stage 0 first.
    _fails(_order({0: "1F0 0F0 1B0 0B0"}), "runs before", marked=["1F0", "0F0"])


def test_missing_recv() -> None:
    order = insert_comms(build_1f1b_order(3, 4))
    order[2].remove(P("2RECV_F2"))
    error = _fails(order, "do not pair up", marked=["1SEND_F2", "2F2"])
    assert "1SEND_F2 on rank 1 has no matching 2RECV_F2 on rank 2" in str(error)


def test_missing_send_and_recv() -> None:
    order = insert_comms(build_1f1b_order(2, 2))
    order[1].remove(P("1SEND_B1"))
    order[0].remove(P("0RECV_B1"))
    _fails(order, "do not pair up", marked=["0B1"])


def test_compute_only_order_is_rejected_when_comms_are_required() -> None:
    order = build_1f1b_order(2, 2)
    validate_order(order)
    _fails(order, "do not pair up", marked=["1F0"], require_comms=True)


def test_comm_between_stages_on_the_same_rank() -> None:
    order = insert_comms(build_zbv_order(2, 2))
    # Stages 1 and 2 share rank 1 (the turn of the V): a SEND between them is wrong.
    order[1][4:4] = [P("1SEND_F0")]
    order[1][6:6] = [P("2RECV_F0")]
    _fails(order, "inconsistent", marked=["1SEND_F0", "2RECV_F0"])


def test_wrong_counts() -> None:
    order = build_1f1b_order(2, 4)
    order[1].remove(P("1F3"))
    order[1].remove(P("1B3"))
    error = _fails(order, r"once per micro-batch \(m=4\)")
    assert "stage 1 runs F for [0-2], expected every micro-batch 0 .. 3; missing [3]" in str(error)


def test_counts_against_the_expected_m() -> None:
    order = build_1f1b_order(2, 4)
    validate_order(order, n_microbatches=4, num_stages=2)
    _fails(order, r"m=5", n_microbatches=5)
    _fails(order, r"m=3", marked=["0F3", "1B3"], n_microbatches=3)
    _fails(order, "num_stages=3", num_stages=3)


def test_mixed_and_partial_split_backward() -> None:
    order = build_zero_bubble_h1_order(2, 2)
    order[1].remove(P("1W1"))
    _fails(order, "per micro-batch", marked=[])
    order = build_1f1b_order(1, 2)
    order[0].append(P("0I0"))
    _fails(order, "both B and I/W")


def test_duplicate_step() -> None:
    order = build_1f1b_order(2, 2)
    order[0].append(P("0B1"))
    _fails(order, "more than once", marked=["0B1"])


def test_stage_on_two_ranks() -> None:
    order = build_1f1b_order(2, 2)
    order[1].append(order[0].pop())
    _fails(order, "more than one rank", marked=["0B1"])


def test_missing_stage_and_unknown_peer() -> None:
    _fails(_order({0: "0F0 0B0", 1: "2F0 2B0"}), "inconsistent")
    _fails(_order({0: "0F0 0SEND_F0 0B0"}), "names stage 1, which has no steps")


def test_non_adjacent_activation_peer() -> None:
    order = insert_comms(build_1f1b_order(3, 1))
    index = order[0].index(P("0SEND_F0"))
    order[0][index] = MetaStep(0, T.FWD_SEND, 0, 2)
    _fails(order, "inconsistent", marked=["0SEND_F0->2"])


def test_fsdp_steps() -> None:
    good = _order({0: "0UNSHARD 0F0 0F1 0B0 0B1 0REDUCE_GRAD 0RESHARD"})
    validate_order(good)
    _fails(_order({0: "0UNSHARD 0F0 0RESHARD 0F1 0B0 0B1"}), "FSDP", marked=["0F1"])
    _fails(_order({0: "0UNSHARD 0F0 0F1 0B0 0REDUCE_GRAD 0B1"}), "FSDP", marked=["0REDUCE_GRAD", "0B1"])


def test_data_steps() -> None:
    order = insert_comms(build_1f1b_order(2, 2), data_stages=[1])
    validate_order(order)
    recv = P("1RECV_D1<-0")
    assert recv in order[1]
    broken = {0: order[0], 1: [s for s in order[1] if s != recv] + [recv]}  # after its consumer
    _fails(broken, "arrives after", marked=["1RECV_D1<-0", "1F1"])
    no_load = {0: [s for s in order[0] if s != P("0LOAD1")], 1: order[1]}
    _fails(no_load, "per micro-batch|needs 0LOAD1")


def test_error_grid_windows_long_rows() -> None:
    order = insert_comms(build_interleaved_1f1b_order(4, 16, 3))
    row = order[3]
    index = next(k for k, s in enumerate(row) if s.type is T.BWD and k > 60)
    bad = row.pop(index)
    row.insert(index + 40, bad)
    error = _fails(order, "deadlocks|runs before|pair")
    assert "... " in str(error)  # only a window of the long rows is printed
    assert str(error).count("\n") < 40


def test_errors_list_several_problems() -> None:
    order = build_1f1b_order(2, 3)
    for rank in (0, 1):
        steps = order[rank]
        steps.insert(0, steps.pop(steps.index(P(f"{rank}B2"))))
    error = _fails(order, "runs before")
    assert len(error.problems) >= 2
    assert {r for r, _ in error.marks} == {0, 1}


# -- OVERLAP_F_B pairs -----------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_dualpipev_orders_with_pairs_pass(p: int) -> None:
    order = build_dualpipev_order(p, 2 * p + 1)
    assert any(s.type is T.OVERLAP_F_B for steps in order.values() for s in steps)
    validate_order(order, n_microbatches=2 * p + 1, num_stages=2 * p)
    validate_order(insert_comms(order), n_microbatches=2 * p + 1, require_comms=True)


def test_pair_of_one_micro_batch_deadlocks() -> None:
    # 0B0 needs the gradient from stage 1, which needs 3B0 (rank 0, after the pair), which needs
    # 3F0: the pair's own forward. A runtime that starts both halves at once waits forever.
    error = _fails(
        _order({0: "0F0 (3F0;0B0)OVERLAP_F_B 3B0", 1: "1F0 2F0 2B0 1B0"}),
        "deadlocks",
        marked=["(3F0;0B0)OVERLAP_F_B", "2B0"],
    )
    assert "rank 0 waits in (3F0;0B0)OVERLAP_F_B for 1B0 from another rank" in str(error)


def test_pair_before_what_its_backward_needs_on_the_rank() -> None:
    # 3B0 needs 3F0, which comes after the pair on the same rank.
    _fails(
        _order({0: "0F0 (0F1;3B0)OVERLAP_F_B 3F0 3F1 3B1 0B0 0B1", 1: "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"}),
        "runs before",
        marked=["(0F1;3B0)OVERLAP_F_B", "3F0"],
    )


def test_receive_for_a_pair_after_the_pair() -> None:
    order = insert_comms(build_dualpipev_order(2, 4))
    row = order[0]
    pair_at = next(
        k for k, s in enumerate(row) if s.sub_steps is not None and s.sub_steps[1].stage_index == 0
    )
    backward = row[pair_at].parts[1]
    recv = MetaStep(backward.micro_index, T.BWD_RECV, 0)
    row.remove(recv)
    row.insert(pair_at, recv)  # the pair moved one left: the receive now follows it
    error = _fails(order, "runs before|arrives after", marked=[str(recv)])
    assert f"{recv} (rank 0, position {pair_at}) arrives after {backward}" in str(error)


def test_pair_halves_on_two_ranks() -> None:
    _fails(
        _order({0: "0F0 (0F1;1B0)OVERLAP_F_B 0B0 0B1", 1: "1F0 1F1 1B1"}),
        "more than one rank",
        marked=["(0F1;1B0)OVERLAP_F_B"],
    )


def test_pair_counts_as_its_halves() -> None:
    order = build_dualpipev_order(2, 4)
    row = order[1]
    k = next(k for k, s in enumerate(row) if s.sub_steps is not None)
    forward, backward = row[k].parts
    row[k] = forward  # the backward is gone
    error = _fails(order, r"once per micro-batch \(m=4\)")
    assert f"stage {backward.stage_index} has no backward (B, or I and W) for micro-batches" in str(error)


def test_pair_computes_only_while_unsharded() -> None:
    order = _order(
        {0: "0UNSHARD 1UNSHARD 0F0 1F0 0F1 1B0 1RESHARD (1F1;0B0)OVERLAP_F_B 1B1 0B1 0REDUCE_GRAD 0RESHARD"}
    )
    _fails(order, "FSDP", marked=["(1F1;0B0)OVERLAP_F_B", "1B1"])


@pytest.mark.parametrize("p", [1, 2, 3])
def test_fsdp_steps_around_pairs(p: int) -> None:
    order = build_dualpipev_order(p, 2 * p)
    stages = range(2 * p)
    with_fsdp = add_fsdp_steps_with_overlaps(order, stages)
    validate_order(with_fsdp)
    validate_order(insert_comms(with_fsdp), require_comms=True)
    for rank, steps in with_fsdp.items():
        assert [s for s in steps if not s.type.is_fsdp] == order[rank], "pairs and their order are kept"
        for stage in stages_on_rank(rank, p, 2, style="v"):
            assert sum(s == MetaStep(None, T.UNSHARD, stage) for s in steps) == 1
            assert sum(s == MetaStep(None, T.REDUCE_GRAD, stage) for s in steps) == 1
    # Without pairs it is add_fsdp_steps itself.
    plain = build_1f1b_order(2, 3)
    assert add_fsdp_steps_with_overlaps(plain, [0, 1]) == add_fsdp_steps(plain, [0, 1])

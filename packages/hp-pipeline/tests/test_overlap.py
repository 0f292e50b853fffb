"""[Note: running overlapped steps]: the split form the executor runs and the simulator times."""

from __future__ import annotations

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    build_1f1b_order,
    build_dualpipev_order,
    insert_comms,
    validate_order,
)
from hp_pipeline.overlap import has_overlaps, split_order, split_overlaps

T = MetaStepType
P = MetaStep.parse


def test_forward_sends_go_between_the_halves() -> None:
    steps = [P(s) for s in ["1RECV_B1", "(0F3;1B1)OVERLAP_F_B", "0SEND_F3", "2RECV_F0", "1SEND_B1", "0F4"]]
    split = "1RECV_B1 0F3 0SEND_F3 2RECV_F0 1B1 1SEND_B1 0F4"
    assert [str(s) for s in split_overlaps(steps)] == split.split()


def test_backward_stops_at_the_next_compute_step() -> None:
    steps = [P(s) for s in ["(1F2;0B0)OVERLAP_F_B", "0UNSHARD", "1SEND_F2"]]
    assert [str(s) for s in split_overlaps(steps)] == ["1F2", "0B0", "0UNSHARD", "1SEND_F2"]


def test_lists_without_pairs_are_unchanged() -> None:
    order = insert_comms(build_1f1b_order(3, 4))
    assert not has_overlaps(order)
    assert split_order(order) == order


@pytest.mark.parametrize("m_extra", [0, 1, 5])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_split_dualpipev_orders_are_valid_and_keep_every_step(p: int, m_extra: int) -> None:
    m = 2 * p + m_extra
    runnable = insert_comms(build_dualpipev_order(p, m), data_stages=[2 * p - 1])
    split = split_order(runnable)
    assert not has_overlaps(split)
    # Deadlock-free under blocking point-to-point, as the pair form.
    validate_order(split, n_microbatches=m, require_comms=True)
    for rank, steps in runnable.items():
        flat = [part for step in steps for part in step.parts]
        assert sorted(map(str, split[rank])) == sorted(map(str, flat))
        assert [s for s in split[rank] if s.type.is_comm] == [s for s in steps if s.type.is_comm]
        for step in steps:
            if step.sub_steps is None:
                continue
            forward, backward = step.sub_steps
            between = split[rank][split[rank].index(forward) + 1 : split[rank].index(backward)]
            assert all(s.type.is_comm for s in between)
            sends = [s for s in between if s.type is T.FWD_SEND]
            if MetaStep(forward.micro_index, T.FWD_SEND, forward.stage_index) in runnable[rank]:
                # the forward's activation leaves before the backward computes
                assert sends == [MetaStep(forward.micro_index, T.FWD_SEND, forward.stage_index)]

"""The simulator reproduces the textbook bubble and memory figures, exactly."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    Order,
    ScheduleError,
    StepCosts,
    build_1f1b_order,
    build_dualpipev_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_interleaved_zero_bubble_order,
    build_looped_bfs_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    insert_comms,
    simulate,
)

T = MetaStepType
EQUAL = StepCosts(forward=1, backward=1)  # F = B, free communication
SPLIT = StepCosts(forward=1, backward=2, backward_input=1, backward_weight=1)  # F = I = W
RANKS = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("p", RANKS)
def test_gpipe_bubble_is_exactly_textbook(p: int, m: int) -> None:
    result = simulate(build_gpipe_order(p, m), EQUAL)
    assert result.makespan == 2 * (m + p - 1)
    assert result.bubble_ratio == {r: Fraction(p - 1, m + p - 1) for r in range(p)}
    assert result.bubble_overhead == {r: Fraction(p - 1, m) for r in range(p)}
    assert result.total_bubble_ratio == Fraction(p - 1, m + p - 1)
    assert result.peak_activations == {s: m for s in range(p)}  # GPipe keeps everything


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("p", RANKS)
def test_1f1b_bubble_equals_gpipe_with_bounded_memory(p: int, m: int) -> None:
    result = simulate(build_1f1b_order(p, m), EQUAL)
    assert result.makespan == 2 * (m + p - 1)
    assert result.bubble_ratio == {r: Fraction(p - 1, m + p - 1) for r in range(p)}
    assert result.peak_activations[0] == min(p, m)
    assert result.peak_activations == {s: min(p - s, m) for s in range(p)}
    assert result.peak_activations_per_rank == result.peak_activations


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("p", RANKS)
def test_interleaved_bubble_is_exactly_p_minus_1_over_v_m(p: int, k: int, v: int) -> None:
    m = k * p
    result = simulate(build_interleaved_1f1b_order(p, m, v), EQUAL)
    assert result.bubble_overhead == {r: Fraction(p - 1, v * m) for r in range(p)}
    assert result.makespan == 2 * v * m + 2 * (p - 1)


@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_interleaving_shrinks_the_1f1b_bubble(m: int) -> None:
    p = 2
    plain = simulate(build_1f1b_order(p, m), EQUAL)
    # Same model cut into v times smaller stages: each stage costs 1/v.
    for v in (2, 3):
        small = StepCosts(forward=Fraction(1, v), backward=Fraction(1, v))
        result = simulate(build_interleaved_1f1b_order(p, m, v), small)
        assert result.makespan == plain.makespan - (p - 1) * 2 * (1 - Fraction(1, v))
        assert max(result.bubble_ratio.values()) < max(plain.bubble_ratio.values())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("p", RANKS)
def test_zero_bubble_h1_has_a_third_of_the_1f1b_bubble(p: int, m: int) -> None:
    zb = simulate(build_zero_bubble_h1_order(p, m), SPLIT)
    plain = simulate(build_1f1b_order(p, m), SPLIT)
    assert max(zb.peak_activations_per_rank.values()) <= p  # 1F1B's memory
    assert zb.makespan <= plain.makespan
    if m >= p:
        assert plain.idle_time == {r: 3 * (p - 1) for r in range(p)}
        assert zb.idle_time == {r: p - 1 for r in range(p)}
        if p > 1:
            assert zb.total_idle_time / plain.total_idle_time == Fraction(1, 3)
        # Later stages hold their postponed W's, but no stage exceeds 1F1B's peak (stage 0's).
        assert max(zb.peak_activations.values()) == max(plain.peak_activations.values()) == p


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 24])
@pytest.mark.parametrize("p", RANKS)
def test_zbv_reaches_the_fill_bound_with_1f1b_memory(p: int, m: int) -> None:
    result = simulate(build_zbv_order(p, m), SPLIT)
    # Each ZB-V stage is half a 1F1B stage, so 2p of its activations are 1F1B's p.
    assert max(result.peak_activations_per_rank.values()) <= 2 * p
    assert result.makespan >= 6 * m + p - 1  # rank p-1 cannot start before time p-1
    if m >= 2 * p:
        assert result.makespan == 6 * m + p - 1
        assert result.idle_time == {r: p - 1 for r in range(p)}


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("p", RANKS)
def test_looped_bfs_has_the_interleaved_bubble_and_gpipe_memory(p: int, k: int, v: int) -> None:
    m = k * p
    result = simulate(build_looped_bfs_order(p, m, v), EQUAL)
    # Breadth-first (Lamy-Poirier, 2023): the bubble of interleaved 1F1B, (p-1)/(v*m) ...
    assert result.bubble_overhead == {r: Fraction(p - 1, v * m) for r in range(p)}
    assert result.makespan == 2 * v * m + 2 * (p - 1)
    # ... and GPipe's memory: every micro-batch of every local stage is alive at the turn.
    assert result.peak_activations == {s: m for s in range(v * p)}
    assert result.peak_activations_per_rank == {r: v * m for r in range(p)}


@pytest.mark.parametrize("costs", [(1, 1, 1), (2, 2, 1), (1, 2, 1)], ids=lambda c: "F{}-I{}-W{}".format(*c))
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_interleaved_zero_bubble_has_zb_h1_bubble_per_chunk(
    p: int, k: int, v: int, costs: tuple[int, int, int]
) -> None:
    f, i, w = costs
    m = k * p
    split = StepCosts(forward=f, backward=i + w, backward_input=i, backward_weight=w)
    result = simulate(build_interleaved_zero_bubble_order(p, m, v), split)
    # ZB-H1's bubble (Qi et al., 2024), (p-1)(F + I - W), in units of one chunk: v times smaller
    # than ZB-H1's on the same model (whose stages are v chunks long).
    assert result.idle_time == {r: (p - 1) * (f + i - w) for r in range(p)}
    # 1F1B's memory: v*p chunks, i.e. p stages' worth of activations, on every rank.
    assert max(result.peak_activations_per_rank.values()) == v * p
    if (f, i, w) == (1, 1, 1):  # a third of interleaved 1F1B's bubble
        plain = simulate(build_interleaved_1f1b_order(p, m, v), split)
        assert plain.idle_time == {r: 3 * (p - 1) for r in range(p)}


@pytest.mark.parametrize("m_per_stage", [1, 2, 3])
@pytest.mark.parametrize("p", RANKS)
def test_dualpipev_bubble_against_the_published_formula(p: int, m_per_stage: int) -> None:
    m = 2 * p * m_per_stage
    order = build_dualpipev_order(p, m)
    f, i, w = 1, 1, 1
    b = i + w

    def costs(overlap: int | None) -> StepCosts:
        return StepCosts(forward=f, backward=b, backward_input=i, backward_weight=w, overlap_f_b=overlap)

    # DualPipe's table (DeepSeek-AI, 2024), DualPipeV row: (PP/2 - 1)(F&B + B - 3W) over PP = 2p
    # stages, counted with each pair as one step of F&B. With F&B = F + B (no gain from the
    # overlap) it holds on every rank; with F&B = max(F, B) on the busiest one.
    for overlap, ranks in ((f + b, range(p)), (max(f, b), [None])):
        result = simulate(order, costs(overlap))
        formula = (p - 1) * (overlap + b - 3 * w)
        idle = max(result.idle_time.values())
        assert idle == formula, (overlap, result.idle_time)
        assert all(result.idle_time[r] == formula for r in ranks if r is not None)
    # Timed as this executor runs a pair (forward, then backward) the forward does not wait
    # for the backward's input: the bubble is halved, ZB-H1's (p-1)(F + I - W) per chunk.
    executed = simulate(order, costs(None))
    assert executed.idle_time == {r: (p - 1) * (f + i - w) for r in range(p)}
    # The table's activation memory: PP + 1 chunks per rank.
    assert executed.peak_activations_per_rank == {r: 2 * p + 1 for r in range(p)}


def test_pair_timing_in_the_timeline() -> None:
    order = build_dualpipev_order(1, 2)  # one rank holds both stages of the V
    assert " ".join(map(str, order[0])) == "0F0 1F0 0F1 1B0 (1F1;0B0)OVERLAP_F_B 1B1 0I1 0W1"
    pair = order[0][4]
    f, b, i, w = Fraction(3, 2), 2, Fraction(1, 2), Fraction(1, 4)
    result = simulate(order, StepCosts(forward=f, backward=b, backward_input=i, backward_weight=w))
    timed = result.timeline[0][4]
    assert timed.step == pair and timed.end - timed.start == f + b  # the halves, one after the other
    assert [t.step for t in result.timeline[0]] == order[0]
    assert result.compute_time == {0: 4 * f + 3 * b + i + w}
    joint = simulate(
        order,
        StepCosts(forward=f, backward=b, backward_input=i, backward_weight=w, overlap_f_b=Fraction(5, 2)),
    )
    assert joint.timeline[0][4].end - joint.timeline[0][4].start == Fraction(5, 2)
    assert joint.compute_time == {0: 3 * f + 2 * b + i + w + Fraction(5, 2)}


@pytest.mark.parametrize(
    "order",
    [
        build_gpipe_order(3, 4),
        build_1f1b_order(4, 6),
        build_interleaved_1f1b_order(2, 4, 3),
        build_zero_bubble_h1_order(3, 5),
        build_zbv_order(3, 7),
        build_looped_bfs_order(3, 4, 2),
        build_interleaved_zero_bubble_order(3, 6, 2),
        build_dualpipev_order(3, 7),
    ],
    ids=["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "looped-bfs", "interleaved-zb", "dualpipev"],
)
@pytest.mark.parametrize("overlap", [None, Fraction(5, 2)], ids=["pairs-split", "pairs-joint"])
@pytest.mark.parametrize("comm", [Fraction(0), Fraction(1, 3)])
def test_inserted_comms_do_not_change_the_timing(
    order: Order, comm: Fraction, overlap: Fraction | None
) -> None:
    costs = StepCosts(
        forward=1, backward=2, backward_input=1, backward_weight=1, comm=comm, overlap_f_b=overlap
    )
    compute_only = simulate(order, costs)
    with_comms = simulate(insert_comms(order, data_stages=[1]), costs)
    starts = {t.step: t.start for steps in compute_only.timeline.values() for t in steps}
    for steps in with_comms.timeline.values():
        for t in steps:
            if t.step.type.is_compute:
                assert t.start == starts[t.step], t.step
    assert with_comms.makespan == compute_only.makespan


@pytest.mark.parametrize("p", [2, 3, 4])
def test_comm_latency_on_the_critical_path(p: int) -> None:
    m, c = 4, Fraction(1, 2)
    costs = StepCosts(forward=1, backward=1, comm=c)
    result = simulate(insert_comms(build_gpipe_order(p, m)), costs)
    assert result.makespan == 2 * m + 2 * (p - 1) * (1 + c)


def test_timeline_and_costs() -> None:
    order = insert_comms(build_zero_bubble_h1_order(2, 2))
    costs = StepCosts(forward=Fraction(3, 2), backward_input=2, backward_weight=Fraction(1, 4))
    result = simulate(order, costs)
    assert [t.step for t in result.timeline[0]] == order[0]
    durations = {t.step.type: t.end - t.start for steps in result.timeline.values() for t in steps}
    assert durations[T.FWD] == Fraction(3, 2)
    assert durations[T.BWD_INPUT] == 2
    assert durations[T.BWD_WEIGHT] == Fraction(1, 4)
    assert durations[T.FWD_SEND] == durations[T.BWD_RECV] == 0
    assert result.compute_time == {r: 2 * (Fraction(3, 2) + 2 + Fraction(1, 4)) for r in (0, 1)}
    assert all(result.idle_time[r] == result.makespan - result.compute_time[r] for r in (0, 1))


def test_fsdp_and_load_costs_count_as_bubble() -> None:
    P = MetaStep.parse
    order = {0: [P(s) for s in ["0UNSHARD", "0F0", "0B0", "0REDUCE_GRAD", "0RESHARD"]]}
    result = simulate(order, StepCosts(unshard=1, reduce_grad=2, reshard=0))
    assert result.makespan == 1 + 1 + 2 + 2
    assert result.compute_time == {0: 3}
    assert result.bubble_ratio == {0: Fraction(3, 6)}


def test_costs_are_exact_and_checked() -> None:
    costs = StepCosts(forward=0.5, comm=Fraction(1, 3))
    assert costs.forward == Fraction(1, 2) and isinstance(costs.forward, Fraction)
    assert costs.of(T.FWD_SEND) == 0
    with pytest.raises(ValueError, match=r"StepCosts\.backward must be >= 0, got -1"):
        StepCosts(backward=-1)
    with pytest.raises(TypeError, match=r"StepCosts\.forward must be a number"):
        StepCosts(forward="fast")  # type: ignore[arg-type]
    assert StepCosts().overlap_f_b is None and StepCosts(overlap_f_b=0.5).overlap_f_b == Fraction(1, 2)
    with pytest.raises(ValueError, match=r"StepCosts\.overlap_f_b must be >= 0, got -1"):
        StepCosts(overlap_f_b=-1)
    with pytest.raises(ValueError, match="set overlap_f_b to time the pair as one step"):
        StepCosts().of(T.OVERLAP_F_B)


def test_invalid_orders_are_not_timed() -> None:
    P = MetaStep.parse
    order = {0: [P("0B0"), P("0F0")]}
    with pytest.raises(ScheduleError, match="runs before"):
        simulate(order)
    # Without validation the simulator still refuses to make up a timing.
    cyclic = {
        0: [P(s) for s in ["0F0", "0B0", "0F1", "0B1"]],
        1: [P(s) for s in ["1F0", "1F1", "1B1", "1B0"]],
    }
    with pytest.raises(ScheduleError, match="stalls"):
        simulate(cyclic, validate=False)

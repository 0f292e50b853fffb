"""Activation swap, single process: the session's numerics and accounting, the policy's errors, the IR.

The model is chosen so that what the session manages is known exactly
([Note: what a session manages] in hp_pipeline.swap): ``linear`` saves its
input and ``weight.t()`` (a view of a parameter, unmanaged), ``relu`` and
``sigmoid`` save their results, and the last ``linear``'s output is not saved.
With the micro-batch's input held by the caller, a forward of ``B`` rows
leaves exactly two ``B x W`` tensors to manage: ``relu``'s result (also the
second ``linear``'s input, so one handle) and ``sigmoid``'s.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hp_core import Platform
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    ScheduleError,
    StepCosts,
    build_1f1b_order,
    build_dualpipev_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    insert_comms,
    read_order_csv,
    render_order,
    simulate,
    validate_order,
    write_order_csv,
)
from hp_pipeline.swap import (
    SwapError,
    SwapPolicy,
    SwapSession,
    check_swap_platform,
    insert_swaps,
)
from torch import nn

B, W = 4, 8
SWAP_OUT, SWAP_IN = MetaStepType.SWAP_OUT, MetaStepType.SWAP_IN
CPU = Platform("cpu", "gloo")
MANAGED = 2 * B * W * 8  # two float64 B x W tensors per micro-batch


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.Sigmoid(), nn.Linear(W, W)).double()


def micro_batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(B, W, generator=gen, dtype=torch.float64) for _ in range(n)]


def reference_grads(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for x in xs:
        model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def forwards(model: nn.Module, xs: list[torch.Tensor], session: SwapSession) -> list[torch.Tensor]:
    """Each micro-batch's forward recorded as stage 0's, as the executor does; the losses."""
    losses = []
    for i, x in enumerate(xs):
        outs: list[torch.Tensor] = [x]
        with session.recording((0, i), held=outs.copy):  # read when the forward ends, as the executor's
            outs.append(model(x))
        losses.append(outs[1].square().sum())
    return losses


def run_with_session(
    model: nn.Module, xs: list[torch.Tensor], session: SwapSession, *, swap_in: bool = True
) -> list[torch.Tensor]:
    """All forwards (each swapped out), then the backwards in order (each swapped in first)."""
    model.zero_grad(set_to_none=True)
    losses = forwards(model, xs, session)
    for i in range(len(xs)):
        session.swap_out((0, i))
    for i, loss in enumerate(losses):
        if swap_in:
            session.swap_in((0, i))
        loss.backward()
        session.release((0, i))
    return [p.grad.clone() for p in model.parameters()]


def test_gradients_are_exact_with_swap() -> None:
    model, xs = make_model(), micro_batches(3)
    expected = reference_grads(copy.deepcopy(model), xs)
    session = SwapSession(SwapPolicy(min_bytes=0), CPU)
    got = run_with_session(model, xs, session)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert session.stats().swapped_out == 3 and session.stats().swapped_in == 3


def test_backward_without_swap_in_brings_activations_back() -> None:
    """A backward reached with its activations on the host copies them back itself."""
    model, xs = make_model(), micro_batches(2)
    expected = reference_grads(copy.deepcopy(model), xs)
    session = SwapSession(SwapPolicy(min_bytes=0), CPU)
    got = run_with_session(model, xs, session, swap_in=False)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    stats = session.stats()
    assert (stats.resident_bytes, stats.host_bytes, stats.swapped_in) == (0, 0, 2)


def test_accounting_is_exact() -> None:
    model, xs = make_model(), micro_batches(3)
    session = SwapSession(SwapPolicy(min_bytes=0), CPU)
    losses = forwards(model, xs, session)
    stats = session.stats()
    assert stats.bytes_by_micro == {(0, i): MANAGED for i in range(3)}
    assert (stats.resident_bytes, stats.peak_bytes, stats.host_bytes) == (3 * MANAGED, 3 * MANAGED, 0)

    assert session.swap_out((0, 0)) == MANAGED
    assert session.swap_out((0, 1)) == MANAGED
    assert (session.resident_bytes, session.stats().host_bytes) == (MANAGED, 2 * MANAGED)
    session.reset_peak()
    assert session.peak_bytes == MANAGED

    assert session.swap_in((0, 0)) == MANAGED
    assert session.peak_bytes == 2 * MANAGED
    losses[0].backward()
    session.release((0, 0))
    assert (session.resident_bytes, session.stats().host_bytes) == (MANAGED, MANAGED)

    session.end_step()  # a failed step: everything still held is forgotten
    stats = session.stats()
    assert (stats.resident_bytes, stats.host_bytes, stats.peak_bytes) == (0, 0, 2 * MANAGED)


def test_what_is_managed() -> None:
    """Held inputs and outputs, parameters and small tensors stay unmanaged; repeats count once."""
    model, (x,) = make_model(), micro_batches(1)
    session = SwapSession(SwapPolicy(min_bytes=0), CPU)
    with session.recording((0, 0)):  # the input is not held: linear's saved input is managed too
        out = model(x)
    assert session.stats().bytes_by_micro[(0, 0)] == MANAGED + B * W * 8

    tail = nn.Sequential(nn.Linear(W, W), nn.Tanh()).double()  # tanh saves its result: the output
    with session.recording((1, 0), held=[out]):
        y = tail(out)
    assert session.stats().bytes_by_micro[(1, 0)] == B * W * 8
    ys: list[torch.Tensor] = []
    with session.recording((2, 0), held=lambda: [out, *ys]):
        ys.append(tail(out))
    assert session.stats().bytes_by_micro[(2, 0)] == 0
    assert torch.equal(ys[0], y)

    big = SwapSession(SwapPolicy(min_bytes=B * W * 8 + 1), CPU)
    with big.recording((0, 0), held=[x]):
        model(x)
    assert big.resident_bytes == 0


def test_swap_of_an_unrecorded_micro_batch_is_refused() -> None:
    session = SwapSession(SwapPolicy(), CPU)
    with pytest.raises(RuntimeError, match="SWAP_OUT of stage 1 micro-batch 3: its forward was not recorded"):
        session.swap_out((1, 3))
    with pytest.raises(RuntimeError, match="SWAP_IN of stage 0 micro-batch 0"):
        session.swap_in((0, 0))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_newest": -1}, r"keep_newest must be an int >= 0 .* got -1"),
        ({"keep_newest": True}, r"keep_newest must be an int >= 0 .* got True"),
        ({"min_bytes": 1.5}, r"min_bytes must be an int >= 0, got 1.5"),
        ({"stages": "01"}, r"stages must be None .* got '01'"),
        ({"stages": [0, -2]}, r"stage indices \(ints >= 0\), got \[-2\]"),
    ],
)
def test_bad_policy_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(SwapError, match=match):
        SwapPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_against_the_pipeline() -> None:
    policy = SwapPolicy(stages=[1, 5])
    assert policy.stages == frozenset({1, 5})
    assert policy.swaps_stage(1) and not policy.swaps_stage(0)
    assert SwapPolicy().swaps_stage(7)
    policy.check(6, CPU)
    with pytest.raises(SwapError, match=r"stages=\[1, 5\] names stage\(s\) \[5\].*stages 0 .. 3"):
        policy.check(4, CPU)


def test_a_platform_without_host_memory_is_refused() -> None:
    meta = Platform("cpu", "gloo", "meta")
    with pytest.raises(SwapError, match=r"tensors live on 'meta'.*swap_policy=None"):
        check_swap_platform(meta)
    with pytest.raises(SwapError, match="tensor_device_type='meta'"):
        SwapPolicy().check(2, meta)
    with pytest.raises(SwapError, match="holds no data"):
        SwapSession(SwapPolicy(), meta)
    assert check_swap_platform(CPU) is False  # the CPU: plain (unpinned) host buffers


# -- the IR: SWAP_OUT / SWAP_IN through the text form, the pass, the validator, the simulator --

BUILDERS = {
    "gpipe": lambda: build_gpipe_order(4, 8),
    "1f1b": lambda: build_1f1b_order(4, 8),
    "zb-h1": lambda: build_zero_bubble_h1_order(4, 8),
    "interleaved": lambda: build_interleaved_1f1b_order(4, 8, 2),
    "zbv": lambda: build_zbv_order(4, 8),
    "dualpipev": lambda: build_dualpipev_order(4, 8),
}


def local(steps: list[MetaStep]) -> str:
    """A rank's list without its transfers, as text."""
    return " ".join(str(s) for s in steps if not s.type.is_comm)


def test_text_and_csv_round_trip() -> None:
    out, back = MetaStep(3, SWAP_OUT, 0), MetaStep.parse("2SWAP_IN5")
    assert str(out) == "0SWAP_OUT3" and MetaStep.parse("0SWAP_OUT3") == out
    assert back == MetaStep(5, MetaStepType.SWAP_IN, 2) and back.type is MetaStepType("SWAP_IN")
    order = insert_swaps(insert_comms(build_1f1b_order(4, 8)), SwapPolicy())
    text = io.StringIO()
    write_order_csv(order, text)
    assert "0SWAP_OUT0" in text.getvalue()
    assert read_order_csv(io.StringIO(text.getvalue())) == order
    assert "makespan 33" in render_order(order)  # zero-time swaps leave the timeline as it was


def test_insert_swaps_places_out_after_forward_and_in_one_slot_early() -> None:
    """1F1B p=4 m=8, keep_newest=0 ([Note: where swaps go])."""
    order = insert_swaps(build_1f1b_order(4, 8), SwapPolicy())
    assert local(order[0]) == (
        "0F0 0SWAP_OUT0 0F1 0SWAP_OUT1 0F2 0SWAP_OUT2 0SWAP_IN0 0F3 0SWAP_OUT3 0B0 0SWAP_IN1 0F4 "
        "0SWAP_OUT4 0B1 0SWAP_IN2 0F5 0SWAP_OUT5 0B2 0SWAP_IN3 0F6 0SWAP_OUT6 0B3 0SWAP_IN4 0F7 "
        "0SWAP_OUT7 0SWAP_IN5 0B4 0SWAP_IN6 0B5 0SWAP_IN7 0B6 0B7"
    )
    # Stage 2: only backwards between a forward and its backward; stage 3: F then B at once.
    assert order[2] == build_1f1b_order(4, 8)[2] and order[3] == build_1f1b_order(4, 8)[3]
    kept = insert_swaps(build_1f1b_order(4, 8), SwapPolicy(keep_newest=1, stages={0}))
    assert local(kept[0]).startswith("0F0 0F1 0SWAP_OUT0 0F2 0SWAP_OUT1 0SWAP_IN0 0F3 0SWAP_OUT2 0B0")
    assert all(s.type not in (SWAP_OUT, SWAP_IN) for r in (1, 2, 3) for s in kept[r])
    assert insert_swaps(build_1f1b_order(4, 8), SwapPolicy(keep_newest=8)) == build_1f1b_order(4, 8)
    with_comms = insert_swaps(insert_comms(build_1f1b_order(4, 8)), SwapPolicy())
    assert local(with_comms[0]) == local(order[0])  # transfers do not move the swaps


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("keep", [0, 1, 2])
def test_swapped_orders_validate(name: str, keep: int) -> None:
    order = BUILDERS[name]()
    validate_order(insert_swaps(order, SwapPolicy(keep_newest=keep)), n_microbatches=8)
    runnable = insert_swaps(insert_comms(order), SwapPolicy(keep_newest=keep))
    validate_order(runnable, n_microbatches=8, require_comms=True)
    forward_only = {r: [s for s in steps if s.type is MetaStepType.FWD] for r, steps in order.items()}
    assert insert_swaps(forward_only, SwapPolicy()) == forward_only  # no backward: nothing to swap


def test_validator_catches_misplaced_swaps() -> None:
    order = insert_swaps(build_1f1b_order(4, 8), SwapPolicy())
    row = order[0]
    no_in = {**order, 0: [s for s in row if s != MetaStep(0, SWAP_IN, 0)]}
    with pytest.raises(ScheduleError, match=r"0SWAP_OUT0 moves stage 0's micro-batch 0 .* no 0SWAP_IN0"):
        validate_order(no_in)
    late = [s for s in row if s != MetaStep(0, SWAP_IN, 0)]
    late.insert(late.index(MetaStep(0, MetaStepType.BWD, 0)) + 1, MetaStep(0, SWAP_IN, 0))
    with pytest.raises(ScheduleError, match="0SWAP_IN0 must come before 0B0"):
        validate_order({**order, 0: late})
    early = [s for s in row if s != MetaStep(1, SWAP_OUT, 0)]
    early.insert(0, MetaStep(1, SWAP_OUT, 0))
    with pytest.raises(ScheduleError, match=r"0SWAP_OUT1 \(rank 0, position 0\) runs before 0F1"):
        validate_order({**order, 0: early})
    with pytest.raises(ValueError, match="rank 0 already has swap steps"):
        insert_swaps(order, SwapPolicy())
    with pytest.raises(TypeError, match="insert_swaps needs a SwapPolicy, got dict"):
        insert_swaps(order, {"keep_newest": 0})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_simulated_device_peak(name: str) -> None:
    """Without swaps the device peak is the live peak; with them it drops, and swaps take no rank time."""
    order = insert_comms(BUILDERS[name]())
    plain = simulate(order)
    assert plain.peak_device_activations_per_rank == plain.peak_activations_per_rank
    swapped = simulate(insert_swaps(order, SwapPolicy()))
    assert swapped.peak_activations_per_rank == plain.peak_activations_per_rank
    assert swapped.makespan == plain.makespan
    for rank, peak in swapped.peak_device_activations_per_rank.items():
        assert peak <= plain.peak_activations_per_rank[rank]


def test_simulated_device_peak_of_1f1b_and_gpipe() -> None:
    one_f_one_b = simulate(insert_swaps(build_1f1b_order(4, 8), SwapPolicy()))
    assert one_f_one_b.peak_activations_per_rank == {0: 4, 1: 3, 2: 2, 3: 1}
    assert one_f_one_b.peak_device_activations_per_rank == {0: 2, 1: 2, 2: 2, 3: 1}
    gpipe = simulate(insert_swaps(build_gpipe_order(4, 8), SwapPolicy()))
    assert gpipe.peak_device_activations_per_rank == {r: 2 for r in range(4)}  # 8 without
    slow = simulate(insert_swaps(build_1f1b_order(4, 8), SwapPolicy()), StepCosts(by_code={"SWAP_OUT": 1}))
    assert slow.makespan > one_f_one_b.makespan  # a swap given a cost is timed on its rank


def test_simulated_device_bytes() -> None:
    """Weighted by each micro-batch's bytes, as the executor's accounting counts them."""
    result = simulate(insert_swaps(build_1f1b_order(4, 8), SwapPolicy()))
    assert result.peak_device_bytes(0, 100) == 200
    sizes = {(0, i): 100 + i for i in range(8)}  # the last pair on the device: 6 and 7
    assert result.peak_device_bytes(0, sizes) == 106 + 107
    with pytest.raises(KeyError, match="no size for stage 0's micro-batch 7"):
        result.peak_device_bytes(0, {(0, i): 1 for i in range(7)})


def test_count_only_counts_the_same_bytes() -> None:
    """[Note: counting without swapping]: the same selection and accounting, no handles."""
    model, (x,) = make_model(), micro_batches(1)
    session = SwapSession(SwapPolicy(min_bytes=0), CPU)
    outs: list[torch.Tensor] = [x]
    with session.recording((0, 0), held=outs.copy, count_only=True):
        outs.append(model(x))
    assert session.stats().bytes_by_micro[(0, 0)] == MANAGED == session.resident_bytes
    with pytest.raises(RuntimeError, match="recorded with count_only=True"):
        session.swap_out((0, 0))
    with pytest.raises(RuntimeError, match="recorded the forward of micro-batch 0 twice"):
        with session.recording((0, 0)):
            pass
    outs[1].square().sum().backward()
    session.release((0, 0))
    assert (session.resident_bytes, session.peak_bytes) == (0, MANAGED)


def test_compiled_module_swaps_exactly() -> None:
    """A ``torch.compile``d stage: AOTAutograd's saved tensors go through the session too."""
    xs = micro_batches(3)
    model = make_model()
    compiled = torch.compile(model)  # one compile for both runs (no optimizer step between them)

    def train(swap: bool) -> tuple[list[torch.Tensor], int]:
        session = SwapSession(SwapPolicy(min_bytes=0), CPU)
        for _ in range(2):  # the second step reuses the compiled graphs
            model.zero_grad(set_to_none=True)
            session.begin_step()
            losses = []
            for i, x in enumerate(xs):
                outs: list[torch.Tensor] = [x]
                with session.recording((0, i), held=outs.copy, count_only=not swap):
                    outs.append(compiled(x))
                if swap:
                    session.swap_out((0, i))
                losses.append(outs[1].square().sum())
            for i, loss in enumerate(losses):
                if swap:
                    session.swap_in((0, i))
                loss.backward()
                session.release((0, i))
        return [p.grad.clone() for p in model.parameters()], session.stats().swapped_out

    (plain, _), (swapped, moved) = train(False), train(True)
    assert moved == 3
    for a, b in zip(swapped, plain, strict=True):
        assert torch.equal(a, b)

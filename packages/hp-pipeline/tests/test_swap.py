"""Activation swap, single process: the session's numerics and accounting, and the policy's errors.

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

import pytest
import torch
from hp_core import Platform
from hp_pipeline.swap import SwapError, SwapPolicy, SwapSession, check_swap_platform
from torch import nn

B, W = 4, 8
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
        with session.recording((0, i), held=[x]):
            out = model(x)
        session.hold((0, i), [out])
        losses.append(out.square().sum())
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
    session.hold((1, 0), [y])
    assert session.stats().bytes_by_micro[(1, 0)] == 0

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

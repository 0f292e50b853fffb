"""Convolutions on DTensors: the matmul plans (batch, output channel, input channel, whole groups).

Every case runs under ``fallback_policy("error")`` against the same
convolution on plain tensors (float64, values and the gradients of input,
weight and bias), on 2 ranks, and counts the collectives of the forward and
of the backward: a batch cut and an output-channel cut communicate nothing,
an input-channel cut returns a ``Partial("sum")`` with no communication, and
the weight and bias gradients of a batch cut stay ``Partial("sum")`` (what
FSDP's reduce-scatter and DP's all-reduce take).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, R = Shard(0), Shard(1), Replicate()
SUM = Partial("sum")


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# (name, fn(x, w, b), x shape, weight shape, bias size)
_CONVS: list[tuple[str, Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...], int]] = [
    ("conv1d", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1), (4, 6, 9), (4, 6, 3), 4),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1, dilation=2), (3, 4, 7, 6), (6, 4, 3, 2), 6),
    ("conv3d", lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1)), (2, 4, 4, 5, 3), (2, 4, 2, 2, 2), 2),
    (
        "conv_transpose1d",
        lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, output_padding=1),
        (4, 6, 5),
        (6, 4, 3),
        4,
    ),
    (
        "conv_transpose2d",
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1),
        (3, 4, 5, 4),
        (4, 6, 3, 3),
        6,
    ),
]


def _expected(name: str, cut: str) -> tuple[tuple[Any, Any, Any], Any]:
    """(x, weight, bias) placements for a cut and the output's placement."""
    transposed = "transpose" in name
    out_dim = 1 if transposed else 0  # the weight's output channel dim
    if cut == "batch":
        return (S0, R, R), S0
    if cut == "out":
        return (R, Shard(out_dim), S0), S1
    return (S1, Shard(1 - out_dim), R), SUM  # input channels


@pytest.mark.distributed(world_size=2)
def test_convolutions_take_the_matmul_plans(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    with fallback_policy("error"):
        for name, fn, xs, ws, bs in _CONVS:
            x, w, b = _t(*xs), _t(*ws), _t(bs)
            for cut in ("batch", "out", "in"):
                placements, out = _expected(name, cut)
                check(fn, [x, w, b], placements, mesh, expect=[out])
            no_bias = lambda x, w, fn=fn: fn(x, w, None)  # noqa: E731
            check(no_bias, [x, w], [S0, R], mesh, expect=[S0])
            # a batch of 1 over 2 ranks: one rank's piece is empty, and still nothing is sent
            check(fn, [x[:1], w, b], [S0, R, R], mesh, expect=[S0])


@pytest.mark.distributed(world_size=2)
def test_batch_cut_weight_and_bias_gradients_are_partial_sums(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Data parallel: each rank's weight gradient is its batch's term; nothing is reduced by the op."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, w, b = _t(4, 3, 6, 6), _t(5, 3, 3, 3), _t(5)
    full_w, full_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    F.conv2d(x, full_w, full_b, stride=2).square().sum().backward()
    dx = distribute_tensor(x, mesh, [S0])
    dw = distribute_tensor(w, mesh, [R]).requires_grad_()
    db = distribute_tensor(b, mesh, [R]).requires_grad_()
    with fallback_policy("error"):
        out = F.conv2d(dx, dw, db, stride=2)
        loss = out.square().sum()
        with record_collectives() as log:
            loss.backward()
    assert len(log) == 0, list(log)
    assert dw.grad.placements == (SUM,) and db.grad.placements == (SUM,)
    torch.testing.assert_close(dw.grad.full_tensor(), full_w.grad)
    torch.testing.assert_close(db.grad.full_tensor(), full_b.grad)


@pytest.mark.distributed(world_size=2)
def test_grouped_convolutions_cut_whole_groups(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    with fallback_policy("error"):
        # depthwise: 4 groups over 2 ranks, 2 each
        x, w, b = _t(2, 4, 6, 5), _t(8, 1, 3, 3), _t(8)
        fn = lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=4)  # noqa: E731
        check(fn, [x, w, b], [S1, S0, S0], mesh, expect=[S1])
        check(fn, [x, w, b], [S0, R, R], mesh, expect=[S0])
        # a transposed grouped convolution: the weight is (Cin, Cout / groups, ...)
        x, w, b = _t(2, 4, 5), _t(4, 3, 3), _t(6)
        fn = lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, groups=2)  # noqa: E731
        check(fn, [x, w, b], [S1, S0, S0], mesh, expect=[S1])
        # 3 groups do not split over 2 ranks: the channels are gathered, the values right
        x, w, b = _t(2, 6, 5), _t(6, 2, 3), _t(6)
        fn = lambda x, w, b: F.conv1d(x, w, b, groups=3)  # noqa: E731
        check(fn, [x, w, b], [S1, S0, S0], mesh, local=False)


@pytest.mark.distributed(world_size=2)
def test_conv_module_trains_batch_parallel(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """An ``nn.Conv2d`` with replicated DTensor parameters on a batch-cut input: 2 SGD steps."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    ours = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    ours.load_state_dict(ref.state_dict())
    for name, param in list(ours.named_parameters()):
        setattr(ours, name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [R])))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    with fallback_policy("error"):
        for _ in range(2):
            x = _t(4, 3, 5, 5)
            ref(x).square().mean().backward()
            out = ours(distribute_tensor(x, mesh, [S0]))
            out.square().mean().backward()
            for p in ours.parameters():
                p.grad = p.grad.redistribute(placements=[R])  # DP's all-reduce
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert isinstance(p, DTensor)
        torch.testing.assert_close(p.full_tensor(), q.detach())

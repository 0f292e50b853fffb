"""torch's fused (and foreach) optimizers and ``clip_grad_norm_`` on DTensor parameters, against one process.

Three steps of clip + step over sharded, replicated, uneven (an empty piece
included) parameters with sharded and partial gradients, on 2 and 4 ranks:
every parameter equals the single-process run after each step, the fused
kernel runs without gathering anything (a partial gradient costs its one
all-reduce), and the clip costs one scalar all-reduce per mesh dim.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True),
    "adam-fused-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.05, amsgrad=True, fused=True),
    "adam-fused-tensor-lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.05), fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=True),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
}


def _train(mesh, shapes, placements, grad_placements, make, steps=3):  # type: ignore[no-untyped-def]
    """Clip + step ``steps`` times on DTensors and on plain tensors; compare; return the logs."""
    torch.manual_seed(0)
    init = [torch.randn(s, dtype=torch.float64) for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    params = [
        torch.nn.Parameter(distribute_tensor(t.clone(), mesh, p))
        for t, p in zip(init, placements, strict=True)
    ]
    opt, ref_opt = make(params), make(ref)
    clip_logs, step_logs = [], []
    for _ in range(steps):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for r, p, g, gp in zip(ref, params, grads, grad_placements, strict=True):
            r.grad = g.clone()
            p.grad = distribute_tensor(g.clone(), mesh, gp)
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        with record_collectives() as clip_log:
            got = torch.nn.utils.clip_grad_norm_(params, 0.5)
        torch.testing.assert_close(got.full_tensor(), want)
        ref_opt.step()
        with record_collectives() as step_log:
            opt.step()
        clip_logs.append(clip_log)
        step_logs.append(step_log)
        for r, p in zip(ref, params, strict=True):
            assert isinstance(p.data, DTensor) and p.placements == p.grad.placements
            torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-12, atol=1e-12)
    return clip_logs, step_logs


@pytest.mark.distributed(world_size=2)
def test_optimizers_on_sharded_params_2_ranks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    shapes = [(3, 4), (5, 6), (7,), (4, 3)]
    placements = [[Shard(0)], [Shard(1)], [Shard(0)], [Replicate()]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback anywhere
        for name, make in OPTIMIZERS.items():
            clip_logs, step_logs = _train(mesh, shapes, placements, placements, make)
            for clip_log, step_log in zip(clip_logs, step_logs, strict=True):
                assert clip_log.counts() == {"all_reduce": 1}, (name, clip_log.counts())
                assert clip_log.nbytes("all_reduce") == 8  # one float64 scalar
                assert step_log.count() == 0, (name, step_log.counts())


@pytest.mark.distributed(world_size=4)
def test_optimizers_on_a_2d_mesh_with_partial_grads(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), mesh_dim_names=("dp", "tp"))
    shapes = [(3, 4), (3, 5), (6,), (4, 2)]
    # (3, 5) on [S(0), S(0)]: 3 rows -> 2 | 1 -> 1, 1 | 1, 0: one rank holds no row.
    placements = [
        [Shard(0), Shard(1)],
        [Shard(0), Shard(0)],
        [Shard(0), Replicate()],
        [Replicate(), Replicate()],
    ]
    grad_placements = [
        [Shard(0), Shard(1)],
        [Shard(0), Shard(0)],
        [Shard(0), Partial("sum")],  # a gradient still partial over tp (sequence parallel)
        [Replicate(), Replicate()],
    ]
    for name in ("adamw-fused", "sgd-fused", "adamw-foreach"):
        _, step_logs = _train(mesh, shapes, placements, grad_placements, OPTIMIZERS[name])
        for step_log in step_logs:
            # The clip's _foreach_mul_ reduced the partial gradient in place: the step moves nothing.
            assert step_log.count() == 0, (name, step_log.counts())
    # Without the clip, the fused step itself reduces the partial gradient: its one all-reduce.
    torch.manual_seed(1)
    init = [torch.randn(s, dtype=torch.float64) for s in shapes]
    params = [
        torch.nn.Parameter(distribute_tensor(t, mesh, p)) for t, p in zip(init, placements, strict=True)
    ]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
    for p, r, g, gp in zip(params, ref, grads, grad_placements, strict=True):
        p.grad, r.grad = distribute_tensor(g, mesh, gp), g.clone()
    opt, ref_opt = OPTIMIZERS["adamw-fused"](params), OPTIMIZERS["adamw-fused"](ref)
    with record_collectives() as log:
        opt.step()
    ref_opt.step()
    assert log.counts() == {"all_reduce": 1} and log.nbytes("all_reduce") == 3 * 8, log.counts()
    assert params[2].grad.placements == (Shard(0), Replicate())  # reduced in place, as the kernel wrote it
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.full_tensor(), r.detach())


@pytest.mark.distributed(world_size=2)
def test_fused_kernel_called_directly_with_scale_and_dtensor_states(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(2)
    full = [torch.randn(5, 3) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    full[3] = full[3].abs()
    step = torch.tensor(3.0)
    plain = [t.clone() for t in full]
    dts = [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in full]
    dts[2] = distribute_tensor(full[2].clone(), mesh, [Replicate()])  # a state saved under other placements
    kwargs: dict[str, Any] = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8)
    kwargs.update(amsgrad=False, maximize=False)
    scale, found = torch.tensor(2.0), torch.tensor(0.0)
    torch._fused_adamw_(
        [plain[0]],
        [plain[1]],
        [plain[2]],
        [plain[3]],
        [],
        [step.clone()],
        **kwargs,
        grad_scale=scale,
        found_inf=found,
    )
    steps = [distribute_tensor(step.clone(), mesh, [Replicate()])]
    result = torch._fused_adamw_(
        [dts[0]],
        [dts[1]],
        [dts[2]],
        [dts[3]],
        [],
        steps,
        **kwargs,
        grad_scale=distribute_tensor(scale, mesh, [Replicate()]),
        found_inf=found,
    )
    assert result is None
    assert dts[2].placements == (Shard(0),)  # moved itself, so the kernel's write landed in it
    for got, want in zip(dts, plain, strict=True):
        torch.testing.assert_close(got.full_tensor(), want)


@pytest.mark.distributed(world_size=2)
def test_fused_step_bad_input(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    q = torch.nn.Parameter(torch.ones(3))
    p.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    q.grad = torch.ones(3)
    with pytest.raises(TypeError, match=r"parameter 1 is a plain Parameter among DTensor parameters"):
        torch.optim.AdamW([p, q], fused=True).step()
    partial = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Partial("sum")]))
    partial.grad = DTensor.from_local(torch.ones(2), mesh, [Partial("sum")])
    with pytest.raises(ValueError, match=r"parameter 0 has placements \[Partial\('sum'\)\]"):
        torch.optim.SGD([partial], lr=0.1, fused=True).step()

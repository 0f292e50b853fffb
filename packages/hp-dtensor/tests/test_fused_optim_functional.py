"""The functional fused optimizer kernels and fused Adagrad on DTensor parameters, against one process.

``_fused_adam`` / ``_fused_adamw`` / ``_fused_sgd`` / ``_fused_adagrad``
return new lists and leave their arguments alone; each output must equal the
plain kernel's, placed like its argument, with no gather (a partial gradient
costs its one all-reduce) and no fallback. ``torch.optim.Adagrad(fused=True)``
takes the in-place ``_fused_adagrad_``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, fallback_stats
from hp_testing import record_collectives

ADAM = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, maximize=False)
KERNELS: dict[str, tuple[Any, int, dict[str, Any]]] = {
    # name: (kernel, number of parameter-shaped lists, keyword arguments)
    "adamw": (torch.ops.aten._fused_adamw.default, 4, dict(ADAM, amsgrad=False)),
    "adam-amsgrad": (torch.ops.aten._fused_adam.default, 5, dict(ADAM, amsgrad=True)),
    "adam-tensor-lr": (
        torch.ops.aten._fused_adam.tensor_lr,
        4,
        dict(ADAM, amsgrad=False, lr=torch.tensor(0.1)),
    ),
    "sgd": (
        torch.ops.aten._fused_sgd.default,
        3,
        dict(
            weight_decay=0.01,
            momentum=0.9,
            lr=0.1,
            dampening=0.0,
            nesterov=True,
            maximize=False,
            is_first_step=False,
        ),
    ),
    "adagrad": (
        torch.ops.aten._fused_adagrad.default,
        3,
        dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, eps=1e-10, maximize=False),
    ),
}


def _args(name: str, lists: list[list[Any]], steps: list[Any]) -> tuple[Any, ...]:
    if name.startswith("adam"):
        amsgrad = name == "adam-amsgrad"
        return (*lists[:4], lists[4] if amsgrad else [], steps)
    if name == "sgd":
        return tuple(lists[:3])
    return (*lists[:3], steps)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(KERNELS))
def test_functional_fused_kernel_matches_plain(rank, device_mesh_factory, name):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    kernel, count, kwargs = KERNELS[name]
    torch.manual_seed(5)
    shapes = [(5, 3), (1, 4), (6,)]  # 5 rows: uneven; 1 row: one rank holds an empty piece
    # per list (param, grad, state, state, state): one tensor per element, states non-negative
    plain = [[torch.randn(s, dtype=torch.float64).abs() for s in shapes] for _ in range(5)]
    steps = [torch.tensor(3.0, dtype=torch.float64) for _ in shapes]
    cuts = [[Shard(0)], [Shard(0)], [Replicate()]]

    def dtensor(k: int, i: int) -> DTensor:
        t = plain[k][i].clone()
        if k == 1 and i == 2:  # a partial gradient of a replicated parameter: terms summing to it
            return DTensor.from_local(t / 2, mesh, [Partial("sum")])
        if k == 2 and i == 0:  # a state saved under other placements than its parameter's
            return distribute_tensor(t, mesh, [Replicate()])
        return distribute_tensor(t, mesh, cuts[i])

    dts = [[dtensor(k, i) for i in range(len(shapes))] for k in range(5)]
    dsteps = [distribute_tensor(s.clone(), mesh, [Replicate()]) for s in steps]
    placements_before = [[d.placements for d in lst] for lst in dts]
    want = kernel(
        *_args(name, [[t.clone() for t in lst] for lst in plain], [s.clone() for s in steps]), **kwargs
    )
    before = fallback_stats()
    with record_collectives() as log:
        got = kernel(*_args(name, dts, dsteps), **kwargs)
    # Only the partial gradient is reduced; the replicated state is cut locally.
    assert log.counts() == {"all_reduce": 1}, log.counts()
    assert fallback_stats() == before
    assert [[d.placements for d in lst] for lst in dts] == placements_before  # arguments left alone
    assert len(got) == len(want)
    for k, (got_list, want_list) in enumerate(zip(got, want, strict=True)):
        assert len(got_list) == len(want_list)
        for i, (g, w) in enumerate(zip(got_list, want_list, strict=True)):
            assert isinstance(g, DTensor), (k, i)
            if k < count:
                assert g.placements == tuple(cuts[i]), (k, i, g.placements)
            torch.testing.assert_close(g.full_tensor(), w, rtol=1e-12, atol=1e-12)
    for k, lst in enumerate(dts[: len(got)]):  # inputs keep their values
        for i, d in enumerate(lst):
            if not (k == 1 and i == 2):
                torch.testing.assert_close(d.full_tensor(), plain[k][i], rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_fused_adagrad_optimizer(rank, device_mesh_factory):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(6)
    shapes, cuts = [(5, 3), (1, 4), (6,)], [[Shard(0)], [Shard(0)], [Replicate()]]
    init = [torch.randn(s, dtype=torch.float64) for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    params = [
        torch.nn.Parameter(distribute_tensor(t.clone(), mesh, c)) for t, c in zip(init, cuts, strict=True)
    ]
    make = lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.01, fused=True)  # noqa: E731
    opt, ref_opt = make(params), make(ref)
    before = fallback_stats()
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for r, p, g, c in zip(ref, params, grads, cuts, strict=True):
            r.grad = g.clone()
            p.grad = distribute_tensor(g.clone(), mesh, c)
        ref_opt.step()
        with record_collectives() as log:
            opt.step()
        assert log.count() == 0, log.counts()
        for r, p in zip(ref, params, strict=True):
            torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-12, atol=1e-12)
    assert fallback_stats() == before

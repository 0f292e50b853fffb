"""Ops and foreach ops over DTensors on permuted meshes (FSDP x TP's ``("dp", "tp")`` and ``("tp", "dp")``).

An argument on a permutation of the op's mesh is re-expressed on it without
communication; a foreach op takes elements on different meshes (each
element's tensors on one mesh or a permutation of it) and runs one local
call. Values against plain tensors; communication counted.
"""

from __future__ import annotations

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives


def _meshes(device_mesh_factory):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), mesh_dim_names=("dp", "tp"))
    return mesh, mesh.permute("tp", "dp")


@pytest.mark.distributed(world_size=4)
def test_an_argument_on_the_permuted_mesh_is_re_expressed(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh, permuted = _meshes(device_mesh_factory)
    torch.manual_seed(0)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    a = distribute_tensor(x, mesh, [Shard(0), Shard(1)])  # rows over dp, columns over tp
    b = distribute_tensor(y, permuted, [Shard(1), Shard(0)])  # the same cut, named from ("tp", "dp")
    with record_collectives() as log:
        total = a + b
    assert log.count() == 0, log.counts()  # the same pieces: nothing moves
    assert total.device_mesh is mesh and total.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(total.full_tensor(), x + y)
    reverse = b * a
    assert reverse.device_mesh is permuted and reverse.placements == (Shard(1), Shard(0))
    torch.testing.assert_close(reverse.full_tensor(), x * y)
    # Norms from both orderings stack, and the norm of the stack stays partial.
    with record_collectives() as log:
        norms = torch.stack([torch.linalg.vector_norm(a), torch.linalg.vector_norm(b)])
        both = torch.linalg.vector_norm(norms)
    assert log.count() == 0, log.counts()
    assert both.placements == (Partial("norm", 2),) * 2
    torch.testing.assert_close(both.full_tensor(), torch.linalg.vector_norm(torch.cat([x, y])))
    # Gradients flow back (each on the op's mesh: the autograd engine does not ask for the argument's).
    xa = a.detach().requires_grad_(True)
    yb = b.detach().requires_grad_(True)
    (xa * yb).sum().full_tensor().backward()
    assert yb.grad.device_mesh in (mesh, permuted)
    torch.testing.assert_close(xa.grad.full_tensor(), y)
    torch.testing.assert_close(yb.grad.full_tensor(), x)


@pytest.mark.distributed(world_size=4)
def test_meshes_that_cannot_be_re_expressed_raise(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh, permuted = _meshes(device_mesh_factory)
    x = torch.randn(8, 4)
    a = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    nested = distribute_tensor(x, permuted, [Shard(0), Shard(0)])  # tp cuts first, then dp
    with pytest.raises(ValueError, match=r"shards one tensor dim on two mesh dims.*permuted mesh"):
        a + nested
    other = distribute_tensor(x, mesh["dp"], [Shard(0)])
    with pytest.raises(ValueError, match=r"different meshes.*permutations of one mesh"):
        a + other


def _params(mesh, permuted, init):  # type: ignore[no-untyped-def]
    """FSDP x TP's mix: row-wise on ("dp", "tp"), column-wise on ("tp", "dp"), replicated over tp."""
    layouts = [
        (mesh, [Shard(0), Shard(1)]),
        (permuted, [Shard(0), Shard(0)]),  # TP and FSDP both on dim 0: tp cuts first
        (mesh, [Shard(0), Replicate()]),
        (permuted, [Replicate(), Shard(0)]),
    ]
    return layouts, [
        torch.nn.Parameter(distribute_tensor(t.clone(), m, p))
        for t, (m, p) in zip(init, layouts, strict=True)
    ]


@pytest.mark.distributed(world_size=4)
def test_foreach_ops_take_elements_on_permuted_meshes(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh, permuted = _meshes(device_mesh_factory)
    torch.manual_seed(1)
    shapes = [(4, 6), (6, 4), (5,), (3, 2)]
    xs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    ys = [torch.randn(s, dtype=torch.float64) for s in shapes]
    layouts, params = _params(mesh, permuted, xs)
    dxs = [p.detach() for p in params]
    dys = [distribute_tensor(y, m, p) for y, (m, p) in zip(ys, layouts, strict=True)]
    with record_collectives() as log:
        torch._foreach_add_(dxs, dys, alpha=2.0)
        norms = torch._foreach_norm(dxs, 3.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 3.0)
    assert log.count() == 0, log.counts()
    want = torch._foreach_add(xs, ys, alpha=2.0)
    for got, w, (m, p) in zip(dxs, want, layouts, strict=True):
        assert got.device_mesh is m and list(got.placements) == p
        torch.testing.assert_close(got.full_tensor(), w)
    torch.testing.assert_close(
        total.full_tensor(), torch.linalg.vector_norm(torch.stack(torch._foreach_norm(want, 3.0)), 3.0)
    )
    # A second list whose element sits on the permutation of its first's mesh.
    flipped = [distribute_tensor(ys[1], mesh, [Shard(1), Shard(0)])]  # on ("tp", "dp"): [S(0), S(1)]
    out = torch._foreach_mul([dxs[1]], flipped)
    assert out[0].device_mesh is permuted
    torch.testing.assert_close(out[0].full_tensor(), want[1] * ys[1])


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("flavour", ["foreach", "fused"])
def test_clip_and_adamw_over_permuted_meshes(rank, device_mesh_factory, flavour) -> None:  # type: ignore[no-untyped-def]
    mesh, permuted = _meshes(device_mesh_factory)
    torch.manual_seed(2)
    shapes = [(4, 6), (6, 4), (5,), (3, 2)]
    init = [torch.randn(s, dtype=torch.float64) for s in shapes]
    layouts, params = _params(mesh, permuted, init)
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    kwargs = {"foreach": True} if flavour == "foreach" else {"fused": True}
    opt = torch.optim.AdamW(params, lr=0.05, **kwargs)
    ref_opt = torch.optim.AdamW(ref, lr=0.05, **kwargs)
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, r, g, (m, pl) in zip(params, ref, grads, layouts, strict=True):
            p.grad, r.grad = distribute_tensor(g, m, pl), g.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=True)
        with record_collectives() as log:
            got = torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
            opt.step()
        ref_opt.step()
        # One float64 scalar all-reduce per mesh dim the norm is partial on; nothing else.
        assert log.counts() == {"all_reduce": 2} and log.nbytes("all_reduce") == 16, log.counts()
        torch.testing.assert_close(got.full_tensor(), want)
        for p, r, (m, pl) in zip(params, ref, layouts, strict=True):
            assert p.device_mesh is m and list(p.placements) == pl
            torch.testing.assert_close(p.full_tensor(), r.detach())


@pytest.mark.distributed(world_size=4)
def test_foreach_adamw_over_a_1d_and_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh, _ = _meshes(device_mesh_factory)
    torch.manual_seed(3)
    init = [torch.randn(4, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)]
    params = [
        torch.nn.Parameter(distribute_tensor(init[0].clone(), mesh, [Shard(0), Shard(1)])),
        torch.nn.Parameter(distribute_tensor(init[1].clone(), mesh["dp"], [Shard(0)])),
    ]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.AdamW(params, lr=0.05, foreach=True)
    ref_opt = torch.optim.AdamW(ref, lr=0.05, foreach=True)
    for _ in range(3):
        grads = [torch.randn_like(t) for t in init]
        params[0].grad = distribute_tensor(grads[0], mesh, [Shard(0), Shard(1)])
        params[1].grad = distribute_tensor(grads[1], mesh["dp"], [Shard(0)])
        for r, g in zip(ref, grads, strict=True):
            r.grad = g.clone()
        with record_collectives() as log:
            opt.step()
        ref_opt.step()
        assert log.count() == 0, log.counts()
        for p, r in zip(params, ref, strict=True):
            assert isinstance(p.data, DTensor)
            torch.testing.assert_close(p.full_tensor(), r.detach())

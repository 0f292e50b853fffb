"""Reductions over ``StridedShard`` tensors stay partial: ``_foreach_norm`` / ``_max`` / ``_powsum``, norms.

A strided cut's pieces split the tensor as a plain cut's do (its rows are a
permutation of them), so a reduction over every element is a partial of the
per-piece values, nothing gathered. Uneven strided cuts and an empty piece
(two rows in two blocks over two ranks) included; ``clip_grad_norm_`` over a
mix of Shard, StridedShard and Replicate gradients runs without a fallback,
and so does a foreach optimizer step, torch's FSDP2 + TP layout
``[StridedShard(0, k), Shard(0)]`` included (2-D mesh, 4 ranks).
"""

from __future__ import annotations

import math

import pytest
import torch
from hp_dtensor import Partial, Replicate, Shard, StridedShard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

R = Replicate()
ORDS = [2, 1, 0, 3.5, 0.5, -1.5, math.inf, -math.inf]
# (shape, placements): strided even, strided uneven (3 + 2 rows), strided with an empty piece, others
ELEMENTS = [
    ((6, 4), [StridedShard(0, 3)]),
    ((5, 4), [StridedShard(0, 2)]),
    ((2, 3), [StridedShard(0, 2)]),
    ((3, 8), [StridedShard(1, 2)]),
    ((5, 3), [Shard(0)]),
    ((4,), [R]),
]

# On a 2-D mesh: torch's FSDP2 + TP layout (a Shard above the strided cut of its dim), and others
FSDP_TP_ELEMENTS = [
    ((8, 4), [StridedShard(0, 2), Shard(0)]),
    ((6, 4), [Shard(1), StridedShard(0, 3)]),
    ((5, 3), [Shard(0), Shard(1)]),
    ((4,), [R, R]),
]


def _elements(mesh, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    plain = [torch.randn(shape, dtype=torch.float64) for shape, _ in ELEMENTS]
    dts = [distribute_tensor(t, mesh, p) for t, (_, p) in zip(plain, ELEMENTS, strict=True)]
    return plain, dts


def _kinds(partial: Partial) -> list[tuple[Partial | Replicate, ...]]:
    return [(partial,)] * (len(ELEMENTS) - 1) + [(R,)]


@pytest.mark.distributed(world_size=2)
def test_an_element_has_an_empty_piece(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The ``(2, 3)`` element cut ``StridedShard(0, 2)`` leaves rank 1 no rows (the identity case below)."""
    mesh = device_mesh_factory((2,))
    _, dts = _elements(mesh)
    assert dts[2].to_local().shape == ((2, 3) if rank == 0 else (0, 3))
    assert dts[1].to_local().shape[0] == (3 if rank == 0 else 2)


@pytest.mark.distributed(world_size=2)
def test_foreach_norm_of_strided_elements_stays_partial(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``_foreach_norm``, every ord: ``Partial("norm", p)`` (a sum for 0), nothing sent, values as plain."""
    mesh = device_mesh_factory((2,))
    plain, dts = _elements(mesh)
    for ord in ORDS:
        with record_collectives() as log, fallback_policy("error"):
            norms = torch._foreach_norm(dts, ord)
        assert log.count() == 0, (ord, log.counts())
        assert [n.placements for n in norms] == _kinds(Partial("sum") if ord == 0 else Partial("norm", ord))
        for got, want in zip(norms, torch._foreach_norm(plain, ord), strict=True):
            torch.testing.assert_close(got.full_tensor(), want)
    for dt, (_, placements) in zip(dts, ELEMENTS, strict=True):
        assert dt.placements == tuple(placements)  # the inputs were not moved either


@pytest.mark.distributed(world_size=2)
def test_foreach_max_and_powsum_of_strided_elements(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``_foreach_max`` is ``Partial("max")`` (an empty piece gives -inf), ``_foreach_powsum`` a sum."""
    mesh = device_mesh_factory((2,))
    plain, dts = _elements(mesh, seed=1)
    with record_collectives() as log, fallback_policy("error"):
        maxes = torch._foreach_max(dts)
        sums = torch._foreach_powsum(dts, 3)
    assert log.count() == 0, log.counts()
    assert [m.placements for m in maxes] == _kinds(Partial("max"))
    assert [s.placements for s in sums] == _kinds(Partial("sum"))
    for got, want in zip(maxes, torch._foreach_max(plain), strict=True):
        assert torch.equal(got.full_tensor(), want)
    for got, want in zip(sums, torch._foreach_powsum(plain, 3), strict=True):
        torch.testing.assert_close(got.full_tensor(), want)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("ord", [2, 1, 3.5, -1.5, math.inf, -math.inf])
def test_vector_norm_of_a_strided_tensor(rank, device_mesh_factory, ord) -> None:  # type: ignore[no-untyped-def]
    """``vector_norm`` over the cut dim is a partial, over another keeps the cut; gradients as plain."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(2)
    x = torch.randn(5, 4, dtype=torch.float64)
    ref = x.clone().requires_grad_()
    want_all, want_rows = torch.linalg.vector_norm(ref, ord), torch.linalg.vector_norm(ref, ord, dim=1)
    (want_all + want_rows.sum()).backward()
    dx = distribute_tensor(x, mesh, [StridedShard(0, 2)]).requires_grad_()
    with record_collectives() as log, fallback_policy("error"):
        whole = torch.linalg.vector_norm(dx, ord)
        rows = torch.linalg.vector_norm(dx, ord, dim=1)
    assert log.count() == 0, log.counts()
    assert whole.placements == (Partial("norm", ord),) and rows.placements == (StridedShard(0, 2),)
    torch.testing.assert_close(whole.full_tensor(), want_all.detach())
    torch.testing.assert_close(rows.full_tensor(), want_rows.detach())
    (whole + rows.sum()).backward()
    assert dx.grad is not None
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad)


def _parameters(mesh, elements, fill):  # type: ignore[no-untyped-def]
    """Plain and DTensor parameters of the same ``fill(shape)`` values, cut as ``elements`` say."""
    init = [fill(shape, dtype=torch.float64) for shape, _ in elements]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    params = [
        torch.nn.Parameter(distribute_tensor(t.clone(), mesh, placements))
        for t, (_, placements) in zip(init, elements, strict=True)
    ]
    return ref, params


def _set_grads(mesh, elements, ref, params) -> None:  # type: ignore[no-untyped-def]
    """The same random gradients on both sets, each DTensor gradient cut like its parameter."""
    grads = [torch.randn(shape, dtype=torch.float64) for shape, _ in elements]
    for r, p, g, (_, placements) in zip(ref, params, grads, elements, strict=True):
        r.grad = g.clone()
        p.grad = distribute_tensor(g.clone(), mesh, placements)


def _check_clip(mesh, elements, ord: float = 2.0, foreach: bool | None = None) -> None:  # type: ignore[no-untyped-def]
    """``clip_grad_norm_``: no fallback, one float64 all-reduce per mesh dim, values and cuts as plain."""
    ref, params = _parameters(mesh, elements, torch.zeros)
    _set_grads(mesh, elements, ref, params)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5, ord, foreach=foreach)
    with record_collectives() as log, fallback_policy("error"):
        got = torch.nn.utils.clip_grad_norm_(params, 0.5, ord, foreach=foreach)
    assert log.counts() == {"all_reduce": mesh.ndim}, (ord, log.counts())
    assert log.nbytes("all_reduce") == 8 * mesh.ndim  # one float64 scalar per mesh dim
    torch.testing.assert_close(got.full_tensor(), want)
    for r, p, (_, placements) in zip(ref, params, elements, strict=True):
        assert p.grad.placements == tuple(placements)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("foreach", [None, False])
def test_clip_grad_norm_over_shard_strided_and_replicated(rank, device_mesh_factory, foreach) -> None:  # type: ignore[no-untyped-def]
    """``clip_grad_norm_`` over every kind of element, foreach and per-tensor norms, four ords."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(4)
    for ord in [2.0, 1.0, 3.0, math.inf]:
        _check_clip(mesh, ELEMENTS, ord, foreach)


@pytest.mark.distributed(world_size=4)
def test_clip_grad_norm_on_a_2d_mesh_with_the_fsdp_tp_layout(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``[StridedShard(0, 2), Shard(0)]`` (FSDP2 over TP) and others: one scalar all-reduce per mesh dim."""
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(8)
    _check_clip(mesh, FSDP_TP_ELEMENTS)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_foreach_optimizer_step_keeps_strided_parameters(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    """A ``foreach=True`` step over strided (FSDP2 + TP too) parameters: nothing sent, values as plain."""
    mesh = device_mesh_factory((2, 2))
    elements = FSDP_TP_ELEMENTS

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if name == "adamw":
            return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, foreach=True)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)

    torch.manual_seed(9)
    ref, params = _parameters(mesh, elements, torch.randn)
    opt, ref_opt = make(params), make(ref)
    for _ in range(2):
        _set_grads(mesh, elements, ref, params)
        ref_opt.step()
        with record_collectives() as log, fallback_policy("error"):
            opt.step()
        assert log.count() == 0, log.counts()
        for r, p, (_, placements) in zip(ref, params, elements, strict=True):
            assert p.placements == tuple(placements)
            torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-12, atol=1e-12)

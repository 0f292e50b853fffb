"""Vector norms as partial values (``Partial("norm", p)``): values, gradients and communication.

Every ord (2, 1, 0, 3.5, -1.5, inf, -inf), whole and along dims, keepdim,
uneven cuts with an empty piece (3 rows over 4 ranks), 1-D and 2-D meshes,
against the same norm of the plain tensor; a norm over a sharded dim must
not communicate, and reading it is one all-reduce of the result per mesh dim.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives

ORDS = [2, 1, 0, 3.5, -1.5, math.inf, -math.inf]
DIFFERENTIABLE = [2, 1, 3.5, -1.5, math.inf, -math.inf]  # ord 0 has no gradient


def _norm_check(x, placements, mesh, ord, dim=None, keepdim=False, expect=None):  # type: ignore[no-untyped-def]
    """The norm of a DTensor against the plain tensor's: value, gradient, and no communication."""
    full = x.clone().requires_grad_(True)
    ref = torch.linalg.vector_norm(full, ord, dim=dim, keepdim=keepdim)
    dt = distribute_tensor(x.clone(), mesh, placements).requires_grad_(True)
    with record_collectives() as log:
        out = torch.linalg.vector_norm(dt, ord, dim=dim, keepdim=keepdim)
    assert log.count() == 0, f"ord {ord} dim {dim} {placements}: {log.counts()}"
    if expect is not None:
        assert out.placements == expect, (ord, dim, out.placements)
    got = out.full_tensor()
    torch.testing.assert_close(got, ref)
    if ord in DIFFERENTIABLE:
        ref.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(dt.grad.full_tensor(), full.grad)
    return out


@pytest.mark.distributed(world_size=4)
def test_vector_norm_every_ord_on_a_1d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(0)
    uneven = torch.randn(3, 5, dtype=torch.float64)  # rows 1, 1, 1, 0: the last rank holds none
    wide = torch.randn(6, 9, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule for every case: no fallback warning
        for ord in ORDS:
            kind = Partial("sum") if ord == 0 else Partial("norm", ord)
            _norm_check(uneven, [Shard(0)], mesh, ord, expect=(kind,))
            _norm_check(wide, [Shard(1)], mesh, ord, expect=(kind,))
            _norm_check(uneven, [Shard(0)], mesh, ord, dim=0, expect=(kind,))
            _norm_check(uneven, [Shard(0)], mesh, ord, dim=(0, 1), keepdim=True, expect=(kind,))
            _norm_check(wide, [Shard(1)], mesh, ord, dim=0, expect=(Shard(0),))  # a kept dim stays cut
            _norm_check(wide, [Shard(1)], mesh, ord, dim=0, keepdim=True, expect=(Shard(1),))
            _norm_check(wide, [Replicate()], mesh, ord, dim=1, expect=(Replicate(),))


@pytest.mark.distributed(world_size=4)
def test_vector_norm_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    x = torch.randn(5, 3, dtype=torch.float64)  # 5 rows over 2, then 3 columns over 2: uneven
    for ord in ORDS:
        kind = Partial("sum") if ord == 0 else Partial("norm", ord)
        _norm_check(x, [Shard(0), Shard(1)], mesh, ord, expect=(kind, kind))
        _norm_check(x, [Shard(0), Shard(0)], mesh, ord, expect=(kind, kind))  # nested: 5 -> 3, 2 -> ...
        _norm_check(x, [Shard(0), Shard(1)], mesh, ord, dim=1, expect=(Shard(0), kind))
        _norm_check(
            x, [Replicate(), Shard(0)], mesh, ord, dim=-1, keepdim=True, expect=(Replicate(), Shard(0))
        )
        # Reading a norm partial on both mesh dims: one all-reduce of the scalar per mesh dim.
        dt = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        norm = torch.linalg.vector_norm(dt, ord)
        with record_collectives() as log:
            norm.full_tensor()
        assert log.count("all_reduce") == 2 and log.count() == 2, log.counts()
        assert log.nbytes("all_reduce") == 2 * 8


@pytest.mark.distributed(world_size=2)
def test_norm_of_partial_norms_stays_partial_and_other_partials_reduce(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(2)
    x = torch.randn(4, 6, dtype=torch.float64)
    for ord in [2, 3.5, -1.5, math.inf, -math.inf]:
        rows = torch.linalg.vector_norm(distribute_tensor(x, mesh, [Shard(1)]), ord, dim=1)
        assert rows.placements == (Partial("norm", ord),)
        with record_collectives() as log:
            total = torch.linalg.vector_norm(rows, ord)
        assert log.count() == 0 and total.placements == (Partial("norm", ord),)
        torch.testing.assert_close(total.full_tensor(), torch.linalg.vector_norm(x, ord))
        # A norm partial of another p, or a sum partial, is reduced first.
        other = torch.linalg.vector_norm(rows, 1)
        assert other.placements == (Replicate(),)
        torch.testing.assert_close(other.full_tensor(), torch.linalg.vector_norm(x, ord, dim=1).norm(1))
    summed = distribute_tensor(x, mesh, [Partial("sum")])
    out = torch.linalg.vector_norm(summed, 2, dim=0)
    assert out.placements == (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), torch.linalg.vector_norm(x, 2, dim=0))
    # A count of non-zeros (ord 0) is a Partial("sum"); its norm needs the counts whole.
    zeros = x.masked_fill(x > 0.5, 0)
    counts = torch.linalg.vector_norm(distribute_tensor(zeros, mesh, [Shard(1)]), 0, dim=1)
    assert counts.placements == (Partial("sum"),)
    torch.testing.assert_close(
        torch.linalg.vector_norm(counts, 0).full_tensor(), torch.linalg.vector_norm(zeros, 0, dim=1).norm(0)
    )


@pytest.mark.distributed(world_size=4)
def test_foreach_norm_every_ord(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(3)
    tensors = [torch.randn(3, 4), torch.randn(9), torch.randn(2, 8), torch.randn(5, 2)]
    placements = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()]]
    for ord in ORDS:
        dts = [distribute_tensor(t, mesh, p) for t, p in zip(tensors, placements, strict=True)]
        with record_collectives() as log:
            norms = torch._foreach_norm(dts, ord)
        assert log.count() == 0, log.counts()
        kind = Partial("sum") if ord == 0 else Partial("norm", ord)
        assert [n.placements for n in norms] == [(kind,), (kind,), (kind,), (Replicate(),)]
        for got, want in zip(norms, torch._foreach_norm(tensors, ord), strict=True):
            torch.testing.assert_close(got.full_tensor(), want)


@pytest.mark.distributed(world_size=4)
def test_clip_grad_norm_reduces_one_scalar_per_mesh_dim(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(4)
    shapes = [(3, 4), (5,), (4, 6), (2, 3)]
    placements = [
        [Shard(0), Shard(1)],
        [Shard(0), Replicate()],
        [Shard(1), Shard(0)],
        [Replicate(), Replicate()],
    ]
    for ord in [2.0, 1.0, 3.0, math.inf]:
        for foreach in (True, False):
            grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
            ref = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
            params = [
                torch.nn.Parameter(distribute_tensor(torch.zeros(s, dtype=torch.float64), mesh, p))
                for s, p in zip(shapes, placements, strict=True)
            ]
            for r, p, g, pl in zip(ref, params, grads, placements, strict=True):
                r.grad = g.clone()
                p.grad = distribute_tensor(g.clone(), mesh, pl)
            want = torch.nn.utils.clip_grad_norm_(ref, 0.5, ord, foreach=foreach)
            with record_collectives() as log:
                got = torch.nn.utils.clip_grad_norm_(params, 0.5, ord, foreach=foreach)
            assert log.counts() == {"all_reduce": 2}, (ord, foreach, log.counts())
            assert log.nbytes("all_reduce") == 2 * 8  # one float64 scalar per mesh dim
            torch.testing.assert_close(got.full_tensor(), want)
            for r, p in zip(ref, params, strict=True):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad)
            # get_total_norm alone communicates nothing: the norm is read later.
            with record_collectives() as log:
                total = torch.nn.utils.get_total_norm([p.grad for p in params], ord, foreach=foreach)
            assert log.count() == 0
            torch.testing.assert_close(
                total.full_tensor(), torch.nn.utils.get_total_norm([r.grad for r in ref], ord)
            )


@pytest.mark.distributed(world_size=2)
def test_norm_overloads_and_matrix_norms(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(5)
    x = torch.randn(5, 4, dtype=torch.float64)
    dt = distribute_tensor(x, mesh, [Shard(0)])
    cases = [
        (lambda t: t.norm(), (Partial("norm", 2),)),
        (lambda t: t.norm(1, dim=0), (Partial("norm", 1),)),
        (lambda t: t.norm(3, dim=1, keepdim=True), (Shard(0),)),
        (lambda t: torch.norm(t, p="fro"), (Partial("norm", 2),)),
        (lambda t: torch.linalg.matrix_norm(t, "fro"), (Partial("norm", 2),)),
        (lambda t: torch.linalg.norm(t), (Partial("norm", 2),)),
        (lambda t: torch.linalg.matrix_norm(t, 1), None),
        (lambda t: torch.linalg.matrix_norm(t, math.inf), None),
    ]
    for fn, expect in cases:
        out = fn(dt)
        assert isinstance(out, DTensor)
        if expect is not None:
            assert out.placements == expect, out.placements
        torch.testing.assert_close(out.full_tensor(), fn(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nuclear norm needs singular values: it gathers
        torch.testing.assert_close(
            torch.linalg.matrix_norm(dt, "nuc").full_tensor(), torch.linalg.matrix_norm(x, "nuc")
        )


@pytest.mark.distributed(world_size=4)
def test_norm_partial_redistributes(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(6)
    x = torch.rand(7, dtype=torch.float64) + 0.1  # norms are never negative
    for ord in [2.0, 3.0, -1.5, math.inf, -math.inf]:
        partial = distribute_tensor(x, mesh, [Partial("norm", ord)])  # R -> P without communication
        torch.testing.assert_close(partial.full_tensor(), x)
        sharded = partial.redistribute(mesh, [Shard(0)])  # one reduce-scatter
        torch.testing.assert_close(sharded.full_tensor(), x)
        terms = torch.rand(7, dtype=torch.float64)
        local = DTensor.from_local(terms * (rank + 1), mesh, [Partial("norm", ord)])
        stacked = torch.stack([terms * (r + 1) for r in range(4)])
        torch.testing.assert_close(local.full_tensor(), torch.linalg.vector_norm(stacked, ord, dim=0))


def test_norm_partial_placement_bad_input() -> None:
    assert Partial("norm") == Partial("norm", 2) == Partial("norm", 2.0)
    assert repr(Partial("norm", math.inf)) == "Partial('norm', float('inf'))"
    assert eval(repr(Partial("norm", -math.inf)), {"Partial": Partial}) == Partial("norm", -math.inf)
    with pytest.raises(ValueError, match=r"norm_type=0.*Partial\('sum'\)"):
        Partial("norm", 0)
    with pytest.raises(ValueError, match=r"only a 'norm' partial has a norm_type"):
        Partial("sum", 2)
    with pytest.raises(ValueError, match=r"norm_type='x'"):
        Partial("norm", "x")  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=2)
def test_undefined_norm_of_an_empty_tensor_raises(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    dt = distribute_tensor(torch.empty(0, 3), mesh, [Shard(1)])
    with pytest.raises(RuntimeError, match=r"the inf norm of a tensor of global shape \(0, 3\)"):
        torch.linalg.vector_norm(dt, math.inf)
    torch.testing.assert_close(torch.linalg.vector_norm(dt, 2).full_tensor(), torch.tensor(0.0))

"""Reductions, scans, batch norm and FFTs: values and gradients against full tensors, and communication.

Each op runs on DTensors cut every way (even and uneven sizes, a shard of
each dim, replicated, partial where the rule keeps partials) and on full
tensors: the values and the input gradients must match, the forward must
take a rule (no replicated-fallback warning), and its collectives are
counted with ``record_collectives`` and compared with torch's DTensor under
``CommDebugMode`` on the same mesh: hp may not communicate where torch does
not (the exceptions are named where they are checked). The backward may
still pass through ops of other families that fall back; only its values
are checked here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed.tensor as tdt
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives
from torch.distributed.tensor.debug import CommDebugMode

R, P = Replicate(), Partial("sum")


def _leaf(value: torch.Tensor, mesh, placements: Sequence[Placement]) -> DTensor:  # type: ignore[no-untyped-def]
    """A DTensor of ``value``; a ``Partial("sum")`` holds uneven shares of it."""
    whole = [R if isinstance(p, Partial) else p for p in placements]
    dt = distribute_tensor(value.clone(), mesh, whole)
    if whole != list(placements):
        local = dt.to_local().clone()
        for m, p in enumerate(placements):
            if isinstance(p, Partial):
                n, r = mesh.size(m), mesh.get_local_rank(m)
                local = local * (2.0 * (r + 1) / (n * (n + 1)))
        dt = DTensor.from_local(local, mesh, list(placements), shape=tuple(value.shape))
    return dt.requires_grad_(value.is_floating_point() or value.is_complex())


def _flat(out) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _weighted(o: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (torch.view_as_real(o.resolve_conj()) if o.is_complex() else o) * weights


def _torch_count(fn: Callable[..., object], inputs, placements, mesh) -> int | None:  # type: ignore[no-untyped-def]
    """Collectives torch's DTensor issues for the same call (None when it cannot run it)."""
    if any(isinstance(p, Partial) for ps in placements for p in ps):
        return None
    tmesh = mesh.to_torch()
    args = [
        tdt.distribute_tensor(
            t.clone(), tmesh, [tdt.Shard(p.dim) if isinstance(p, Shard) else tdt.Replicate() for p in ps]
        )
        for t, ps in zip(inputs, placements, strict=True)
    ]
    try:
        with warnings.catch_warnings(), CommDebugMode() as comm:
            warnings.simplefilter("ignore")
            fn(*args)
    except Exception:
        return None
    return int(comm.get_total_counts())


def check(
    fn: Callable[..., object],
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Sequence[Placement]],
    mesh,  # type: ignore[no-untyped-def]
    *,
    collectives: dict[str, int] | None = None,
    torch_at_least: bool = True,
    grad: bool = True,
    tag: str = "",
) -> list[DTensor]:
    """``fn`` on DTensors against ``fn`` on full tensors: values, gradients and forward collectives."""
    full = [t.clone().requires_grad_(grad and (t.is_floating_point() or t.is_complex())) for t in inputs]
    ref = _flat(fn(*full))
    dts = [
        _leaf(t, mesh, p) if grad else _leaf(t, mesh, p).detach()
        for t, p in zip(inputs, placements, strict=True)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forward takes a rule, never the replicated fallback
        with record_collectives() as log:
            out = _flat(fn(*dts))
    counts = dict(log.counts())
    if collectives is not None:
        assert counts == collectives, f"{tag}: the forward issued {counts}, expected {collectives}"
    if torch_at_least:
        # hp communicates only where torch's DTensor does, and then sends no more than the
        # inputs themselves (what torch's gather of the cut dims costs).
        theirs = _torch_count(fn, inputs, placements, mesh)
        if theirs == 0:
            assert counts == {}, f"{tag}: hp issued {counts}, torch's DTensor nothing"
        # (x2: a real input of an FFT is made complex before the transform gathers it)
        budget = 2 * sum(t.numel() * t.element_size() for t in inputs)
        assert log.nbytes() <= budget, f"{tag}: hp sent {log.nbytes()} bytes, more than its inputs ({budget})"
    got = []
    for o, r in zip(out, ref, strict=True):
        assert isinstance(o, DTensor), f"{tag}: {type(o)}"
        g = o.full_tensor()
        torch.testing.assert_close(g, r, equal_nan=True, msg=lambda m: f"{tag}: {m}")
        got.append(g)
    if not grad or not any(r.requires_grad for r in ref):
        return out
    pairs = [(o, r) for o, r in zip(got, ref, strict=True) if r.requires_grad]
    weights = [
        torch.linspace(0.5, 1.5, _weighted(r, 1).numel(), dtype=_weighted(r, 1).dtype).view(
            _weighted(r, 1).shape
        )
        for _, r in pairs
    ]
    sum((_weighted(r, w)).sum() for (_, r), w in zip(pairs, weights, strict=True)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # other families' backward ops (flip, slice_backward) may fall back
        sum((_weighted(o, w)).sum() for (o, _), w in zip(pairs, weights, strict=True)).backward()
    for d, f in zip(dts, full, strict=True):
        if f.grad is not None:
            assert d.grad is not None, f"{tag}: no gradient"
            torch.testing.assert_close(d.grad.full_tensor(), f.grad, msg=lambda m: f"{tag} (gradient): {m}")
    return out


def _cuts(ndim: int) -> list[list[Placement]]:
    return [[Shard(d)] for d in range(ndim)] + [[R]]


# -- scans --------------------------------------------------------------------------------------

SCANS = {
    "cumsum": lambda t, d: t.cumsum(d),
    "cumprod": lambda t, d: t.cumprod(d),
    "logcumsumexp": lambda t, d: t.logcumsumexp(d),
    "cummax": lambda t, d: t.cummax(d),
    "cummin": lambda t, d: t.cummin(d),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(SCANS))
def test_scans_local_off_the_scan_dim_and_one_small_gather_on_it(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.rand(5, 4, 3, dtype=torch.float64) + 0.5  # 5 rows over 2 ranks: uneven
    for dim in range(3):
        for cut in _cuts(3):
            sharded = cut[0] == Shard(dim)
            expect: dict[str, int] = {"all_gather_into_tensor": 1} if sharded else {}
            out = check(
                lambda t, d=dim: SCANS[name](t, d),
                [x],
                [cut],
                mesh,
                collectives=expect,
                tag=f"{name} dim {dim} {cut}",
            )
            if sharded and name in ("cumsum", "cumprod", "logcumsumexp") and x.shape[dim] >= 4:
                assert out[0].placements == (Shard(dim),), "a sharded scan dim keeps its shard"
    if name == "cumsum":  # a running sum of partial terms is a partial of running sums
        out = check(lambda t: t.cumsum(1), [x], [[P]], mesh, collectives={}, tag="cumsum partial")
        assert out[0].placements == (P,)


@pytest.mark.distributed(world_size=2)
def test_sharded_scan_sends_one_slice_per_rank(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = distribute_tensor(torch.randn(64, 32, dtype=torch.float64), mesh, [Shard(0)])
    with record_collectives() as log:
        x.cumsum(0)
    assert log.count("all_gather_into_tensor") == 1
    # Each rank sends its last row (32 values), not its 32 x 32 piece.
    assert log.nbytes("all_gather_into_tensor") <= 2 * 32 * 8


@pytest.mark.distributed(world_size=4)
def test_scans_on_four_ranks_with_empty_pieces_and_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    x = torch.rand(3, 5, dtype=torch.float64) + 0.5  # 3 rows over 4 ranks: one rank holds none
    line = device_mesh_factory((4,))
    for name in SCANS:
        check(lambda t, n=name: SCANS[n](t, 0), [x], [[Shard(0)]], line, tag=f"{name} 4 ranks")
    grid = device_mesh_factory((2, 2), ("a", "b"))
    for name in SCANS:
        for cut in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)]):
            check(lambda t, n=name: SCANS[n](t, 1), [x], [cut], grid, tag=f"{name} 2x2 {cut}")


# -- reductions ---------------------------------------------------------------------------------

REDUCTIONS = {
    "logsumexp": lambda t: t.logsumexp(1),
    "logsumexp all keepdim": lambda t: t.logsumexp((0, 1, 2), keepdim=True),
    "var": lambda t: t.var(),
    "var dim correction 0": lambda t: t.var(0, correction=0),
    "std dims keepdim": lambda t: t.std((0, 2), keepdim=True),
    "var_mean": lambda t: torch.var_mean(t, 1),
    "std_mean correction 2": lambda t: torch.std_mean(t, (0, 1), correction=2),
    "prod": lambda t: t.prod(),
    "prod dim": lambda t: t.prod(1, keepdim=True),
    "aminmax": lambda t: torch.aminmax(t),
    "aminmax dim": lambda t: torch.aminmax(t, dim=0),
    "mode": lambda t: torch.mode(t.round(), 2),
    "max dim": lambda t: t.max(1),
    "min dim": lambda t: t.min(0, keepdim=True),
}

_NOT_AT_TORCH: set[str] = set()  # hp communicates no more than torch's DTensor on any of them


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_match_and_communicate_no_more_than_torch(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 4, 3, dtype=torch.float64) * 2
    for cut in _cuts(3):
        check(
            REDUCTIONS[name], [x], [cut], mesh, torch_at_least=name not in _NOT_AT_TORCH, tag=f"{name} {cut}"
        )


@pytest.mark.distributed(world_size=2)
def test_reductions_off_the_reduced_dims_are_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.randn(5, 4, dtype=torch.float64)
    for fn in (
        lambda t: t.logsumexp(1),
        lambda t: t.var(1),
        lambda t: torch.std_mean(t, 1),
        lambda t: t.prod(1),
        lambda t: torch.aminmax(t, dim=1),
        lambda t: torch.mode(t, 1),
    ):
        outs = check(fn, [x], [[Shard(0)]], mesh, collectives={})
        assert all(o.placements == (Shard(0),) for o in outs)
    # Over the sharded dim: a partial with no communication at all.
    low, high = check(lambda t: torch.aminmax(t), [x], [[Shard(1)]], mesh, collectives={})
    assert (low.placements, high.placements) == ((Partial("min"),), (Partial("max"),))


@pytest.mark.distributed(world_size=2)
def test_prod_over_a_sharded_dim_is_a_product_partial(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """No communication until the value is read; exact with zeros and negatives; to torch and back."""
    from hp_dtensor import from_torch_dtensor, to_torch_dtensor

    mesh = device_mesh_factory((2,))
    x = torch.tensor([[2.0, -1.0, 3.0], [0.5, -4.0, 0.0], [-1.5, 2.0, 1.0]], dtype=torch.float64)
    for fn, cut in ((lambda t: t.prod(0), [Shard(0)]), (lambda t: t.prod(), [Shard(1)])):
        dx = distribute_tensor(x, mesh, cut)
        with record_collectives() as log:
            out = fn(dx)
        assert len(log) == 0 and out.placements == (Partial("product"),)
        back = from_torch_dtensor(to_torch_dtensor(out))
        assert back.placements == (Partial("product"),)
        torch.testing.assert_close(out.full_tensor(), fn(x))
        torch.testing.assert_close(back.full_tensor(), fn(x))
    # a replicated value as product terms (rank 0 keeps it, the others hold ones)
    terms = distribute_tensor(x, mesh, [R]).redistribute(mesh, [Partial("product")])
    torch.testing.assert_close(terms.full_tensor(), x)


@pytest.mark.distributed(world_size=2)
def test_var_and_logsumexp_over_a_sharded_dim_move_only_the_output(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = distribute_tensor(torch.randn(64, 32, dtype=torch.float64), mesh, [Shard(0)])
    for fn in (lambda t: t.var(0), lambda t: t.logsumexp(0)):
        with record_collectives() as log:
            out = fn(x)
        assert log.count("all_reduce") == 2 and log.nbytes("all_reduce") <= 2 * 32 * 8
        assert out.placements == (R,)


@pytest.mark.distributed(world_size=4)
def test_moments_on_a_2d_mesh_and_uneven_pieces(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    grid = device_mesh_factory((2, 2), ("a", "b"))
    line = device_mesh_factory((4,))
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2, dtype=torch.float64)  # 3 rows over 4 ranks: one empty piece
    for fn in (
        lambda t: t.var(0),
        lambda t: torch.std_mean(t, (0, 1)),
        lambda t: t.logsumexp((0, 1)),
        lambda t: t.prod(0),
    ):
        check(fn, [x], [[Shard(0)]], line, torch_at_least=False)
        check(fn, [x], [[Shard(0), Shard(1)]], grid, torch_at_least=False)
        check(fn, [x], [[Shard(1), Shard(0)]], grid, torch_at_least=False)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("p", [2.0, 3.0, 1.0, 0.0, math.inf, -math.inf])
def test_dist_is_a_norm_partial(rank, device_mesh_factory, p) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    for cut in _cuts(2):
        for other in (cut, [R]):
            out = check(
                lambda a, b: torch.dist(a, b, p),
                [x, y],
                [cut, other],
                mesh,
                collectives={},
                grad=p != 0,
                tag=f"dist {p} {cut} {other}",
            )
            if cut != [R]:
                assert out[0].placements[0].is_partial()


# -- softmax backward ---------------------------------------------------------------------------


@pytest.mark.distributed(world_size=2)
def test_softmax_backward_cuts_the_replicated_operand_instead_of_gathering(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    grad, out = torch.randn(5, 5, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64).softmax(0)
    fn = torch.ops.aten._softmax_backward_data.default
    for pair in ([[Shard(1)], [R]], [[R], [Shard(1)]]):
        got = check(
            lambda g, o: fn(g, o, 0, torch.float64), [grad, out], pair, mesh, collectives={}, grad=False
        )
        assert got[0].placements == (Shard(1),)


# -- batch norm ---------------------------------------------------------------------------------


def _batch_norm_case(mesh, cut: list[Placement], training: bool, stats_cut: bool) -> dict[str, int]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    w, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    full = [t.clone().requires_grad_() for t in (x, w, b)]
    ref_rm, ref_rv = rm.clone(), rv.clone()
    ref = F.batch_norm(full[0], ref_rm, ref_rv, full[1], full[2], training=training, momentum=0.3, eps=1e-5)
    weights = torch.linspace(0.5, 1.5, ref.numel(), dtype=ref.dtype).view(ref.shape)
    (ref * weights).sum().backward()
    stat_place = [Shard(0)] if stats_cut else [R] * mesh.ndim
    dts = [distribute_tensor(x.clone(), mesh, cut)] + [
        distribute_tensor(t.clone(), mesh, [R] * mesh.ndim) for t in (w, b)
    ]
    for d in dts:
        d.requires_grad_()
    d_rm, d_rv = (distribute_tensor(t.clone(), mesh, stat_place) for t in (rm, rv))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with record_collectives() as log:
            out = F.batch_norm(dts[0], d_rm, d_rv, dts[1], dts[2], training=training, momentum=0.3, eps=1e-5)
        torch.testing.assert_close(out.full_tensor(), ref)
        (out * distribute_tensor(weights, mesh, out.placements)).sum().backward()
    for d, f in zip(dts, full, strict=True):
        torch.testing.assert_close(d.grad.full_tensor(), f.grad)
    torch.testing.assert_close(d_rm.full_tensor(), ref_rm)
    torch.testing.assert_close(d_rv.full_tensor(), ref_rv)
    return dict(log.counts())


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_every_cut_with_running_stats(rank, device_mesh_factory, training) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    for cut in ([Shard(0)], [Shard(1)], [Shard(2)], [R]):
        counts = _batch_norm_case(mesh, cut, training, stats_cut=False)
        if not training or cut == [R]:
            assert counts == {}, f"{cut}: {counts}"
        elif cut == [Shard(1)]:
            # the updated running statistics of each rank's channels reach every rank
            assert counts == {"all_gather_into_tensor": 1}, counts
        else:
            assert counts == {"all_gather_into_tensor": 1}, f"{cut}: {counts}"
    # running statistics cut like the channels: no communication at all
    assert _batch_norm_case(mesh, [Shard(1)], training, stats_cut=True) == {}


@pytest.mark.distributed(world_size=4)
def test_batch_norm_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    grid = device_mesh_factory((2, 2), ("a", "b"))
    for training in (True, False):
        _batch_norm_case(grid, [Shard(0), Shard(2)], training, stats_cut=False)


@pytest.mark.distributed(world_size=2)
def test_batch_norm_aten_forms_called_directly(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``native_batch_norm`` and ``_native_batch_norm_legit``: every output as on one process.

    In evaluation they return empty saved statistics (CPU), which the meta
    kernels describe as ``(C,)``; the DTensor outputs match the former.
    """
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    w, b = torch.randn(2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    aten = torch.ops.aten
    for func in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default):
        for training in (True, False):
            for cut in _cuts(3):
                rm, rv = torch.randn(2, dtype=torch.float64), torch.rand(2, dtype=torch.float64) + 0.5
                ref_rm, ref_rv = rm.clone(), rv.clone()
                ref = func(x, w, b, ref_rm, ref_rv, training, 0.3, 1e-5)
                args = [distribute_tensor(x, mesh, cut)] + [
                    distribute_tensor(t, mesh, [R]) for t in (w, b, rm, rv)
                ]
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    with record_collectives() as log:
                        out = func(*args, training, 0.3, 1e-5)
                for o, r in zip(out, ref, strict=True):
                    assert o.shape == r.shape
                    torch.testing.assert_close(o.full_tensor(), r)
                torch.testing.assert_close(args[3].full_tensor(), ref_rm)
                torch.testing.assert_close(args[4].full_tensor(), ref_rv)
                if not training:
                    assert len(log) == 0, f"{func} evaluation {cut}: {dict(log.counts())}"


# -- FFTs ---------------------------------------------------------------------------------------

FFTS = {
    "fft": lambda t: torch.fft.fft(t, dim=1),
    "rfft": lambda t: torch.fft.rfft(t, dim=2),
    "irfft": lambda t: torch.fft.irfft(t, dim=1),
    "ifft2": lambda t: torch.fft.ifft2(t, dim=(1, 2)),
    "rfftn": lambda t: torch.fft.rfftn(t, dim=(1, 2)),
    "ihfft": lambda t: torch.fft.ihfft(t, dim=2),
    "hfft": lambda t: torch.fft.hfft(t, dim=1),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(FFTS))
def test_ffts_local_on_batch_dims_gather_transformed_dims(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    out = check(FFTS[name], [x], [[Shard(0)]], mesh, collectives={}, tag=f"{name} batch cut")
    assert out[0].placements == (Shard(0),)
    check(FFTS[name], [x], [[Shard(1)]], mesh, tag=f"{name} transformed cut")
    check(FFTS[name], [x], [[P]], mesh, collectives={}, torch_at_least=False, tag=f"{name} partial")


# -- sparse -------------------------------------------------------------------------------------


@pytest.mark.distributed(world_size=2)
def test_sparse_results_raise_on_every_rank(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    for cut in _cuts(2):
        x = distribute_tensor(torch.randn(4, 3), mesh, cut)
        for convert in (lambda t: t.to_sparse(), lambda t: t.to_sparse_csr()):
            with pytest.raises(NotImplementedError, match="sparse layouts are not supported by hp_dtensor"):
                convert(x)


@pytest.mark.distributed(world_size=2)
def test_any_and_all_are_boolean_partials(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """No gather: the pieces' answers reduce by max (any) and min (all); empty pieces and partials right."""
    mesh = device_mesh_factory((2,))
    x = torch.tensor([[0.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    fns = {
        "any": lambda t: t.any(),
        "all": lambda t: (t == 0).all(),
        "any dim": lambda t: t.any(0),
        "all dims keepdim": lambda t: (t == 0).all(dim=(0, 1), keepdim=True),
    }
    for name, fn in fns.items():
        for cut in ([Shard(0)], [Shard(1)], [R]):
            dx = distribute_tensor(x, mesh, cut)
            with record_collectives() as log:
                out = fn(dx)
            assert len(log) == 0, f"{name} {cut}: {list(log)}"
            torch.testing.assert_close(out.full_tensor(), fn(x), msg=f"{name} {cut}")
    one_row = distribute_tensor(torch.zeros(1, 3), mesh, [Shard(0)])  # rank 1 holds an empty piece
    assert one_row.any().full_tensor().item() is False and one_row.eq(0).all().full_tensor().item() is True
    # a partial sum whose terms are nonzero but whose value is zero: reduced before the test
    terms = torch.tensor([1.0, -2.0]) if rank == 0 else torch.tensor([-1.0, 2.0])
    partial = DTensor.from_local(terms, mesh, [Partial("sum")])
    assert partial.any().full_tensor().item() is False

"""``F.instance_norm`` on batch, channel and spatial cuts, with or without affine parameters and stats.

torch decomposes it into a ``(1, N*C, *)`` view and batch norm; a channel
cut becomes ``StridedShard(1, N)`` there and stays local ([Note: strided
channels] in ``ops/batch_norm.py``), a spatial cut shares per-channel moments
in one small all-gather. Output, input / weight / bias gradients and the
running statistics against one process in float64, under the ``"error"``
fallback policy, with every collective counted: the input is never gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Placement, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

S0, S1, S2, S3, S4, R = Shard(0), Shard(1), Shard(2), Shard(3), Shard(4), Replicate()
# (use_input_stats, running stats): batch statistics alone, batch statistics updating running ones, evaluation
MODES = [(True, False), (True, True), (False, True)]


def _compare(  # type: ignore[no-untyped-def]
    x: torch.Tensor, mesh, cut: Sequence[Placement], *, use_input_stats: bool, stats: bool, affine: bool
) -> tuple[list[str], list[str], tuple[Placement, ...]]:
    """Run both ways and compare; the forward's and the backward's collectives and the output placements."""
    channels = x.shape[1]
    whole = [R] * mesh.ndim
    params = [torch.randn(channels, dtype=x.dtype) for _ in range(2)] if affine else [None, None]
    rm, rv = torch.randn(channels, dtype=x.dtype), torch.rand(channels, dtype=x.dtype) + 0.5
    plain = [t.clone().requires_grad_() if t is not None else None for t in (x, *params)]
    plain_stats = [rm.clone(), rv.clone()] if stats else [None, None]
    options = {"use_input_stats": use_input_stats, "momentum": 0.3, "eps": 0.1}
    ref = F.instance_norm(plain[0], *plain_stats, plain[1], plain[2], **options)
    scale = torch.rand(ref.shape, dtype=x.dtype)
    (ref * scale).sum().backward()
    placed = [distribute_tensor(x, mesh, list(cut)).requires_grad_()]
    placed += [distribute_tensor(t, mesh, whole).requires_grad_() if t is not None else None for t in params]
    placed_stats = [distribute_tensor(t.clone(), mesh, whole) for t in (rm, rv)] if stats else [None, None]
    tag = f"{tuple(x.shape)} {list(cut)} use_input_stats={use_input_stats} stats={stats} affine={affine}"
    with fallback_policy("error"):
        with record_collectives() as forward:
            out = F.instance_norm(placed[0], *placed_stats, placed[1], placed[2], **options)
        torch.testing.assert_close(out.full_tensor(), ref, msg=lambda m: f"{tag}: {m}")
        weighted = (out * distribute_tensor(scale, mesh, out.placements)).sum()
        with record_collectives() as backward:
            weighted.backward()
    for name, got, want in zip(("input", "weight", "bias"), placed, plain, strict=True):
        if want is not None:
            assert got is not None and got.grad is not None, f"{tag}: no {name} gradient"
            message = lambda m, n=name: f"{tag} ({n}): {m}"  # noqa: E731
            torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=message)
    for got, want in zip(placed_stats, plain_stats, strict=True):
        if got is not None:
            torch.testing.assert_close(got.full_tensor(), want, msg=lambda m: f"{tag} (running stats): {m}")
    return [r.name for r in forward], [r.name for r in backward], out.placements


def _sweep(  # type: ignore[no-untyped-def]
    mesh, shapes, cut, expect_forward, expect_backward, placements, affines=(True, False)
) -> None:
    """Every mode and affine choice of each shape: collectives by mode, placements kept."""
    for shape in shapes:
        for use_input_stats, stats in MODES:
            for affine in affines:
                x = torch.randn(*shape, dtype=torch.float64)
                modes = {"use_input_stats": use_input_stats, "stats": stats, "affine": affine}
                fwd, bwd, out = _compare(x, mesh, cut, **modes)
                tag = f"{shape} {cut} use_input_stats={use_input_stats} stats={stats} affine={affine}"
                assert fwd == expect_forward(use_input_stats, stats), f"{tag}: forward {fwd}"
                assert bwd == expect_backward(use_input_stats), f"{tag}: backward {bwd}"
                assert out == tuple(placements), f"{tag}: output {out}"


GATHER, REDUCE = "all_gather_into_tensor", "all_reduce"


def _stats_sync(use_input_stats: bool, stats: bool) -> list[str]:
    """Training with replicated running stats over a cut of ``N*C``: rows shared in one small all-gather."""
    return [GATHER] if use_input_stats and stats else []


def _moments(use_input_stats: bool, stats: bool) -> list[str]:
    """Batch statistics over a spatial cut: the pieces' moments, one small all-gather."""
    return [GATHER] if use_input_stats else []


def _local_backward(use_input_stats: bool) -> list[str]:
    return []


def _spatial_backward(use_input_stats: bool) -> list[str]:
    return [REDUCE] if use_input_stats else []


SHAPES = [(4, 6, 5), (3, 5, 7), (2, 3, 4, 5), (2, 3, 2, 3, 4)]  # even, uneven channels, 2-d, 3-d


@pytest.mark.distributed(world_size=2)
def test_instance_norm_channel_cut_is_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    _sweep(mesh, SHAPES, [S1], _stats_sync, _local_backward, [S1], affines=(True,))
    _sweep(mesh, SHAPES[:1], [S1], _stats_sync, _local_backward, [S1], affines=(False,))


@pytest.mark.distributed(world_size=2)
def test_instance_norm_spatial_cut_shares_moments(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    _sweep(mesh, SHAPES, [S2], _moments, _spatial_backward, [S2], affines=(True,))
    _sweep(mesh, SHAPES[:1], [S2], _moments, _spatial_backward, [S2], affines=(False,))
    _sweep(mesh, [(2, 3, 4, 5)], [S3], _moments, _spatial_backward, [S3], affines=(True,))
    _sweep(mesh, [(2, 3, 2, 3, 4)], [S4], _moments, _spatial_backward, [S4], affines=(False,))


@pytest.mark.distributed(world_size=2)
def test_instance_norm_batch_cut_is_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    _sweep(mesh, [(4, 6, 5), (2, 3, 4, 5)], [S0], _stats_sync, _local_backward, [S0])


@pytest.mark.distributed(world_size=4)
def test_instance_norm_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    # a channel or batch cut with a spatial one: the moments over the spatial mesh dim, and
    # (training with running stats) the stats' rows over the other
    both = lambda uis, stats: _moments(uis, stats) + _stats_sync(uis, stats)  # noqa: E731
    for cut in ([S1, S2], [S2, S1], [S0, S2]):
        _sweep(mesh, [(4, 6, 5)], cut, both, _spatial_backward, cut, affines=(True,))

"""Batch norm in training with the batch or a spatial dim cut: one small all-gather of statistics.

Each rank sends its pieces' per-channel count, mean and sum of squared
deviations (``3 C`` float64 numbers) and combines them ([Note: one exchange
for the batch statistics] in ``ops/batch_norm.py``): one collective in the
forward where the two-pass form took two, and torch's DTensor one gather of
the whole input. Checked against one process: the output, the gradients of
the input, weight and bias, and the running statistics, on uneven cuts,
pieces with no rows, large offsets (where ``E[x^2] - E[x]^2`` would cancel)
and a 2-D mesh.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Placement, Replicate, Shard, distribute_tensor, fallback_stats
from hp_testing import record_collectives

R = Replicate()


def _train_step(x: torch.Tensor, mesh, cut: Sequence[Placement]):  # type: ignore[no-untyped-def]
    """Forward and backward of a training batch norm on ``x`` cut by ``cut``; the forward's log."""
    channels = x.shape[1]
    torch.manual_seed(1)
    w, b = torch.randn(channels, dtype=x.dtype), torch.randn(channels, dtype=x.dtype)
    rm, rv = torch.randn(channels, dtype=x.dtype), torch.rand(channels, dtype=x.dtype) + 0.5
    whole = [R] * mesh.ndim
    leaves = [distribute_tensor(x, mesh, list(cut))] + [distribute_tensor(t, mesh, whole) for t in (w, b)]
    plain = [t.clone().requires_grad_() for t in (x, w, b)]
    for leaf in leaves:
        leaf.requires_grad_()
    stats = [distribute_tensor(t.clone(), mesh, whole) for t in (rm, rv)]
    plain_stats = [rm.clone(), rv.clone()]
    ref = F.batch_norm(plain[0], *plain_stats, plain[1], plain[2], training=True, momentum=0.2, eps=1e-5)
    scale = torch.rand(ref.shape, generator=torch.Generator().manual_seed(2), dtype=x.dtype)
    (ref * scale).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule, never the replicated fallback
        with record_collectives() as log:
            out = F.batch_norm(leaves[0], *stats, leaves[1], leaves[2], training=True, momentum=0.2, eps=1e-5)
    torch.testing.assert_close(out.full_tensor(), ref)
    (out * distribute_tensor(scale, mesh, out.placements)).sum().backward()
    for leaf, p in zip(leaves, plain, strict=True):
        torch.testing.assert_close(leaf.grad.full_tensor(), p.grad)
    for got, want in zip(stats, plain_stats, strict=True):
        torch.testing.assert_close(got.full_tensor(), want)
    return log


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batch_cut_training_forward_is_one_small_gather(rank, device_mesh_factory, dtype) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    before = fallback_stats()
    for shape in ((5, 3, 4), (4, 3, 7), (1, 3, 5)):  # uneven, even, and a rank with no rows
        x = torch.randn(*shape, dtype=dtype)
        for cut in ([Shard(0)], [Shard(2)]):
            log = _train_step(x, mesh, cut)
            assert dict(log.counts()) == {"all_gather_into_tensor": 1}, f"{shape} {cut}: {dict(log.counts())}"
            # each rank sends 3 numbers per channel, in float64: a rank receives 3 C x 8 bytes
            assert log.nbytes() <= 2 * 3 * shape[1] * 8, f"{shape} {cut}: {log.nbytes()} bytes"
    assert fallback_stats() == before


@pytest.mark.distributed(world_size=2)
def test_batch_statistics_hold_far_from_zero(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A large mean and a small spread: the combined variance has no cancellation."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = 1e4 + 1e-2 * torch.randn(7, 2, 3, dtype=torch.float64)  # E[x^2] - E[x]^2 loses 4 digits here
    _train_step(x, mesh, [Shard(0)])


@pytest.mark.distributed(world_size=4)
def test_batch_cut_over_two_mesh_dims(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    grid = device_mesh_factory((2, 2), ("a", "b"))
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, dtype=torch.float64)  # 3 rows over 2, 5 columns over 2: uneven
    for cut, gathers in (([Shard(0), Shard(2)], 2), ([Shard(0), Shard(0)], 2), ([Shard(0), Shard(1)], 1)):
        log = _train_step(x, grid, cut)
        assert log.count("all_gather_into_tensor") >= gathers, f"{cut}: {dict(log.counts())}"
        assert log.count("all_reduce") == 0, f"{cut}: {dict(log.counts())}"


@pytest.mark.distributed(world_size=2)
def test_a_channel_cut_with_an_empty_piece(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """One channel over 2 ranks: rank 1 holds none, and still joins the running statistics' exchange.

    (torch's kernels refuse an empty input; rank 1 used to raise while rank 0
    waited in the all-gather.)
    """
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for shape in ((3, 1), (4, 1, 3)):
        log = _train_step(torch.randn(*shape, dtype=torch.float64), mesh, [Shard(1)])
        assert dict(log.counts()) == {"all_gather_into_tensor": 1}, f"{shape}: {dict(log.counts())}"
    x = torch.randn(4, 1, 3, dtype=torch.float64)
    rm, rv = torch.randn(1, dtype=torch.float64), torch.rand(1, dtype=torch.float64) + 0.5
    ref = F.batch_norm(x, rm, rv, training=False)
    whole = [distribute_tensor(t, mesh, [R]) for t in (rm, rv)]
    cut = distribute_tensor(x, mesh, [Shard(1)])
    with record_collectives() as log:
        out = F.batch_norm(cut, *whole, training=False)
    assert len(log) == 0
    torch.testing.assert_close(out.full_tensor(), ref)


@pytest.mark.distributed(world_size=2)
def test_many_channels_keep_two_all_reduces(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Past 64 KiB of gathered statistics the gather would cost bytes, not latency: two all-reduces."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(3, 1400, dtype=torch.float64)  # 2 ranks x 3 x 1400 channels x 8 bytes > 64 KiB
    log = _train_step(x, mesh, [Shard(0)])
    assert dict(log.counts()) == {"all_reduce": 2}, dict(log.counts())

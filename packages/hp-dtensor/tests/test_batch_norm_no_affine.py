"""``F.batch_norm`` without weight or bias on DTensors, training and evaluation.

Training with running statistics used to fail: torch's meta kernel of
``_batch_norm_with_update`` needs real weight and bias tensors. A missing
weight is now given as ones and a missing bias as zeros ([Note: batch norm
without weight or bias] in ``ops/batch_norm.py``). Checked against one
process: output, input gradient (and the weight's where only the bias is
missing), running statistics, on uneven batch, channel and spatial cuts and a
2-D mesh, with no fallback and the batch cut's one small gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Placement, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

R = Replicate()


def _compare(  # type: ignore[no-untyped-def]
    x: torch.Tensor, mesh, cut: Sequence[Placement], *, training: bool, stats: bool, weight: bool
) -> dict[str, int]:
    """Batch norm forward and backward on ``x`` cut by ``cut`` against one process; the forward's counts."""
    channels = x.shape[1]
    whole = [R] * mesh.ndim
    w = torch.randn(channels, dtype=x.dtype) if weight else None
    rm, rv = torch.randn(channels, dtype=x.dtype), torch.rand(channels, dtype=x.dtype) + 0.5
    plain_x = x.clone().requires_grad_()
    plain_w = w.clone().requires_grad_() if w is not None else None
    plain_stats = [rm.clone(), rv.clone()] if stats else [None, None]
    ref = F.batch_norm(plain_x, *plain_stats, plain_w, None, training=training, momentum=0.3)
    scale = torch.rand(ref.shape, dtype=x.dtype)
    (ref * scale).sum().backward()
    dx = distribute_tensor(x, mesh, list(cut)).requires_grad_()
    dw = distribute_tensor(w, mesh, whole).requires_grad_() if w is not None else None
    dstats = [distribute_tensor(t.clone(), mesh, whole) for t in (rm, rv)] if stats else [None, None]
    with fallback_policy("error"), record_collectives() as log:
        out = F.batch_norm(dx, *dstats, dw, None, training=training, momentum=0.3)
    tag = f"{tuple(x.shape)} {list(cut)} training={training} stats={stats} weight={weight}"
    torch.testing.assert_close(out.full_tensor(), ref, msg=lambda m: f"{tag}: {m}")
    with fallback_policy("error"):
        (out * distribute_tensor(scale, mesh, out.placements)).sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), plain_x.grad, msg=lambda m: f"{tag} (input grad): {m}")
    if dw is not None:
        torch.testing.assert_close(
            dw.grad.full_tensor(), plain_w.grad, msg=lambda m: f"{tag} (weight grad): {m}"
        )
    for got, want in zip(dstats, plain_stats, strict=True):
        if got is not None:
            torch.testing.assert_close(got.full_tensor(), want, msg=lambda m: f"{tag} (running stats): {m}")
    return dict(log.counts())


@pytest.mark.distributed(world_size=2)
def test_batch_norm_without_affine_parameters(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, dtype=torch.float64)  # 5 rows, 3 channels: every cut is uneven
    modes = [(True, True, False), (True, False, False), (False, True, False), (True, True, True)]
    for cut in ([Shard(0)], [Shard(1)], [Shard(2)]):
        for training, stats, weight in modes:  # weight: a weight and no bias; else neither
            counts = _compare(x, mesh, cut, training=training, stats=stats, weight=weight)
            if training and cut[0] != Shard(1):  # the batch statistics: one small gather
                assert counts == {"all_gather_into_tensor": 1}, f"{cut}: {counts}"


@pytest.mark.distributed(world_size=2)
def test_batch_norm_without_affine_in_low_precision(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A bfloat16 input with float32 running statistics (a mixed-precision module's buffers)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    x = torch.randn(6, 4, 3).to(torch.bfloat16)
    rm, rv = torch.zeros(4), torch.ones(4)
    ref = F.batch_norm(x, rm, rv, training=True)
    stats = [distribute_tensor(t, mesh, [R]) for t in (torch.zeros(4), torch.ones(4))]
    with fallback_policy("error"):
        out = F.batch_norm(distribute_tensor(x, mesh, [Shard(0)]), *stats, training=True)
    torch.testing.assert_close(out.full_tensor(), ref)
    for got, want in zip(stats, (rm, rv), strict=True):
        torch.testing.assert_close(got.full_tensor(), want)


@pytest.mark.distributed(world_size=4)
def test_batch_norm_without_affine_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(2)
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    for cut in ([Shard(0), Shard(1)], [Shard(0), Shard(2)]):
        _compare(x, mesh, cut, training=True, stats=True, weight=False)

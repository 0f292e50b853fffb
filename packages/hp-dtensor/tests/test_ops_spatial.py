"""Spatial ops keep batch and channel shards with no communication, forward and backward (2 ranks).

Pooling, upsampling, padding, pixel / channel shuffles and grid sampling on
DTensors against the same ops on plain tensors (float64, values and every
input gradient), with the collectives of the forward and of the backward
counted: zero where the op is local on the cut (batch, channel), and no
fallback anywhere (a cut spatial dim is gathered by a redistribution). Sizes
are odd, so the cuts are uneven (3 rows over 2 ranks: 2 and 1).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Replicate, Shard
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, S2, S3, R = Shard(0), Shard(1), Shard(2), Shard(3), Replicate()


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


_UPSAMPLES: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], int]] = [
    ("nearest1d", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), 1),
    ("nearest2d", lambda x: F.interpolate(x, size=(7, 4), mode="nearest"), 2),
    ("nearest3d", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), 3),
    ("nearest-exact", lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest-exact"), 2),
    ("linear", lambda x: F.interpolate(x, scale_factor=2, mode="linear"), 1),
    ("bilinear", lambda x: F.interpolate(x, size=(7, 4), mode="bilinear", align_corners=True), 2),
    ("bicubic", lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), 2),
    ("trilinear", lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), 3),
    ("area", lambda x: F.interpolate(x, size=(2, 3), mode="area"), 2),
    ("bilinear-aa", lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True), 2),
    ("bicubic-aa", lambda x: F.interpolate(x, size=(3, 5), mode="bicubic", antialias=True), 2),
]


@pytest.mark.distributed(world_size=2)
def test_upsampling_keeps_batch_and_channel_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for _, fn, k in _UPSAMPLES:
        x = _x(3, 5, *(5, 4, 3)[:k])
        for cut in (S0, S1):
            check(fn, [x], [cut], mesh, expect=[cut])


_POOLS: list[tuple[Callable[[torch.Tensor], Any], int]] = [
    (lambda x: F.max_pool1d(x, 2), 1),
    (lambda x: F.max_pool2d(x, 3, stride=2, padding=1), 2),
    (lambda x: F.max_pool3d(x, 2, return_indices=True), 3),
    (lambda x: F.avg_pool1d(x, 3, stride=2, ceil_mode=True), 1),
    (lambda x: F.avg_pool2d(x, 2, count_include_pad=False, padding=1), 2),
    (lambda x: F.avg_pool3d(x, 2, divisor_override=3), 3),
    (lambda x: F.adaptive_avg_pool1d(x, 3), 1),
    (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), 2),
    (lambda x: F.adaptive_avg_pool3d(x, 2), 3),
    (lambda x: F.adaptive_max_pool1d(x, 3, return_indices=True), 1),
    (lambda x: F.adaptive_max_pool2d(x, (3, 2)), 2),
    (lambda x: F.adaptive_max_pool3d(x, 2), 3),
    (lambda x: F.lp_pool2d(x.abs() + 0.1, 2, 2), 2),
    (lambda x: F.pad(x, (1, 2), mode="reflect"), 1),
    (lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"), 2),
    (lambda x: F.pad(x, (1, 1, 1, 0, 0, 1), mode="reflect"), 3),
]


@pytest.mark.distributed(world_size=2)
def test_pooling_and_padding_keep_batch_and_channel_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for fn, k in _POOLS:
        x = _x(3, 5, *(7, 6, 5)[:k])
        for cut in (S0, S1):
            check(fn, [x], [cut], mesh, expect=[cut])
    # unbatched (C, H, W): the channel dim is dim 0
    check(lambda x: F.max_pool2d(x, 2), [_x(3, 6, 5)], [S0], mesh, expect=[S0])


@pytest.mark.distributed(world_size=2)
def test_max_unpool_keeps_batch_and_channel_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for k in (1, 2, 3):
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[k - 1]
        unpool = (F.max_unpool1d, F.max_unpool2d, F.max_unpool3d)[k - 1]
        x = _x(3, 5, *(6, 4, 4)[:k])

        def fn(x: torch.Tensor, pool: Any = pool, unpool: Any = unpool) -> torch.Tensor:
            values, indices = pool(x, 2, return_indices=True)
            return unpool(values * 2, indices, 2)

        for cut in (S0, S1):
            check(fn, [x], [cut], mesh, expect=[cut])


@pytest.mark.distributed(world_size=2)
def test_cut_spatial_dim_is_gathered_not_fallen_back(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A window crossing the cut needs the neighbour's rows: a redistribution, right values, no fallback."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _x(2, 3, 5, 6)
    for fn in (
        lambda x: F.avg_pool2d(x, 3, stride=1),
        lambda x: F.max_pool2d(x, 2),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    ):
        for cut in (S2, S3):
            check(fn, [x], [cut], mesh, local=False)
    # a piece with no channel (1 channel over 2 ranks) cannot be pooled: that cut is gathered too
    check(lambda x: F.max_pool2d(x, 2), [_x(2, 1, 4, 4)], [S1], mesh, local=False)


@pytest.mark.distributed(world_size=2)
def test_linear_spatial_ops_keep_partial_sums(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Average pooling and upsampling are linear: a partial sum stays one, with no communication."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    terms = [_x(2, 3, 5, 4), _x(2, 3, 5, 4)]
    x = DTensor.from_local(terms[rank], mesh, [Partial("sum")])
    whole = terms[0] + terms[1]
    for fn in (
        lambda x: F.avg_pool2d(x, 2),
        lambda x: F.adaptive_avg_pool2d(x, 3),
        lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"),
    ):
        with record_collectives() as log:
            out = fn(x)
        assert len(log) == 0 and out.placements == (Partial("sum"),)
        torch.testing.assert_close(out.full_tensor(), fn(whole))
    # max pooling is not linear: the partial is summed first
    torch.testing.assert_close(F.max_pool2d(x, 2).full_tensor(), F.max_pool2d(whole, 2))


@pytest.mark.distributed(world_size=2)
def test_pixel_shuffles_keep_cuts_that_hold_whole_blocks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    shuffle = lambda x: F.pixel_shuffle(x, 2)  # noqa: E731
    unshuffle = lambda x: F.pixel_unshuffle(x, 2)  # noqa: E731
    # (3, 8, 4, 5): 8 channels over 2 ranks = two groups of 4 each; rows 2 + 2 -> 4 + 4
    x = _x(3, 8, 4, 5)
    for cut in (S0, S1, S2):
        check(shuffle, [x], [cut], mesh, expect=[cut])
    # 5 columns cut 3 + 2 would give 6 + 4 output columns, not torch.chunk's 5 + 5: gathered
    check(shuffle, [x], [S3], mesh, local=False, expect=[R])
    # (3, 2, 4, 6) -> (3, 8, 2, 3)
    y = _x(3, 2, 4, 6)
    for cut in (S0, S1, S2):
        check(unshuffle, [y], [cut], mesh, expect=[cut])
    check(unshuffle, [y], [S3], mesh, local=False, expect=[R])
    # leading batch dims of any number
    check(shuffle, [_x(3, 2, 4, 2, 2)], [S1], mesh, expect=[S1])


@pytest.mark.distributed(world_size=2)
def test_channel_shuffle_keeps_every_cut_but_the_channels(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _x(3, 6, 5, 3)
    for cut in (S0, S2, S3):
        check(lambda x: F.channel_shuffle(x, 3), [x], [cut], mesh, expect=[cut])
    check(lambda x: F.channel_shuffle(x, 3), [x], [S1], mesh, local=False, expect=[R])


@pytest.mark.distributed(world_size=2)
def test_grid_sample_keeps_batch_channel_and_point_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Batch: both cut; channels: grid whole, its gradient a partial sum; points: input whole, likewise."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, grid = _x(3, 5, 6, 4), torch.rand(3, 7, 5, 2, dtype=torch.float64) * 2.2 - 1.1
    modes = [
        dict(mode="bilinear", padding_mode="zeros", align_corners=False),
        dict(mode="nearest", padding_mode="border", align_corners=True),
        dict(mode="bicubic", padding_mode="reflection", align_corners=False),
    ]
    # one cut per mode (torch's meta kernels for these ops are slow Python decompositions)
    cuts = [([S0, S0], [S0]), ([S1, R], [S1]), ([R, S1], [S2]), ([R, S2], [S3])]
    for i, (placements, expect) in enumerate(cuts):
        kw = modes[i % len(modes)]
        check(lambda x, g, kw=kw: F.grid_sample(x, g, **kw), [x, grid], placements, mesh, expect=expect)
    x3, grid3 = _x(3, 2, 4, 5, 3), torch.rand(3, 3, 5, 2, 3, dtype=torch.float64) * 2 - 1
    fn3 = lambda x, g: F.grid_sample(x, g, align_corners=False)  # noqa: E731
    check(fn3, [x3, grid3], [S0, S0], mesh, expect=[S0])
    check(fn3, [x3, grid3], [S1, R], mesh, expect=[S1])
    check(fn3, [x3, grid3], [R, S3], mesh, expect=[Shard(4)])
    # only the grid learns (a spatial transformer's data input): the cuts stay local
    data = lambda t: t.detach()  # noqa: E731
    check(lambda x, g: F.grid_sample(data(x), g, align_corners=False), [x, grid], [S0, S0], mesh)
    check(lambda x, g: F.grid_sample(data(x), g, align_corners=False), [x, grid], [S1, R], mesh)
    # a cut input spatial dim is gathered (the points may fall anywhere)
    check(F.grid_sample, [x, grid], [S2, R], mesh, local=False)


@pytest.mark.distributed(world_size=2)
def test_empty_pieces_where_the_cpu_kernels_differ_from_meta(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """One row over 2 ranks: rank 1 holds nothing ([Note: empty pieces] in ops/holding.py)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    # pixel_(un)shuffle returns an empty input unchanged on CPU (the wrong shape): gathered
    check(lambda x: F.pixel_unshuffle(x, 3), [_x(1, 1, 6, 6)], [S0], mesh, local=False, expect=[R])
    check(lambda x: F.pixel_shuffle(x, 3), [_x(1, 9, 2, 2)], [S0], mesh, local=False, expect=[R])
    # upsampling refuses a piece with no channel on CPU (its meta kernel does not): gathered
    bilinear = lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")  # noqa: E731
    check(bilinear, [_x(2, 1, 3, 3)], [S1], mesh, local=False, expect=[R])
    # but takes an empty batch: the batch cut stays
    check(bilinear, [_x(1, 2, 3, 3)], [S0], mesh, expect=[S0])
    check(lambda x: F.max_pool2d(x, 2), [_x(1, 2, 4, 4)], [S0], mesh, expect=[S0])

"""Halo exchange on lines of more than two ranks: each rank swaps border rows with its two neighbours only.

Values and every gradient against the op on plain float64 tensors, under
``fallback_policy("error")``; the transfers are counted per rank (one
``batch_isend_irecv`` round per exchange, no all-gather, bytes of the borders
its neighbours read), on gloo and on NCCL's emulation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S2, S3, R = Shard(2), Shard(3), Replicate()


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _rows(shape: tuple[int, ...], dim: int, n: int) -> int:
    """Bytes of ``n`` float64 slices of a tensor of ``shape`` along ``dim``."""
    size = 8 * n
    for d, length in enumerate(shape):
        size *= 1 if d == dim else length
    return size


@pytest.mark.parametrize(
    "backend_name",
    [
        pytest.param(b, marks=pytest.mark.distributed(world_size=4, backend=b), id=b)
        for b in ("gloo", "nccl-emu")
    ],
)
def test_conv_on_four_ranks_swaps_borders_with_neighbours(
    rank: int, backend_name: str, device_mesh_factory
) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(0)
    x, w, b = _t(2, 3, 12, 7), _t(4, 3, 5, 3), _t(4)
    conv = lambda x, w, b: F.conv2d(x, w, b, padding=(2, 1))  # noqa: E731
    with fallback_policy("error"):
        check(conv, [x, w, b], [S2, R, R], mesh, expect=[S2], local=False)
    neighbours = (rank > 0) + (rank < 3)
    xd = distribute_tensor(x, mesh, [S2]).requires_grad_()
    wd, bd = (distribute_tensor(t, mesh, [R]).requires_grad_() for t in (w, b))
    with fallback_policy("error"):
        with record_collectives() as forward:
            out = conv(xd, wd, bd)
        with record_collectives() as backward:
            out.sum().backward()
    # pieces of 3 rows; a 5-row window reads 2 rows of each neighbour: 2 rows in and out per neighbour
    assert out.placements == (S2,) and forward.count() == 0, list(forward)
    assert (
        forward.p2p_batches() == 1 and forward.p2p_count("isend") == forward.p2p_count("irecv") == neighbours
    )
    assert forward.p2p_nbytes("received") == forward.p2p_nbytes("sent") == neighbours * _rows(x.shape, 2, 2)
    assert {r.peer for r in forward.p2p()} == {p for p in (rank - 1, rank + 1) if 0 <= p < 4}
    # a gather would bring 3 pieces' borders of 4 rows; the neighbours bring at most 2 x 2 rows
    assert forward.p2p_nbytes("received") < 3 * _rows(x.shape, 2, 4)
    # the backward: only the gradient's halo home (the weight gradient reads the input's halo the
    # forward kept); the replicated weight's and bias's gradients are all-reduced, as for any batch
    assert backward.p2p_batches() == 1 and backward.count("all_gather_into_tensor") == 0, list(backward)
    assert backward.p2p_nbytes("received") == neighbours * _rows(x.shape, 2, 2)


@pytest.mark.distributed(world_size=4)
def test_pooling_and_transposed_conv_on_four_ranks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(1)
    x = _t(2, 3, 9, 16)
    pools = [
        lambda x: F.avg_pool2d(x, 3, 1, 1),
        lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 1)),
        lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
    ]
    with fallback_policy("error"):
        for pool in pools:
            check(pool, [x], [S3], mesh, expect=[S3], local=False)
        w = _t(3, 2, 3, 3)
        check(
            lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1),
            [x, w],
            [S3, R],
            mesh,
            expect=[S3],
            local=False,
        )
        xd = distribute_tensor(x, mesh, [S3])
        with record_collectives() as log:
            out = pools[0](xd)
    assert out.placements == (S3,) and len(log) == 0 and log.p2p_batches() == 1
    neighbours = (rank > 0) + (rank < 3)
    assert log.p2p_nbytes("received") == neighbours * _rows(x.shape, 3, 1)


@pytest.mark.distributed(world_size=4, backend="nccl-emu")
def test_two_by_two_mesh_keeps_the_all_gather_per_pair(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(2)
    x, w = _t(2, 3, 8, 9), _t(4, 3, 3, 3)
    xd, wd = distribute_tensor(x, mesh, [S2, S3]), distribute_tensor(w, mesh, [R, R])
    with fallback_policy("error"):
        with record_collectives() as log:
            out = F.conv2d(xd, wd, padding=1)
    assert log.counts() == {"all_gather_into_tensor": 2} and log.p2p_count() == 0
    torch.testing.assert_close(out.full_tensor(), F.conv2d(x, w, padding=1))

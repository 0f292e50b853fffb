"""Tensor.unfold, F.unfold (im2col) and F.fold (col2im) keep their local cuts (2 and 4 ranks).

Values and gradients against plain float64 tensors under the ``"error"``
fallback policy, with the collectives of the forward and the backward
counted: none on the local cuts, a gather (a redistribution, not the
fallback) where windows cross the cut.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard

sys.path.insert(0, str(Path(__file__).parent))
from mesh_compare import check_placed, randn

S0, S1, S2, S3, R = Shard(0), Shard(1), Shard(2), Shard(3), Replicate()


@pytest.mark.distributed(world_size=2)
def test_tensor_unfold_keeps_cuts_of_other_dims(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = randn(3, 5, 7)
    for dim, size, step in [(2, 3, 2), (1, 2, 1), (0, 2, 1)]:
        fn = lambda t, dim=dim, size=size, step=step: t.unfold(dim, size, step)  # noqa: E731
        for cut in {0, 1, 2} - {dim}:
            out = check_placed(fn, [x], [[Shard(cut)]], mesh)
            assert out.placements == (Shard(cut),)
        check_placed(fn, [x], [[Shard(dim)]], mesh, forward_comms=1, backward_comms=None)
    out = check_placed(lambda t: torch.unfold_copy(t, 1, 2, 2), [x], [[S2]], mesh)
    assert out.placements == (S2,)


@pytest.mark.distributed(world_size=2)
def test_im2col_and_col2im_keep_batch_and_channel_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    im2col = lambda t: F.unfold(t, (2, 3), dilation=1, padding=1, stride=(1, 2))  # noqa: E731
    for batch in (4, 3):
        out = check_placed(im2col, [randn(batch, 4, 5, 6)], [[S0]], mesh)
        assert out.placements == (S0,)
    out = check_placed(im2col, [randn(3, 4, 5, 6)], [[S1]], mesh)  # 2 + 2 channels: 12 + 12 rows
    assert out.placements == (S1,)
    out = check_placed(im2col, [randn(4, 5, 6)], [[S0]], mesh)  # unbatched: the channel dim is first
    assert out.placements == (S0,)
    # 3 channels (2 + 1) but 18 rows cut 9 + 9: the blocks disagree, gathered, not the fallback
    check_placed(im2col, [randn(2, 3, 5, 6)], [[S1]], mesh, forward_comms=1, backward_comms=None)
    check_placed(im2col, [randn(2, 4, 5, 6)], [[S2]], mesh, forward_comms=1, backward_comms=None)
    fold = lambda t: F.fold(t, (4, 5), 2, stride=(1, 2))  # noqa: E731  (L = 3 * 2 windows)
    for batch in (4, 3):
        out = check_placed(fold, [randn(batch, 8, 6)], [[S0]], mesh)
        assert out.placements == (S0,)
    out = check_placed(fold, [randn(3, 8, 6)], [[S1]], mesh)  # 2 channels of 4 rows: 4 + 4 rows
    assert out.placements == (S1,)
    check_placed(fold, [randn(3, 8, 6)], [[S2]], mesh, forward_comms=1, backward_comms=None)


@pytest.mark.distributed(world_size=4)
def test_unfold_ops_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    out = check_placed(lambda t: t.unfold(1, 2, 1), [randn(5, 4, 3)], [[S0, S2]], mesh)
    assert out.placements == (S0, S2)
    out = check_placed(lambda t: F.unfold(t, 2), [randn(3, 4, 3, 3)], [[S0, S1]], mesh)
    assert out.placements == (S0, S1)
    out = check_placed(lambda t: F.fold(t, (3, 3), 2), [randn(3, 8, 4)], [[S1, S0]], mesh)
    assert out.placements == (S1, S0)

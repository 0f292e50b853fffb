"""group_norm keeps batch and whole-group channel cuts locally and spatial cuts in small all-reduces.

Values and every gradient (input, weight, bias) against plain float64
tensors, under the ``"error"`` fallback policy; the collectives of the
forward and of the backward are counted. The loss's own gradient is local,
so a local rule issues none; the weight and bias gradients of a batch cut
are partial sums, reduced only when read (``full_tensor`` in the check).
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
SPATIAL = {"forward_comms": 1, "backward_comms": 1}


@pytest.mark.distributed(world_size=2)
def test_group_norm_batch_and_whole_group_cuts_are_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    w, b = randn(8), randn(8)
    with_affine = lambda x, w, b: F.group_norm(x, 4, w, b)  # noqa: E731
    # batch cut, even (4 samples) and uneven (3 samples: 2 + 1), 2-D to 4-D inputs
    for shape in [(4, 8, 5), (3, 8, 5), (3, 8), (3, 8, 2, 3)]:
        check_placed(with_affine, [randn(*shape), w, b], [[S0], [R], [R]], mesh)
    check_placed(lambda x: F.group_norm(x, 2), [randn(3, 8, 5)], [[S0]], mesh)
    # a sample dim of 1 over 2 ranks: one rank's piece is empty
    check_placed(with_affine, [randn(1, 8, 3), w, b], [[S0], [R], [R]], mesh)
    # channel cut on group boundaries: 8 channels, 4 groups of 2, cut 4 + 4; weight and bias cut too
    out = check_placed(with_affine, [randn(3, 8, 5), w, b], [[S1], [S0], [S0]], mesh)
    assert out.placements == (S1,)
    # weight and bias replicated: cut locally, still no communication
    check_placed(with_affine, [randn(3, 8, 5), w, b], [[S1], [R], [R]], mesh)
    # 10 channels in 5 groups over 2 ranks cut 5 + 5, across group 2: gathered (not the fallback)
    w10, b10 = randn(10), randn(10)
    fn10 = lambda x, w, b: F.group_norm(x, 5, w, b)  # noqa: E731
    check_placed(
        fn10, [randn(3, 10, 4), w10, b10], [[S1], [S0], [S0]], mesh, forward_comms=None, backward_comms=None
    )
    # a spatial cut stays cut: one small all-gather of the blocks' moments forward, one all-reduce backward
    for shape in [(3, 8, 5), (2, 8, 3, 4), (2, 8, 1)]:  # uneven, 4-D, and one rank with no position
        out = check_placed(with_affine, [randn(*shape), w, b], [[S2], [R], [R]], mesh, **SPATIAL)
        assert out.placements == (S2,)
    check_placed(lambda x: F.group_norm(x, 2), [randn(3, 8, 2, 5)], [[S3]], mesh, **SPATIAL)


@pytest.mark.distributed(world_size=4)
def test_group_norm_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    w, b = randn(8), randn(8)
    fn = lambda x, w, b: F.group_norm(x, 4, w, b)  # noqa: E731
    out = check_placed(fn, [randn(5, 8, 3), w, b], [[S0, S1], [R, S0], [R, S0]], mesh)
    assert out.placements == (S0, S1)
    check_placed(fn, [randn(5, 8, 3), w, b], [[S1, S0], [S0, R], [S0, R]], mesh)
    out = check_placed(fn, [randn(5, 8, 3), w, b], [[S0, S2], [R, R], [R, R]], mesh, **SPATIAL)
    assert out.placements == (S0, S2)

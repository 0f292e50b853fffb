"""F.bilinear (``_trilinear``) keeps a batch cut and a weight cut locally (2 and 4 ranks).

Values and gradients of the inputs, the weight and the bias against plain
float64 tensors under the ``"error"`` fallback policy, with the collectives
counted: none in the forward and none in the op's backward (the weight's
gradient under a batch cut is a partial sum, reduced only when read).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Partial, Replicate, Shard

sys.path.insert(0, str(Path(__file__).parent))
from mesh_compare import check_placed, randn

S0, S1, R = Shard(0), Shard(1), Replicate()


@pytest.mark.distributed(world_size=2)
def test_bilinear_batch_and_weight_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    w, bias = randn(5, 4, 2), randn(5)
    for n in (4, 3):
        a, b = randn(n, 4), randn(n, 2)
        out = check_placed(F.bilinear, [a, b, w, bias], [[S0], [S0], [R], [R]], mesh)
        assert out.placements == (S0,)
        # the weight cut on its output features: each rank computes its features
        out = check_placed(F.bilinear, [a, b, w, bias], [[R], [R], [S0], [S0]], mesh, backward_comms=None)
        assert out.placements == (S1,)
        # the weight cut on x1's features: each rank's terms are a partial sum
        no_bias = lambda x, y, v: F.bilinear(x, y, v)  # noqa: E731
        out = check_placed(no_bias, [a, b, w], [[S1], [R], [S1]], mesh, backward_comms=None)
        assert out.placements == (Partial("sum"),)
    # leading batch dims (viewed to rows first)
    check_placed(F.bilinear, [randn(2, 3, 4), randn(2, 3, 2), w, bias], [[S0], [S0], [R], [R]], mesh)


@pytest.mark.distributed(world_size=4)
def test_bilinear_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    a, b, w, bias = randn(5, 4), randn(5, 2), randn(6, 4, 2), randn(6)
    placements = [[S0, R], [S0, R], [R, S0], [R, S0]]
    out = check_placed(F.bilinear, [a, b, w, bias], placements, mesh, backward_comms=None)
    assert out.placements == (S0, S1)

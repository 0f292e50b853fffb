"""cdist and pdist on cut operands: local cuts and norm partials (2 and 4 ranks).

Values and gradients of both operands against plain float64 tensors under
the ``"error"`` fallback policy, with the forward's collectives counted
(none: a feature cut's result is a norm partial, reduced only when read).
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

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


@pytest.mark.distributed(world_size=2)
def test_cdist_batch_row_and_feature_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b = randn(3, 5, 4), randn(3, 6, 4)
    for p in (2.0, 1.0, 1.5, float("inf")):
        fn = lambda x, y, p=p: torch.cdist(x, y, p=p)  # noqa: E731
        out = check_placed(fn, [a, b], [[S0], [S0]], mesh)  # batch (3: 2 + 1)
        assert out.placements == (S0,)
        out = check_placed(fn, [a, b], [[S1], [R]], mesh, backward_comms=None)  # x1's rows
        assert out.placements == (S1,)
        out = check_placed(fn, [a, b], [[R], [S1]], mesh, backward_comms=None)  # x2's rows
        assert out.placements == (S2,)
        out = check_placed(fn, [a, b], [[S2], [S2]], mesh, backward_comms=None)  # features
        assert out.placements == (Partial("norm", p),)
    # 2-D operands, and a feature cut of 3 features (2 + 1)
    out = check_placed(
        lambda x, y: torch.cdist(x, y), [randn(5, 3), randn(4, 3)], [[S1], [S1]], mesh, backward_comms=None
    )
    assert out.placements == (Partial("norm", 2.0),)


@pytest.mark.distributed(world_size=2)
def test_pdist_feature_cut_is_a_norm_partial(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for p in (2.0, 1.0, float("inf")):
        out = check_placed(lambda x, p=p: F.pdist(x, p), [randn(5, 3)], [[S1]], mesh, backward_comms=None)
        assert out.placements == (Partial("norm", p),)
    # a row cut pairs rows of both ranks: gathered, not the fallback
    check_placed(F.pdist, [randn(5, 3)], [[S0]], mesh, forward_comms=1, backward_comms=None)


@pytest.mark.distributed(world_size=4)
def test_cdist_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    out = check_placed(
        torch.cdist, [randn(3, 5, 4), randn(3, 6, 4)], [[S0, S1], [S0, R]], mesh, backward_comms=None
    )
    assert out.placements == (S0, S1)
    out = check_placed(
        torch.cdist, [randn(5, 4), randn(6, 4)], [[S0, S1], [R, S1]], mesh, backward_comms=None
    )
    assert out.placements == (S0, Partial("norm", 2.0))

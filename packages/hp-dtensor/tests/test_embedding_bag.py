"""F.embedding_bag keeps a column cut of the table locally, forward and backward (2 and 4 ranks).

Values and gradients (the table's and the per-sample weights') against
plain float64 tensors under the ``"error"`` fallback policy, with the
collectives counted: none in the forward, none in the op's backward (the
per-sample weights' gradient is a partial sum, reduced only when read).
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
IDS = torch.tensor([1, 2, 4, 5, 4, 3, 9, 0])
OFFSETS = torch.tensor([0, 2, 5])


@pytest.mark.distributed(world_size=2)
def test_embedding_bag_column_cut_is_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    table = randn(10, 5)  # 5 columns: 3 + 2
    for mode in ("sum", "mean", "max"):
        fn = lambda w, m=mode: F.embedding_bag(IDS, w, OFFSETS, mode=m)  # noqa: E731
        out = check_placed(fn, [table], [[S1]], mesh)
        assert out.placements == (S1,)
        bags = lambda w, m=mode: F.embedding_bag(IDS.view(2, 4), w, mode=m, padding_idx=4)  # noqa: E731
        check_placed(bags, [table], [[S1]], mesh)
    weighted = lambda w, p: F.embedding_bag(IDS, w, OFFSETS, mode="sum", per_sample_weights=p)  # noqa: E731
    out = check_placed(weighted, [table, randn(8)], [[S1], [R]], mesh)
    assert out.placements == (S1,)
    with torch.no_grad():  # the forward-only kernel
        check_placed(lambda w: F.embedding_bag(IDS, w, OFFSETS), [table], [[S1]], mesh, grad=False)
    # a row cut pools locally into a partial sum (more in test_embedding_bag_vocab.py)
    fn = lambda w: F.embedding_bag(IDS, w, OFFSETS)  # noqa: E731
    out = check_placed(fn, [table], [[S0]], mesh)
    assert out.placements == (Partial("sum"),)


@pytest.mark.distributed(world_size=4)
def test_embedding_bag_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    fn = lambda w: F.embedding_bag(IDS, w, OFFSETS, mode="max")  # noqa: E731
    out = check_placed(fn, [randn(10, 6)], [[R, S1]], mesh)
    assert out.placements == (R, S1)
    out = check_placed(fn, [randn(10, 6)], [[S1, S1]], mesh)
    assert out.placements == (S1, S1)

"""segment_reduce keeps cuts of the dims it does not segment, forward and backward (2 ranks).

Values and gradients against plain float64 tensors under the ``"error"``
fallback policy, with the collectives counted: none on the kept cuts, a
gather (a redistribution, not the fallback) on a cut of the segmented dim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import Replicate, Shard

sys.path.insert(0, str(Path(__file__).parent))
from mesh_compare import check_placed, randn

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
LENGTHS = torch.tensor([[2, 3], [1, 4], [5, 0]])  # per row of dim 0: runs along dim 1


@pytest.mark.distributed(world_size=2)
def test_segment_reduce_keeps_other_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = randn(3, 5, 3)
    for reduce in ("sum", "mean", "max"):
        fn = lambda t, r=reduce: torch.segment_reduce(t, r, lengths=LENGTHS, axis=1, initial=0.5)  # noqa: E731
        for cut in (S0, S2):  # a row cut takes its rows' lengths; a column cut keeps them whole
            out = check_placed(fn, [x], [[cut]], mesh)
            assert out.placements == (cut,)
        check_placed(fn, [x], [[S1]], mesh, forward_comms=1, backward_comms=None)
    flat = lambda t: torch.segment_reduce(t, "sum", lengths=torch.tensor([1, 4]), axis=0)  # noqa: E731
    out = check_placed(flat, [randn(5, 3)], [[S1]], mesh)
    assert out.placements == (S1,)

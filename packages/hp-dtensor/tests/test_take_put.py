"""take and put on a cut tensor: each rank reads or writes the positions it owns (2 and 4 ranks).

Values and gradients against plain float64 tensors under the ``"error"``
fallback policy, with the collectives counted: none in the forward and none
in the op's backward (``take``'s result is a partial sum, reduced only when
read). Negative indices, repeated indices, uneven and multi-dim cuts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import Partial, Replicate, Shard, distribute_tensor, fallback_policy

sys.path.insert(0, str(Path(__file__).parent))
from mesh_compare import check_placed, randn

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
INDEX = torch.tensor([[0, 7, -1], [13, 5, 5], [-20, 2, 19]])  # repeats and negatives; 3 x 7 = 21 elements
UNIQUE = torch.tensor([1, 8, 20, -3])  # put without accumulate: one write per position


@pytest.mark.distributed(world_size=2)
def test_take_and_put_on_cut_tensors(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = randn(3, 7)
    for cut in (S0, S1):
        out = check_placed(lambda t: torch.take(t, INDEX), [x], [[cut]], mesh)
        assert out.placements == (Partial("sum"),)
        added = lambda t, s: torch.put(t, INDEX, s, accumulate=True)  # noqa: E731
        out = check_placed(added, [x, randn(3, 3)], [[cut], [R]], mesh)
        assert out.placements == (cut,)
        put = lambda t, s: torch.put(t, UNIQUE, s)  # noqa: E731
        out = check_placed(put, [x, randn(4)], [[cut], [R]], mesh)
        assert out.placements == (cut,)
    # a cut index with x whole: the output keeps the index's cut (the backward is a partial sum)
    out = check_placed(lambda t, i: torch.take(t, i), [x, INDEX], [[R], [S1]], mesh)
    assert out.placements == (S1,)
    # an accumulating put of a cut index and source: a partial sum; without accumulate, gathered
    cut_values = [[R], [S0], [S0]]
    out = check_placed(lambda t, i, s: torch.put(t, i, s, True), [x, INDEX, randn(3, 3)], cut_values, mesh)
    assert out.placements == (Partial("sum"),)
    gathered = dict(forward_comms=2, backward_comms=None)
    check_placed(lambda t, i, s: torch.put(t, i, s), [x, UNIQUE, randn(4)], cut_values, mesh, **gathered)
    with fallback_policy("error"):
        dx = distribute_tensor(x.clone(), mesh, [S0])
        dx.put_(torch.tensor([2, 20]), torch.tensor([1.0, 2.0], dtype=torch.float64), accumulate=True)
        expected = x.clone().put_(torch.tensor([2, 20]), torch.tensor([1.0, 2.0], dtype=torch.float64), True)
        assert dx.placements == (S0,)
        torch.testing.assert_close(dx.full_tensor(), expected)
        with pytest.raises(IndexError, match="index 21 is out of range for a tensor of 21 elements"):
            torch.take(distribute_tensor(x, mesh, [S0]), torch.tensor([21]))


@pytest.mark.distributed(world_size=4)
def test_take_and_put_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    x = randn(3, 7)
    out = check_placed(lambda t: torch.take(t, INDEX), [x], [[S0, S1]], mesh)
    assert out.placements == (Partial("sum"), Partial("sum"))
    put = lambda t, s: torch.put(t, INDEX, s, accumulate=True)  # noqa: E731
    out = check_placed(put, [x, randn(3, 3)], [[S1, S0], [R, R]], mesh)
    assert out.placements == (S1, S0)

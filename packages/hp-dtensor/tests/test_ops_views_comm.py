"""Views that merge or split a sharded dim: when the cut survives with no communication, and when not.

A merge keeps ``Shard`` on the merged dim when the sharded dim is the
outermost of the group and the pieces are the same rows before and after
(an even cut; ``views.py`` checks the rows exactly). The inverse split keeps
it too. A cut of an inner dim of the group has no ``Shard`` form (each rank
holds strided rows of the merged dim): it is gathered, and stays right.
Values and gradients are checked against full tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import Replicate, Shard, StridedShard, fallback_stats

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R = Replicate()
NO_COMM: dict[str, int] = {}

# name: (input shape, view, input shard dim, output shard dim)
LOCAL_VIEWS = {
    "merge (4, 5, 3) -> (20, 3)": ((4, 5, 3), lambda t: t.reshape(20, 3), 0, 0),
    "flatten (4, 5, 3)": ((4, 5, 3), lambda t: t.flatten(), 0, 0),
    "flatten(1) (2, 6, 5)": ((2, 6, 5), lambda t: t.flatten(1), 1, 1),
    "split (20, 3) -> (4, 5, 3)": ((20, 3), lambda t: t.view(4, 5, 3), 0, 0),
    "split (6, 20) -> (6, 2, 10)": ((6, 20), lambda t: t.view(6, 2, 10), 1, 1),
    "split with -1 (8, 3) -> (2, -1, 3)": ((8, 3), lambda t: t.view(2, -1, 3), 0, 0),
    "a kept dim beside a merge (5, 4, 3) -> (5, 12)": ((5, 4, 3), lambda t: t.reshape(5, 12), 0, 0),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(LOCAL_VIEWS))
def test_outermost_even_merge_and_its_split_keep_the_cut(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    shape, fn, dim, out_dim = LOCAL_VIEWS[name]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    before = fallback_stats()
    check(
        fn,
        [torch.randn(*shape, dtype=torch.float64)],
        [[Shard(dim)]],
        mesh,
        expect=[Shard(out_dim)],
        forward_collectives=NO_COMM,
        tag=name,
    )
    assert fallback_stats() == before


@pytest.mark.distributed(world_size=2)
def test_merge_round_trip_moves_nothing(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    check(
        lambda t: t.flatten(0, 1).view(6, 5, 4),
        [x],
        [[Shard(0)]],
        mesh,
        expect=[Shard(0)],
        forward_collectives=NO_COMM,
        tag="flatten then view back",
    )


@pytest.mark.distributed(world_size=2)
def test_merging_a_cut_inner_dim_is_a_strided_shard(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """(5, 4, 3) cut on dim 1, merged to (20, 3): each rank holds its rows of every block of 4."""
    mesh = device_mesh_factory((2,))
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    check(
        lambda t: t.reshape(20, 3),
        [x],
        [[Shard(1)]],
        mesh,
        expect=[StridedShard(0, 5)],
        forward_collectives=NO_COMM,
        tag="inner dim of a merge",
    )


# name: (input shape, view, input shard dim): the cut cannot stay a Shard
GATHERED_VIEWS = {
    "uneven outer dim (5, 5, 5) -> (25, 5)": ((5, 5, 5), lambda t: t.reshape(25, 5), 0),
    "split whose rows differ (25, 5) -> (5, 5, 5)": ((25, 5), lambda t: t.view(5, 5, 5), 0),
}


@pytest.mark.distributed(world_size=2)
def test_views_that_cannot_keep_a_shard_are_still_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for name, (shape, fn, dim) in GATHERED_VIEWS.items():
        out = check(fn, [torch.randn(*shape, dtype=torch.float64)], [[Shard(dim)]], mesh, tag=name)
        assert out.placements == (R,), f"{name}: {out.placements}"

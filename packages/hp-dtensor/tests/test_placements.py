"""Placements and layouts: value semantics and per-rank shapes, single process."""

from __future__ import annotations

import pytest
from hp_dtensor import Partial, Replicate, Shard
from hp_dtensor.layout import chunk_sizes
from hp_dtensor.ops.views import view_groups


def test_placements_are_values() -> None:
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1)
    assert Replicate() == Replicate() and Replicate() != Shard(0)
    assert Partial() == Partial("sum") and Partial("max") != Partial("sum")
    assert len({Shard(0), Shard(0), Replicate(), Partial(), Partial("avg")}) == 4
    assert repr(Shard(1)) == "Shard(dim=1)" and repr(Partial("avg")) == "Partial('avg')"
    assert str(Shard(1)) == "S(1)" and str(Replicate()) == "R"
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # type: ignore[misc]


def test_bad_partial_op_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'mean'.*sum.*product"):
        Partial("mean")


def test_chunk_sizes_match_torch_chunk() -> None:
    import torch

    for size in range(0, 9):
        for parts in range(1, 5):
            expected = [c.shape[0] for c in torch.arange(size).chunk(parts)]
            got = chunk_sizes(size, parts)
            assert got[: len(expected)] == expected and sum(got) == size and len(got) == parts


def test_view_groups() -> None:
    assert view_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((6, 4), (2, 3, 4)) == [([0], [0, 1]), ([1], [2])]

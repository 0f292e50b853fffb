"""``local_map`` with uneven and data-dependent output shards, and DTensor keyword arguments.

torch's local_map takes the global size of a sharded output as local size x
mesh size; when an argument is cut unevenly hp gathers the sharded outputs'
local shapes in one exchange per call ([Note: uneven local_map outputs] in
``hp_dtensor/local_map.py``), what ``from_local(run_check=True)`` costs; none
when no output is sharded or every argument is cut evenly (the hot path).
Values and gradients against plain tensors, on 2 ranks.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import pytest
import torch
from hp_dtensor import Replicate, Shard, distribute_tensor, local_map
from hp_testing import record_collectives

local_map_module = importlib.import_module("hp_dtensor.local_map")  # the package's local_map is the function


def _rows(n: int) -> torch.Tensor:
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(n), dtype=torch.float64)


@contextlib.contextmanager
def _exchanges() -> Iterator[list[int]]:
    """Count local_map's cross-rank exchanges of output shapes (hp_core's agreement gathers through c10d
    directly, so record_collectives does not see them); each entry is the number of ints exchanged."""
    calls: list[int] = []
    real = local_map_module.agree_over_mesh

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(kwargs.get("extra") or ()))
        return real(*args, **kwargs)

    local_map_module.agree_over_mesh = counted
    try:
        yield calls
    finally:
        local_map_module.agree_over_mesh = real


@pytest.mark.distributed(world_size=2)
def test_uneven_and_data_dependent_outputs(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X = _rows(7)  # 4 and 3 rows on 2 ranks
    ref = X.clone().requires_grad_()
    kept_ref = ref[ref[:, 0] > 0]
    ((ref * 2).sum(1) ** 2).sum().backward()
    (kept_ref**3).sum().backward()

    doubled_rowsums = local_map(lambda t: ((t * 2).sum(1), t.shape[0]), ([Shard(0)], None), ([Shard(0)],))
    positives = local_map(lambda t: t[t[:, 0] > 0], [Shard(0)], ([Shard(0)],))
    x = distribute_tensor(X, mesh, [Shard(0)]).requires_grad_()
    with record_collectives() as log, _exchanges() as exchanges:
        y, local_rows = doubled_rowsums(x)
    assert local_rows == [4, 3][rank]
    assert y.shape == (7,) and y.placements == (Shard(0),)  # torch's local_map would say (8,)
    assert log.count() == 0 and exchanges == [1]  # one exchange of one int (the output's local size)
    torch.testing.assert_close(y.full_tensor(), (X * 2).sum(1))
    (y.full_tensor() ** 2).sum().backward()
    with _exchanges() as exchanges:
        kept = positives(x)  # each rank keeps its own number of rows: a ragged result
    assert exchanges == [2]
    assert kept.shape == kept_ref.shape
    torch.testing.assert_close(kept.full_tensor(), kept_ref.detach())
    (kept.full_tensor() ** 3).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad)
    # Later ops see the right global shape: a reduction over the ragged result.
    torch.testing.assert_close(kept.sum(0).full_tensor(), kept_ref.detach().sum(0))


@pytest.mark.distributed(world_size=2)
def test_several_outputs_share_one_exchange(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X = _rows(5)  # 3 and 2 rows

    def split_sign(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return t.clamp(min=0), t.clamp(max=0), t.sum(0)

    both = local_map(split_sign, ([Shard(0)], [Shard(0)], [Replicate()]), ([Shard(0)],))
    x = distribute_tensor(X, mesh, [Shard(0)])
    with _exchanges() as exchanges:
        pos, neg, _ = both(x)
    assert exchanges == [4]  # two sharded 2-D outputs, one exchange
    assert pos.shape == neg.shape == (5, 3)
    torch.testing.assert_close(pos.full_tensor() + neg.full_tensor(), X)

    # Evenly cut arguments (attention heads): even outputs assumed, as torch does; nothing exchanged.
    even = distribute_tensor(_rows(6), mesh, [Shard(0)])
    with _exchanges() as exchanges, record_collectives() as log:
        pos, _, _ = both(even)
    assert exchanges == [] and log.count() == 0
    assert pos.shape == (6, 3)
    torch.testing.assert_close(pos.full_tensor(), _rows(6).clamp(min=0))

    # Only replicated outputs: nothing to agree on.
    whole = local_map(lambda t: t * 2, [Replicate()], ([Replicate()],))
    with _exchanges() as exchanges:
        whole(distribute_tensor(X, mesh, [Replicate()]))
    assert exchanges == []


@pytest.mark.distributed(world_size=2)
def test_bad_outputs_and_dtensor_keywords(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X = _rows(4)
    x = distribute_tensor(X, mesh, [Shard(0)])
    # Ranks returning outputs of different dtypes from an unevenly cut argument (exchanged): every
    # rank raises, naming each coordinate's output.
    mixed = local_map(lambda t: t if rank == 0 else t.float(), [Shard(0)], ([Shard(0)],))
    with pytest.raises(ValueError, match="different outputs"):
        mixed(distribute_tensor(_rows(5), mesh, [Shard(0)]))
    # A DTensor keyword argument: torch hands func the DTensor; hp refuses it with the fix.
    scaled = local_map(lambda t, *, by: t * by, [Shard(0)], ([Shard(0)],))
    with pytest.raises(TypeError, match=r"keyword argument 'by' holds a DTensor.*by=<dtensor>.to_local\(\)"):
        scaled(x, by=distribute_tensor(X, mesh, [Shard(0)]))
    # Plain keyword arguments still pass untouched.
    torch.testing.assert_close(scaled(x, by=X[rank * 2 : rank * 2 + 2]).full_tensor(), X * X)

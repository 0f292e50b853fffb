"""StridedShard: the placement, its redistribution, and torch interop.

Every piece is checked against torch's own ``_StridedShard`` split (values,
uneven sizes included), every move against the full tensor, and the moves
that should be cheap by their collectives. The views that produce and
consume the placement are in ``test_strided_shard_views.py``.
"""

from __future__ import annotations

import pytest
import torch
from hp_dtensor import (
    DTensor,
    Layout,
    Partial,
    Replicate,
    Shard,
    StridedShard,
    distribute_tensor,
    explain_redistribute,
    from_torch_dtensor,
    to_torch_dtensor,
)
from hp_dtensor.layout import strided_rows, strided_sizes
from hp_dtensor.placements import as_placement
from hp_testing import record_collectives
from torch.distributed import tensor as td
from torch.distributed.tensor.placement_types import _StridedShard

R = Replicate()


def _torch_pieces(size: int, factor: int, parts: int) -> list[list[int]]:
    """The rows torch's ``_StridedShard`` gives each rank of a dim of ``size`` (its own split)."""
    pieces, _ = _StridedShard(0, split_factor=factor)._split_tensor(
        torch.arange(size), parts, with_padding=False, contiguous=True
    )
    return [piece.tolist() for piece in pieces]


def test_rows_are_torchs_for_even_and_uneven_sizes() -> None:
    for size in range(0, 14):
        for factor in (2, 3, 5):
            for parts in (2, 3, 4):
                expected = _torch_pieces(size, factor, parts)
                got = [strided_rows(size, factor, parts, r) for r in range(parts)]
                assert got == expected, (size, factor, parts)
                assert strided_sizes(size, factor, parts) == [len(p) for p in expected]


def test_equality_hash_repr_and_is_shard() -> None:
    s = StridedShard(1, split_factor=4)
    assert s == StridedShard(1, 4) and hash(s) == hash(StridedShard(1, 4))
    assert s != StridedShard(1, 2) and s != StridedShard(0, 4) and s != Shard(1)
    assert Shard(1) != s
    assert repr(s) == "StridedShard(dim=1, split_factor=4)" and str(s) == "_S(1, 4)"
    assert s.is_shard() and s.is_shard(1) and not s.is_shard(0)
    assert not isinstance(s, Shard) and not s.is_replicate() and not s.is_partial()
    theirs = _StridedShard(1, split_factor=4)
    assert s == theirs and hash(s) == hash(theirs)  # ours == torch's (torch's __eq__ knows only its own)
    assert as_placement(theirs, "x") == s
    assert as_placement(_StridedShard(1, split_factor=1), "x") == Shard(1)  # a factor of 1 is a plain cut
    assert Shard(1) != _StridedShard(1, split_factor=1)  # ... but, as in torch, not equal to one
    assert eval(s.__fx_repr__()[0], s.__fx_repr__()[1]) == s


def test_bad_placements() -> None:
    with pytest.raises(ValueError, match=r"split_factor=1\): split_factor must be at least 2.*Shard\(0\)"):
        StridedShard(0, 1)
    with pytest.raises(TypeError, match=r"split_factor must be an int, got float"):
        StridedShard(0, 2.0)  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=2)
def test_bad_layouts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.arange(12.0).view(6, 2)
    with pytest.raises(ValueError, match=r"StridedShard\(dim=2, split_factor=2\) is out of range for a 2-D"):
        distribute_tensor(x, mesh, [StridedShard(2, 2)])
    d = distribute_tensor(x, mesh, [StridedShard(-2, 3)])
    assert d.placements == (StridedShard(0, 3),)
    with pytest.raises(ValueError, match=r"holds _S\(0, 3\).*not one run with an offset.*redistribute"):
        d._layout.local_offset()
    with pytest.raises(ValueError, match=r"per-rank sizes .* StridedShard is always cut like torch.chunk"):
        Layout(mesh, [StridedShard(0, 3)], (6, 2), ragged=[(6, 2), (0, 2)])


@pytest.mark.distributed(world_size=4)
def test_strided_cut_above_another_cut_of_its_dim_is_refused(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    x = torch.arange(16.0).view(8, 2)
    with pytest.raises(ValueError, match=r"StridedShard must be the first \(lowest mesh dim\) cut"):
        distribute_tensor(x, mesh, [Shard(0), StridedShard(0, 2)])


def _pieces_match_torch(x: torch.Tensor, mesh, placements, torch_placements) -> DTensor:  # type: ignore[no-untyped-def]
    """Our pieces against torch's: its distribute_tensor on a 2-D mesh, its split on a 1-D one.

    (torch's ``distribute_tensor`` refuses uneven strided cuts; its split does not.)
    """
    ours = distribute_tensor(x, mesh, placements)
    if mesh.ndim == 1:
        pieces, _ = torch_placements[0]._split_tensor(x, mesh.size(), with_padding=False)
        theirs = pieces[mesh.get_local_rank(0)]
    else:
        theirs = td.distribute_tensor(x, mesh.to_torch(), torch_placements).to_local()
    torch.testing.assert_close(ours.to_local(), theirs, rtol=0, atol=0)
    torch.testing.assert_close(ours.full_tensor(), x, rtol=0, atol=0)
    return ours


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("shape", [(12, 3), (10, 3), (7, 2), (3, 2)])
def test_pieces_and_gather_1d(rank, device_mesh_factory, shape) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.arange(shape[0] * shape[1], dtype=torch.float64).view(shape)
    ours = _pieces_match_torch(x, mesh, [StridedShard(0, 3)], [_StridedShard(0, split_factor=3)])
    with record_collectives() as log:
        full = ours.redistribute(placements=[R])
    assert log.count("all_gather_into_tensor") == 1 and len(log) == 1
    torch.testing.assert_close(full.to_local(), x, rtol=0, atol=0)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("shape", [(24, 3), (10, 3)])
def test_pieces_and_moves_4_ranks(rank, device_mesh_factory, shape) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    x = torch.arange(shape[0] * shape[1], dtype=torch.float64).view(shape)
    ours = _pieces_match_torch(x, mesh, [StridedShard(0, 2)], [_StridedShard(0, split_factor=2)])
    _moves(ours, x)


def _moves(ours: DTensor, x: torch.Tensor) -> None:
    """Every move out of and into ``StridedShard(0, k)`` of a 2-D ``x``, against the full tensor."""
    placement = ours.placements[0]
    replicated = distribute_tensor(x, ours.device_mesh, [R])
    with record_collectives() as log:
        cut = replicated.redistribute(placements=[placement])
    assert len(log) == 0  # a replicated value is cut locally
    torch.testing.assert_close(cut.to_local(), ours.to_local(), rtol=0, atol=0)
    with record_collectives() as log:
        cols = ours.redistribute(placements=[Shard(1)])
    assert log.count("all_to_all_single") == 1 and len(log) == 1  # one all-to-all, then a local reorder
    expected = distribute_tensor(x, ours.device_mesh, [Shard(1)]).to_local()
    torch.testing.assert_close(cols.to_local(), expected, rtol=0, atol=0)
    rows = ours.redistribute(placements=[Shard(0)])
    torch.testing.assert_close(rows.to_local(), distribute_tensor(x, ours.device_mesh, [Shard(0)]).to_local())
    back = cols.redistribute(placements=[placement])
    torch.testing.assert_close(back.to_local(), ours.to_local(), rtol=0, atol=0)
    pending = ours.redistribute(placements=[R], async_op=True)
    torch.testing.assert_close(pending.to_local() + 0, x, rtol=0, atol=0)
    partial = distribute_tensor(x, ours.device_mesh, [R]).redistribute(placements=[Partial("sum")])
    torch.testing.assert_close(partial.redistribute(placements=[placement]).full_tensor(), x)


@pytest.mark.distributed(world_size=2)
def test_moves_2_ranks_uneven(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.arange(33, dtype=torch.float64).view(11, 3)
    _moves(distribute_tensor(x, mesh, [StridedShard(0, 3)]), x)


@pytest.mark.distributed(world_size=2)
def test_gradient_of_a_redistribution(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(10, 4, dtype=torch.float64)
    w = torch.randn(10, 4, dtype=torch.float64)
    d = distribute_tensor(x, mesh, [StridedShard(0, 2)]).requires_grad_()
    out = d.redistribute(placements=[Shard(1)])
    (out.full_tensor() * w).sum().backward()
    assert d.grad.placements == (StridedShard(0, 2),)
    torch.testing.assert_close(d.grad.full_tensor(), w)


@pytest.mark.distributed(world_size=4)
def test_2d_mesh_torchs_fsdp_tp_layout(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """[_S(0, 2), S(0)]: torch's layout of a TP-cut parameter FSDP cuts again (right-to-left)."""
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    x = torch.arange(8 * 3, dtype=torch.float64).view(8, 3)
    ours = _pieces_match_torch(
        x, mesh, [StridedShard(0, 2), Shard(0)], [_StridedShard(0, split_factor=2), td.Shard(0)]
    )
    # mesh dim 1's coordinate c holds rows [4c, 4c + 4): torch's point of the layout
    tp = mesh.get_local_rank(1)
    dp = mesh.get_local_rank(0)
    torch.testing.assert_close(ours.to_local(), x[4 * tp + 2 * dp : 4 * tp + 2 * dp + 2], rtol=0, atol=0)
    for target in ([R, R], [R, Shard(0)], [Shard(1), Shard(0)], [Shard(0), R], [R, StridedShard(1, 3)]):
        moved = ours.redistribute(placements=target)
        expected = distribute_tensor(x, mesh, target).to_local()
        torch.testing.assert_close(moved.to_local(), expected, rtol=0, atol=0, msg=str(target))
    plan = explain_redistribute(ours, [R, R])
    assert [s.mesh_dim for s in plan.steps] == [1, 0]  # the higher (Shard) cut is gathered first


@pytest.mark.distributed(world_size=4)
def test_2d_mesh_plan_never_nests_a_strided_cut_wrongly(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """[S(0), R] -> [R, _S(0, 2)]: a plan through [S(0), _S(0, 2)] would gather mesh dim 0 under it."""
    mesh = device_mesh_factory((2, 2))
    x = torch.arange(12 * 2, dtype=torch.float64).view(12, 2)
    for src, dst in (
        ([Shard(0), R], [R, StridedShard(0, 2)]),
        ([Shard(0), Shard(1)], [Shard(1), StridedShard(0, 3)]),
        ([Partial("sum"), R], [R, StridedShard(0, 2)]),
        ([R, StridedShard(0, 2)], [Shard(0), R]),
    ):
        start = distribute_tensor(x, mesh, [R, R]).redistribute(placements=src)
        moved = start.redistribute(placements=dst)
        expected = distribute_tensor(x, mesh, dst).to_local()
        torch.testing.assert_close(moved.to_local(), expected, rtol=0, atol=0, msg=f"{src} -> {dst}")
        torch.testing.assert_close(moved.full_tensor(), x, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_torch_interop_both_ways(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for shape, factor in (((12, 3), 3), ((12, 2), 2)):  # torch's distribute_tensor takes even cuts only
        x = torch.randn(*shape, dtype=torch.float64)
        ours = distribute_tensor(x, mesh, [StridedShard(0, factor)]).requires_grad_()
        theirs = to_torch_dtensor(ours)
        assert theirs.placements == (_StridedShard(0, split_factor=factor),)
        torch.testing.assert_close(theirs.full_tensor(), x, rtol=0, atol=0)  # torch's own gather
        native = td.distribute_tensor(x, mesh.to_torch(), [_StridedShard(0, split_factor=factor)])
        back = from_torch_dtensor(native, mesh)
        assert back.placements == (StridedShard(0, factor),) and back.shape == x.shape
        torch.testing.assert_close(back.to_local(), ours.to_local(), rtol=0, atol=0)
        torch.testing.assert_close(back.full_tensor(), x, rtol=0, atol=0)
        (theirs.full_tensor() * 2).sum().backward()  # differentiable through the conversion
        torch.testing.assert_close(ours.grad.full_tensor(), torch.full_like(x, 2.0))
    one = td.distribute_tensor(x, mesh.to_torch(), [_StridedShard(0, split_factor=1)])
    assert from_torch_dtensor(one, mesh).placements == (Shard(0),)

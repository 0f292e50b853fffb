"""Elementwise ops between a ``StridedShard`` operand and one of another shape (broadcasting).

Broadcast dims are aligned from the right, so a ``(6, 4)`` tensor cut
``StridedShard(0, 3)`` times a ``(4,)``, ``(1, 4)`` or ``(6, 1)`` one keeps
the strided cut: an operand that lacks the cut dim or has size 1 there stays
whole, one that has it is cut alike (locally, from a replicated value). A
strided operand of lower rank cuts the output's matching dim. Values and
gradients against plain tensors; collectives counted where none should happen.
"""

from __future__ import annotations

import pytest
import torch
from hp_dtensor import Replicate, Shard, StridedShard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

R = Replicate()


def _leaf(t: torch.Tensor, mesh, placements):  # type: ignore[no-untyped-def]
    return distribute_tensor(t, mesh, list(placements)).detach().requires_grad_()


def _check_product(mesh, a_shape, a_cut, b_shape, b_cut, out_cut, moves: bool = False) -> None:  # type: ignore[no-untyped-def]
    """``a * b + b`` and its gradients as plain; ``out_cut`` kept and, unless ``moves``, nothing sent."""
    torch.manual_seed(len(a_shape) * 10 + len(b_shape))
    a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    expected = ra * rb + rb
    grad = torch.randn(expected.shape, dtype=torch.float64)
    expected.backward(grad)
    da, db = _leaf(a, mesh, a_cut), _leaf(b, mesh, b_cut)
    with record_collectives() as log, fallback_policy("error"):
        out = da * db + db
    assert out.placements == tuple(out_cut)
    if not moves:
        assert len(log) == 0, log.counts()
    torch.testing.assert_close(out.full_tensor(), expected.detach(), rtol=0, atol=0)
    out.backward(distribute_tensor(grad, mesh, list(out_cut)))
    assert da.grad is not None and db.grad is not None
    torch.testing.assert_close(da.grad.full_tensor(), ra.grad)
    torch.testing.assert_close(db.grad.full_tensor(), rb.grad)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("other", [(4,), (1, 4), (6, 1), (1, 1), ()])
def test_broadcast_partner_keeps_strided_cut(rank, device_mesh_factory, other) -> None:  # type: ignore[no-untyped-def]
    """``(6, 4)`` cut ``StridedShard(0, 3)`` times a replicated ``other``: the cut kept, nothing moved."""
    mesh = device_mesh_factory((2,))
    _check_product(mesh, (6, 4), [StridedShard(0, 3)], other, [R], [StridedShard(0, 3)])


@pytest.mark.distributed(world_size=2)
def test_strided_cut_of_the_inner_dim_against_a_column(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``(6, 4)`` cut ``StridedShard(1, 2)`` times a ``(6, 1)`` column, broadcast along the cut dim."""
    mesh = device_mesh_factory((2,))
    _check_product(mesh, (6, 4), [StridedShard(1, 2)], (6, 1), [R], [StridedShard(1, 2)])


@pytest.mark.distributed(world_size=2)
def test_partner_with_the_cut_dim_is_cut_alike(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A ``(6, 1)`` partner cut the same strided way, and a replicated ``(2, 6, 4)`` one around it."""
    mesh = device_mesh_factory((2,))
    cut = [StridedShard(0, 3)]
    _check_product(mesh, (6, 4), cut, (6, 1), cut, cut)
    # a strided operand of lower rank cuts the output's matching dim; the partner is cut locally
    _check_product(mesh, (6, 4), cut, (2, 6, 4), [R], [StridedShard(1, 3)])
    _check_product(mesh, (2, 6, 4), [R], (6, 4), cut, [StridedShard(1, 3)])
    _check_product(mesh, (4,), [StridedShard(0, 2)], (6, 4), [R], [StridedShard(1, 2)])


@pytest.mark.distributed(world_size=2)
def test_plain_shard_partner_is_moved_to_the_strided_rows(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A ``(6, 1)`` partner cut ``Shard(0)`` holds other rows than the strided cut: moved, values right."""
    mesh = device_mesh_factory((2,))
    _check_product(mesh, (6, 4), [StridedShard(0, 3)], (6, 1), [Shard(0)], [StridedShard(0, 3)], moves=True)


@pytest.mark.distributed(world_size=2)
def test_two_strided_cuts_of_other_dims_are_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Two strided operands cutting different output dims on one mesh dim: no one view fits, values right."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(5)
    a, b = torch.randn(6, 1), torch.randn(6, 4)
    da = distribute_tensor(a, mesh, [StridedShard(0, 3)])
    db = distribute_tensor(b, mesh, [StridedShard(1, 2)])
    torch.testing.assert_close((da * db).full_tensor(), a * b, rtol=0, atol=0)
    # the same factor on dims that broadcasting aligns differently: (6, 6) rows against (6,) columns
    c, d = torch.randn(6, 6), torch.randn(6)
    dc = distribute_tensor(c, mesh, [StridedShard(0, 3)])
    dd = distribute_tensor(d, mesh, [StridedShard(0, 3)])
    torch.testing.assert_close((dc + dd).full_tensor(), c + d, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_inplace_broadcast_keeps_strided_destination(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``x.mul_(row)`` / ``copy_`` of a broadcast source into a strided destination: nothing moved."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(6)
    x, row = torch.randn(6, 4), torch.randn(4)
    dx = distribute_tensor(x, mesh, [StridedShard(0, 3)])
    drow = distribute_tensor(row, mesh, [R])
    dy = distribute_tensor(torch.zeros(6, 4), mesh, [StridedShard(0, 3)])
    with record_collectives() as log, fallback_policy("error"):
        dx.mul_(drow)
        dy.copy_(drow)
    assert len(log) == 0, log.counts()
    assert dx.placements == (StridedShard(0, 3),) and dy.placements == (StridedShard(0, 3),)
    torch.testing.assert_close(dx.full_tensor(), x * row, rtol=0, atol=0)
    torch.testing.assert_close(dy.full_tensor(), row.expand(6, 4), rtol=0, atol=0)


@pytest.mark.distributed(world_size=4)
def test_broadcast_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``[StridedShard(0, 3), Shard(1)]`` times a replicated row: both cuts kept, nothing sent."""
    mesh = device_mesh_factory((2, 2))
    _check_product(mesh, (6, 4), [StridedShard(0, 3), Shard(1)], (4,), [R, R], [StridedShard(0, 3), Shard(1)])


@pytest.mark.distributed(world_size=4)
def test_fsdp_tp_layout_is_kept(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """torch's FSDP2 + TP layout ``[StridedShard(0, 2), Shard(0)]``: a Shard above the strided cut of its dim.

    Elementwise ops cut every operand of that dim alike on both mesh dims, so
    the nested layout is kept (nothing sent with a broadcast or alike-cut
    partner); a partner cut another way is moved to it, values right.
    """
    mesh = device_mesh_factory((2, 2))
    fsdp_tp = [StridedShard(0, 2), Shard(0)]
    _check_product(mesh, (8, 4), fsdp_tp, (4,), [R, R], fsdp_tp)
    _check_product(mesh, (8, 4), fsdp_tp, (8, 1), fsdp_tp, fsdp_tp)
    _check_product(mesh, (8, 4), fsdp_tp, (8, 1), [R, R], fsdp_tp)
    _check_product(mesh, (8, 4), fsdp_tp, (8, 4), [Shard(0), R], fsdp_tp, moves=True)
    _check_product(mesh, (8, 4), [StridedShard(0, 2), R], (8, 4), [R, Shard(0)], fsdp_tp, moves=True)

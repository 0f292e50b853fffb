"""In-place writes into views whose pieces had to be moved reach the tensor they came from.

A slice across a cut dim, a select of another rank's row, a merge of dims no
placement keeps: their view rules return copies, and a write into one used to
be lost silently (``x[2:4].add_(1)`` on a ``Shard(0)`` tensor left ``x``
unchanged). Each case runs the same code on a plain tensor and on DTensors
and compares the whole value afterwards, then a gradient through such writes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hp_dtensor import Replicate, Shard, distribute_tensor

S0, S1, R = Shard(0), Shard(1), Replicate()

# name: (make the value, placements, the writes)
CASES: dict[str, tuple[Callable[[], torch.Tensor], list, Callable[[torch.Tensor], object]]] = {
    "slice of the cut dim, one rank's rows": (lambda: torch.zeros(5, 5), [S0], lambda d: d[4:5].sub_(1)),
    "slice of the cut dim, across ranks": (lambda: torch.zeros(6, 5), [S0], lambda d: d[2:4].add_(1)),
    "setitem of a slice": (lambda: torch.zeros(6, 4), [S0], lambda d: d.__setitem__(slice(1, 5), 7.0)),
    "setitem of a tensor": (
        lambda: torch.zeros(6, 4),
        [S0],
        lambda d: d.__setitem__(slice(1, 5), torch.arange(16.0).view(4, 4)),
    ),
    "select of a row": (lambda: torch.zeros(6, 4), [S0], lambda d: d[3].add_(1)),
    "narrow of a column cut": (lambda: torch.zeros(6, 4), [S1], lambda d: d.narrow(1, 1, 2).mul_(0).add_(3)),
    "as_strided": (lambda: torch.zeros(4), [S0], lambda d: d.as_strided((2,), (2,)).add_(1)),
    "chained views": (lambda: torch.zeros(6, 4), [S0], lambda d: d[1:5][:, 2].add_(5)),
    "slice of a slice": (lambda: torch.zeros(8, 3), [S0], lambda d: d[1:7][2:5].mul_(0).add_(2)),
    "unbind": (lambda: torch.zeros(4, 3), [S0], lambda d: d.unbind(0)[2].add_(4)),
    "split": (lambda: torch.zeros(7, 3), [S0], lambda d: d.split(3)[1].add_(1)),
    "chunk": (lambda: torch.zeros(7, 3), [S0], lambda d: d.chunk(2)[1].fill_(9)),
    "diagonal of a row cut": (lambda: torch.zeros(5, 5), [S0], lambda d: d.diagonal().add_(1)),
    "several writes": (
        lambda: torch.zeros(6, 4),
        [S0],
        lambda d: (d[2:4].add_(1), d[3].mul_(3), d[0:6:2].sub_(2)),
    ),
}


@pytest.mark.distributed(world_size=2)
def test_writes_into_moved_views_reach_the_base(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    for name, (make, placements, write) in CASES.items():
        expected = make()
        write(expected)
        d = distribute_tensor(make(), mesh, placements)
        write(d)
        assert d.placements == tuple(placements), f"{name}: the base moved to {d.placements}"
        torch.testing.assert_close(d.full_tensor(), expected, rtol=0, atol=0, msg=name)


@pytest.mark.distributed(world_size=4)
def test_writes_into_moved_views_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    expected = torch.arange(35.0).view(7, 5)
    d = distribute_tensor(expected.clone(), mesh, [S0, S1])
    for t in (expected, d):
        t[2:6, 1:4].mul_(-1)
        t[5].add_(100)
    torch.testing.assert_close(d.full_tensor(), expected, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_a_gradient_through_writes_into_moved_views(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    w, x = torch.randn(6, 4), torch.randn(2, 4)

    def step(w_leaf: torch.Tensor, x_leaf: torch.Tensor) -> torch.Tensor:
        y = w_leaf * 2
        y[2:4] = x_leaf * 3  # a write across the cut
        y[5].mul_(x_leaf[0])  # a write into one rank's row
        return (y * y).sum()

    w_ref, x_ref = w.clone().requires_grad_(), x.clone().requires_grad_()
    step(w_ref, x_ref).backward()
    w_dt = distribute_tensor(w.clone(), mesh, [S0]).requires_grad_()
    x_dt = distribute_tensor(x.clone(), mesh, [R]).requires_grad_()
    loss = step(w_dt, x_dt)
    torch.testing.assert_close(loss.full_tensor(), step(w, x))
    loss.backward()
    torch.testing.assert_close(w_dt.grad.full_tensor(), w_ref.grad)
    torch.testing.assert_close(x_dt.grad.full_tensor(), x_ref.grad)


@pytest.mark.distributed(world_size=2)
def test_a_write_that_cannot_be_written_back_is_an_error_on_every_rank(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    d = distribute_tensor(torch.zeros(8), mesh, [S0])
    windows = d.unfold(0, 2, 2)  # windows across the cut: a copy
    with pytest.raises(
        NotImplementedError, match=r"aten\.unfold\.default: this view's pieces had to be moved"
    ):
        windows.add_(1)


@pytest.mark.distributed(world_size=2)
def test_writes_into_the_base_reach_its_moved_views(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    expected = torch.arange(24.0).view(6, 4)
    d = distribute_tensor(expected.clone(), mesh, [S0])
    views = []
    for t in (expected, d):
        rows, row, inner = t[2:4], t[3], t[1:5][:, 2]
        t.mul_(2)  # after the views were taken
        t[0].add_(1)  # a write through another view
        views.append((rows, row, inner))
    for got, want in zip(views[1], views[0], strict=True):
        torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)
    torch.testing.assert_close(d.full_tensor(), expected, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_a_saved_moved_view_changed_by_a_write_is_refused_by_autograd(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """As for a plain tensor (autograd counts the moved view as a view of its base): no stale gradient."""
    mesh = device_mesh_factory((2,))
    w = distribute_tensor(torch.randn(6, 4), mesh, [S0]).requires_grad_()
    y = w * 1
    loss = (y[2:4] * y[2:4]).sum()  # saves the moved view
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

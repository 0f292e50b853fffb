"""Pointwise, foreach and shape ops send nothing where torch's DTensor sends nothing (2 ranks).

Each case runs the op on plain tensors and on DTensors: values and
gradients must match the plain run, and the DTensor call must issue no
collective. Every case is one where torch's DTensor (``CommDebugMode``)
sends nothing too, or (a cut dim of global size 1) sends a gather: the bar
is "no more than torch" (``scripts/op_db_sweep.py`` prints both). Sizes are
uneven over 2 ranks (5, 3, 1 and 0 rows) unless said otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import Partial, Placement, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


def check_local(
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Placement],
    mesh: Any,
    *,
    expect: Sequence[Placement] | None = None,
    grad: bool = True,
) -> Any:
    """Values and gradients against plain tensors, no collective in the forward call, never the fallback."""
    return check(fn, inputs, placements, mesh, local_backward=False, expect=expect, grad=grad)


# -- pointwise: a cut dim of global size 1 or 0 stays cut ---------------------------------------


@pytest.mark.distributed(world_size=2)
def test_pointwise_keeps_cut_with_empty_pieces(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    check_local(torch.exp, [torch.empty(1, 0, 3)], [S0], mesh, expect=[S0], grad=False)
    check_local(torch.sigmoid, [torch.randn(1, 4)], [S0], mesh, expect=[S0])
    check_local(lambda a, b: a * b + 1, [torch.randn(1, 4), torch.randn(1, 4)], [S0, R], mesh, expect=[S0])
    check_local(lambda a, b: a - b, [torch.randn(1, 4), torch.randn(4)], [S0, R], mesh, expect=[S0])
    check_local(lambda a: torch.nan_to_num(a.log()), [torch.randn(3, 1)], [S1], mesh, expect=[S1])


@pytest.mark.distributed(world_size=2)
def test_inplace_on_a_cut_size_one_dim_keeps_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A (1, 2) grad on Shard(0): rank 1 holds no row, and ``add_`` must not gather and rewrite it."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    grad, update = torch.randn(1, 2), torch.randn(1, 2)
    target = distribute_tensor(grad.clone(), mesh, [S0])
    step = distribute_tensor(update, mesh, [R])
    with record_collectives() as log:
        target.add_(step, alpha=0.5)
        target.mul_(2.0)
    assert len(log) == 0
    assert target.placements == (S0,)
    assert target.to_local().shape == ((1, 2) if rank == 0 else (0, 2))
    torch.testing.assert_close(target.full_tensor(), (grad + 0.5 * update) * 2.0)


# -- foreach --------------------------------------------------------------------------------------


def _foreach_lists() -> list[torch.Tensor]:
    return [torch.randn(n, n) for n in (5, 3, 2, 1)]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("cut", [S0, S1])
def test_foreach_ops_keep_every_member_cut(rank, device_mesh_factory, cut) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    xs, ys = _foreach_lists(), _foreach_lists()
    n = len(xs)
    check_local(lambda *t: torch._foreach_exp(list(t)), xs, [cut] * n, mesh, grad=False)
    check_local(
        lambda *t: torch._foreach_add(list(t[:n]), list(t[n:]), alpha=2.0),
        xs + ys,
        [cut] * (2 * n),
        mesh,
        grad=False,
    )
    check_local(
        lambda *t: torch._foreach_lerp(list(t[:n]), list(t[n:]), 0.3),
        xs + ys,
        [cut] * (2 * n),
        mesh,
        grad=False,
    )
    # _foreach_maximum is pointwise (it was taken for the _foreach_max reduction and fell back)
    check_local(lambda *t: torch._foreach_maximum(list(t[:n]), list(t[n:])), xs + ys, [cut] * (2 * n), mesh)
    check_local(lambda *t: torch._foreach_maximum(list(t), 0.1), xs, [cut] * n, mesh)
    targets = [distribute_tensor(x.clone(), mesh, [cut]) for x in xs]
    others = [distribute_tensor(y.clone(), mesh, [cut]) for y in ys]
    with record_collectives() as log:
        torch._foreach_addcmul_(targets, others, others, value=0.5)
        torch._foreach_zero_(others)
    assert len(log) == 0
    for t, x, y in zip(targets, xs, ys, strict=True):
        assert t.placements == (cut,)
        torch.testing.assert_close(t.full_tensor(), x + 0.5 * y * y)


@pytest.mark.distributed(world_size=2)
def test_foreach_mm_is_a_list_of_matmuls(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b, c, d = torch.randn(5, 4), torch.randn(3, 2), torch.randn(4, 6), torch.randn(2, 3)
    fmm = lambda a, b, c, d: torch._foreach_mm([a, b], [c, d])  # noqa: E731
    out = check_local(fmm, [a, b, c, d], [S0, S0, R, R], mesh)
    assert [o.placements for o in out] == [(S0,), (S0,)]
    # rows cut on the left, columns on the right: a partial sum, still no collective
    out = check_local(fmm, [a, b, c, d], [S1, S1, S0, S0], mesh)
    assert [o.placements for o in out] == [(Partial("sum"),)] * 2


# -- shape ops ------------------------------------------------------------------------------------


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("cut", [S0, S1, S2])
def test_shape_ops_local_off_their_dims(rank, device_mesh_factory, cut) -> None:  # type: ignore[no-untyped-def]
    """Every op below is applied on a dim other than ``cut`` (or keeps ``cut`` whole): no collective."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4)
    d = cut.dim
    o1, o2 = (e for e in range(3) if e != d)  # the two dims that are not cut
    cases: list[Callable[..., Any]] = [
        lambda t: t.flip(o1),
        lambda t: torch.flipud(t) if d == 1 else torch.fliplr(t),
        lambda t: t.roll(2, o1),
        lambda t: t.rot90(1, [d, o1]),
        lambda t: t.rot90(3, [o1, d]),
        lambda t: torch.nn.functional.pad(t, [1, 2] if d != 2 else [0, 0, 2, 1]),
        lambda t: t.unbind(o1),
        lambda t: torch.unbind_copy(t, o1),
        lambda t: torch.unsafe_chunk(t, 2, o1),
        lambda t: torch.unsafe_split(t, 2, o1),
        lambda t: torch.split_with_sizes_copy(t, [1, x.shape[o1] - 1], o1),
        lambda t: torch.narrow_copy(t, o1, 1, 2),
        lambda t: t.narrow(d, 0, x.shape[d]),
        lambda t: t[(slice(None),) * d + (slice(0, None),)],
        lambda t: torch.narrow_copy(t, d, 0, x.shape[d]),
        lambda t: torch.alias_copy(t),
        lambda t: torch.permute_copy(t, (2, 0, 1)),
        lambda t: torch.transpose_copy(t, o1, o2),
        lambda t: torch.t_copy(t.select(o1, 1)),
        lambda t: torch.unsqueeze_copy(t, 1),
        lambda t: torch.squeeze_copy(t.unsqueeze(3)),
        lambda t: torch.squeeze_copy(t.unsqueeze(3), 3),
        lambda t: torch.expand_copy(t.unsqueeze(0), (2, 5, 3, 4)),
        lambda t: torch.diff(t, dim=o1),
    ]
    for fn in cases:
        check_local(fn, [x], [cut], mesh)


@pytest.mark.distributed(world_size=2)
def test_view_copy_and_whole_slices_keep_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 4, 3)
    check_local(lambda t: torch.view_copy(t, (5, 12)), [x], [S0], mesh, expect=[S0])
    check_local(lambda t: t[0:], [torch.randn(3)], [S0], mesh, expect=[S0])
    check_local(lambda t: t.narrow(0, 0, 5), [x], [S0], mesh, expect=[S0])
    check_local(lambda t: t.roll(0, 0), [x], [S0], mesh, expect=[S0])


@pytest.mark.distributed(world_size=2)
def test_scatters_write_their_own_rows(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 4, 3)
    for cut in (S0, S2):
        check_local(lambda t, s: torch.select_scatter(t, s, 1, 2), [x, torch.randn(5, 3)], [cut, R], mesh)
        check_local(
            lambda t, s: torch.slice_scatter(t, s, 1, 1, 3), [x, torch.randn(5, 2, 3)], [cut, R], mesh
        )
    out = check_local(
        lambda t, s: torch.slice_scatter(t, s, 0, 0, 5), [x, torch.randn(5, 4, 3)], [S1, S1], mesh
    )
    assert out.placements == (S1,)


@pytest.mark.distributed(world_size=2)
def test_named_dims_that_are_cut_are_gathered(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The rules still gather when the op reads across the cut (values checked, one gather each)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 4, 3)
    cases = [
        (lambda t: t.flip(0), S0),
        (lambda t: t.roll(2, 0), S0),
        (lambda t: t.rot90(1, [0, 1]), S1),
        (lambda t: t.unbind(0), S0),
        (lambda t: torch.view_as_complex(t[..., :2].contiguous()), S2),
        (lambda t: torch.select_scatter(t, torch.ones(5, 3), 1, 0), S1),
    ]
    for fn, cut in cases:
        dt = distribute_tensor(x.clone(), mesh, [cut])
        with record_collectives() as log:
            out = fn(dt)
        assert log.count() == 1, (fn, list(log))
        for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(fn(x.clone())), strict=True):
            torch.testing.assert_close(o.full_tensor(), r)
    # a constant pad of the cut dim pads the end pieces locally (each rank's rows line up)
    dt = distribute_tensor(x.clone(), mesh, [S2])
    with record_collectives() as log:
        out = torch.nn.functional.pad(dt, [1, 1])
    assert log.count() == 0 and out.placements == (S2,), (list(log), out.placements)
    torch.testing.assert_close(out.full_tensor(), torch.nn.functional.pad(x, [1, 1]))


@pytest.mark.distributed(world_size=2)
def test_complex_views_keep_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Rotary embeddings: view_as_complex, a complex product, view_as_real, all on each rank's rows."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, 2)
    freqs = torch.polar(torch.ones(3, 4), torch.randn(3, 4))

    def rotary(t: Any) -> Any:
        rotated = torch.view_as_complex(t) * freqs
        return torch.view_as_real(rotated).flatten(2)

    for cut in (S0, S1):
        check_local(rotary, [x], [cut], mesh, expect=[cut])
    check_local(
        lambda a, b: torch.complex(a, b), [torch.randn(5, 3), torch.randn(3)], [S0, R], mesh, expect=[S0]
    )
    check_local(
        lambda a, b: torch.polar(a, b), [torch.randn(5, 3), torch.randn(5, 3)], [S1, S1], mesh, expect=[S1]
    )


@pytest.mark.distributed(world_size=2)
def test_stack_keeps_a_shared_partial(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    da, db = distribute_tensor(a, mesh, [S0]), distribute_tensor(b, mesh, [S0])
    sa, sb = da.sum(0), db.sum(0)
    assert sa.placements == (Partial("sum"),)
    replicated = distribute_tensor(torch.ones(3), mesh, [R])
    with record_collectives() as log:
        out = torch.stack([sa, replicated, sb], dim=1)
    assert len(log) == 0
    assert out.placements == (Partial("sum"),)
    torch.testing.assert_close(out.full_tensor(), torch.stack([a.sum(0), torch.ones(3), b.sum(0)], dim=1))


@pytest.mark.distributed(world_size=2)
def test_slice_and_select_backward_keep_other_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The backward of a slice or select off the cut dim is local (it took the fallback)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    check(lambda t: t[:, 1:5:2], [x], [S0], mesh, expect=[S0])
    check(lambda t: t[:, 2], [x], [S0], mesh, expect=[S0])
    check(lambda t: t[:, 2], [x], [S2], mesh, expect=[S1])
    check(lambda t: t.narrow(2, 1, 2), [x], [S1], mesh, expect=[S1])
    # along the cut dim the pieces move (forward and backward communicate), values stay right
    check(lambda t: t[1:4], [x], [S0], mesh, local=False)

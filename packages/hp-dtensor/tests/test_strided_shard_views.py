"""Views that merge a cut inner dim give StridedShard with no communication; its consumers.

``view`` of ``S(1)`` (5, 5, 5) to (25, 5), ``flatten`` of a cut last dim and
the like used to gather the whole tensor; now they communicate nothing, the
view that splits the dim again gives the ``Shard`` back (no communication
either), elementwise ops and reductions over other dims keep the cut, and any
other op gathers only when it needs to. Values and gradients are checked
against full tensors (``op_compare.check``: warnings are errors, so no case
takes the fallback), collectives are counted, and the placements match
torch's DTensor where torch produces a ``_StridedShard`` too.

The dispatcher asks rules through :func:`hp_dtensor.ops.strided.decide`
([Note: rules and strided shards]).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import (
    Partial,
    Replicate,
    Shard,
    StridedShard,
    distribute_tensor,
    fallback_policy,
    fallback_stats,
    from_torch_dtensor,
)
from hp_testing import record_collectives
from torch.distributed import tensor as td

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R = Replicate()
NO_COMM: dict[str, int] = {}


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(0, 1)


# name: (input shape, input cut dim, view, output placement); every case moves nothing
MERGES = {
    "view (5, 5, 5) S(1) -> (25, 5)": ((5, 5, 5), 1, lambda t: t.view(25, 5), StridedShard(0, 5)),
    "flatten (4, 6, 3) S(2)": ((4, 6, 3), 2, lambda t: t.flatten(), StridedShard(0, 24)),
    "flatten(0, 1) (3, 4, 2) S(1)": ((3, 4, 2), 1, lambda t: t.flatten(0, 1), StridedShard(0, 3)),
    "reshape (6, 4) S(1) -> (2, 12)": ((6, 4), 1, lambda t: t.reshape(2, 12), StridedShard(1, 3)),
    "ravel (3, 4) S(1)": ((3, 4), 1, lambda t: t.ravel(), StridedShard(0, 3)),
    "head merge (2, 3, 4, 5) S(2) (already a Shard)": ((2, 3, 4, 5), 2, lambda t: t.flatten(2), Shard(2)),
    "round trip view (25, 5) -> (5, 5, 5)": ((5, 5, 5), 1, lambda t: t.view(25, 5).view(5, 5, 5), Shard(1)),
    "round trip flatten / unflatten": ((3, 4, 2), 1, lambda t: _flat(t).unflatten(0, (3, 4)), Shard(1)),
    "merge, transpose, split": (
        (3, 4, 2),
        1,
        lambda t: t.flatten(0, 1).t().reshape(2, 3, 4),
        Shard(2),
    ),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(MERGES))
def test_merges_move_nothing(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    shape, dim, fn, expect = MERGES[name]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    before = fallback_stats()
    with fallback_policy("error"):
        out = check(
            fn,
            [torch.randn(*shape, dtype=torch.float64)],
            [[Shard(dim)]],
            mesh,
            expect=[expect],
            forward_collectives=NO_COMM,
            tag=name,
        )
    assert fallback_stats() == before
    assert out.placements == (expect,)


@pytest.mark.distributed(world_size=2)
def test_merges_match_torchs_dtensor(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for name in list(MERGES)[:3]:
        shape, dim, fn, expect = MERGES[name]
        x = torch.randn(*shape, dtype=torch.float64)
        ours = fn(distribute_tensor(x, mesh, [Shard(dim)]))
        theirs = fn(td.distribute_tensor(x, mesh.to_torch(), [td.Shard(dim)]))
        assert ours.placements == (expect,), name
        assert ours.placements[0] == theirs.placements[0], name  # (torch's __eq__ knows only its own)
        torch.testing.assert_close(ours.to_local(), theirs.to_local(), rtol=0, atol=0, msg=name)
        back = from_torch_dtensor(theirs, mesh)
        assert back.placements == (expect,)
        torch.testing.assert_close(fn(back.view(shape)).full_tensor(), fn(x), rtol=0, atol=0)


# name: (input shape, view, input cut dim): no StridedShard describes the result, so it is gathered
GATHERED = {
    "uneven outer dim (5, 5, 5) S(0) -> (25, 5)": ((5, 5, 5), lambda t: t.reshape(25, 5), 0),
    "pieces of a block that differ (5, 5, 2) S(1) -> (50,)": ((5, 5, 2), lambda t: t.reshape(50), 1),
    "strided dim merged again unevenly": ((5, 5, 5), lambda t: t.view(25, 5).reshape(125), 1),
}


@pytest.mark.distributed(world_size=2)
def test_views_no_cut_describes_are_gathered_and_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for name, (shape, fn, dim) in GATHERED.items():
        out = check(fn, [torch.randn(*shape, dtype=torch.float64)], [[Shard(dim)]], mesh, tag=name)
        assert out.placements == (R,), f"{name}: {out.placements}"


# name: (fn of the (4, 6, 2) input cut on dim 1 and a (24, 2) operand, operand placement, output)
CONSUMERS = {
    "mul by itself": (lambda t, u: _flat(t) * _flat(t), R, StridedShard(0, 4)),
    "add a replicated operand": (lambda t, u: _flat(t) + u, R, StridedShard(0, 4)),
    "where with the same cut": (lambda t, u: torch.where(u > 0, _flat(t), -u), "same", StridedShard(0, 4)),
    "sum over the other dim": (lambda t, u: _flat(t).sum(-1), R, StridedShard(0, 4)),
    "amax over the other dim keepdim": (lambda t, u: _flat(t).amax(1, keepdim=True), R, StridedShard(0, 4)),
    "sum over the cut dim": (lambda t, u: _flat(t).sum(0), R, Partial("sum")),
    "mean over the cut dim": (lambda t, u: _flat(t).mean(0), R, Partial("avg")),
    "transpose": (lambda t, u: _flat(t).t() * 3, R, StridedShard(1, 4)),
    "unsqueeze then view back": (lambda t, u: _flat(t).unsqueeze(0).view(4, 6, 2), R, Shard(1)),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(CONSUMERS))
def test_consumers_keep_the_cut(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    fn, other, expect = CONSUMERS[name]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, u = torch.randn(4, 6, 2, dtype=torch.float64), torch.randn(24, 2, dtype=torch.float64)
    if other == "same":
        u_placement: Any = StridedShard(0, 4)
    else:
        u_placement = other
    with fallback_policy("error"):
        placements = [[Shard(1)], [u_placement]]
        check(fn, [x, u], placements, mesh, expect=[expect], forward_collectives=NO_COMM, tag=name)


@pytest.mark.distributed(world_size=2)
def test_other_consumers_gather_once_and_are_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Ops whose rules do not read StridedShard get it gathered (what the merge view used to do)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, 2, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    with fallback_policy("error"):
        for name, fn in (
            ("softmax", lambda t, v: _flat(t).softmax(-1)),
            ("matmul", lambda t, v: _flat(t) @ v),
            ("cumsum along the cut dim", lambda t, v: _flat(t).cumsum(0)),
        ):
            gather = {"all_gather_into_tensor": 1}
            check(fn, [x, w], [[Shard(1)], [R]], mesh, forward_collectives=gather, tag=name)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("shape", [(4, 8, 3), (3, 6, 2), (2, 5, 4)])
def test_merges_4_ranks(rank, device_mesh_factory, shape) -> None:  # type: ignore[no-untyped-def]
    """Uneven cuts too: each block of the merged dim is cut as the input dim was (6 rows: 2, 2, 2, 0)."""
    mesh = device_mesh_factory((4,))
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    out = check(lambda t: _flat(t).view(shape) * 2, [x], [[Shard(1)]], mesh, forward_collectives=NO_COMM)
    assert out.placements == (Shard(1),)
    merged = check(lambda t: _flat(t) + 1, [x], [[Shard(1)]], mesh, forward_collectives=NO_COMM)
    assert merged.placements == (StridedShard(0, shape[0]),), merged.placements


@pytest.mark.distributed(world_size=4)
def test_merges_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    cases = [
        ([Shard(1), R], lambda t: t.flatten(0, 1) * 2, [StridedShard(0, 2), R], 0),
        ([R, Shard(2)], lambda t: t.flatten(), [R, StridedShard(0, 8)], 0),
        ([Shard(0), Shard(2)], lambda t: t.flatten(1, 2).sum(-1), [Shard(0), Partial("sum")], 0),
        ([Shard(1), Shard(2)], lambda t: t.flatten(0, 1).view(2, 4, 6), [Shard(1), Shard(2)], 0),
        # both cuts land on the merged dim: the strided one would be nested under the other, gathered
        ([Shard(2), Shard(1)], lambda t: t.flatten(1, 2), [R, Shard(1)], 1),
        ([Shard(1), Shard(2)], lambda t: t.flatten(1, 2), [Shard(1), R], 1),
    ]
    with fallback_policy("error"):
        for placements, fn, expect, gathers in cases:
            d = distribute_tensor(x, mesh, placements)
            with record_collectives() as log:
                out = fn(d)
            assert len(log) == gathers, (placements, dict(log.counts()))
            assert out.placements == tuple(expect), (placements, out.placements)
            check(fn, [x], [placements], mesh, expect=expect, tag=str(placements))
        # even sizes, so a wrongly nested strided cut would even have the right local shapes
        y = torch.randn(2, 4, 8, dtype=torch.float64)
        check(lambda t: t.flatten(1, 2), [y], [[Shard(1), Shard(2)]], mesh, expect=[Shard(1), R])


@pytest.mark.distributed(world_size=2)
def test_repeat_interleave_without_dim(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    check(lambda t: t.repeat_interleave(2), [torch.randn(3, 4, dtype=torch.float64)], [[Shard(1)]], mesh)


# name: (fn, inputs' shapes, their placements, output placements, forward collectives)
CATS = {
    "cat([R, S(1)], 0) cuts the replicated input": (
        lambda a, b: torch.cat([a, b], 0),
        [(3, 4), (5, 4)],
        [[R], [Shard(1)]],
        [Shard(1)],
    ),
    "cat([S(0), S(0)], 0) of equal sizes is strided": (
        lambda a, b: torch.cat([a, b], 0),
        [(5, 2), (5, 2)],
        [[Shard(0)], [Shard(0)]],
        [StridedShard(0, 2)],
    ),
    "cat([R, S(0), S(0)], 0) of equal sizes": (
        lambda a, b, c: torch.cat([a, b, c], 0) * 2,
        [(4, 3), (4, 3), (4, 3)],
        [[R], [Shard(0)], [Shard(0)]],
        [StridedShard(0, 3)],
    ),
    "cat then split back": (
        lambda a, b: torch.cat([a, b], 0).view(2, 6, 3)[1],
        [(6, 3), (6, 3)],
        [[Shard(0)], [R]],
        [Shard(0)],
    ),
    "stack([R, S(0)])": (lambda a, b: torch.stack([a, b]), [(5, 3), (5, 3)], [[R], [Shard(0)]], [Shard(1)]),
    "stack([R, S(1)], 1)": (
        lambda a, b: torch.stack([a, b], 1),
        [(5, 3), (5, 3)],
        [[R], [Shard(1)]],
        [Shard(2)],
    ),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(CATS))
def test_cat_and_stack_of_mixed_cuts_move_nothing(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    fn, shapes, placements, expect = CATS[name]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    inputs = [torch.randn(*shape, dtype=torch.float64) for shape in shapes]
    with fallback_policy("error"):
        check(fn, inputs, placements, mesh, expect=expect, forward_collectives=NO_COMM, tag=name)


@pytest.mark.distributed(world_size=4)
def test_cat_on_a_2d_mesh_and_uneven_cats(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    a, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with fallback_policy("error"):
        cat = lambda x, y: torch.cat([x, y], 0)  # noqa: E731
        expect = [StridedShard(0, 2), Shard(1)]
        check(cat, [a, b], [[Shard(0), R], [R, Shard(1)]], mesh, expect=expect, forward_collectives=NO_COMM)
        # sizes that differ along the cat dim: no strided cut describes it, the cut inputs are gathered
        c = torch.randn(3, 4, dtype=torch.float64)
        out = check(cat, [a, c], [[Shard(0), R], [Shard(0), R]], mesh)
        assert out.placements == (R, R)


@pytest.mark.distributed(world_size=2)
def test_slices_of_whole_blocks_move_nothing(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A slice taking whole blocks of a strided dim is local, so a strided cat's backward is too."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b, c = (torch.randn(5, 3, dtype=torch.float64) for _ in range(3))
    cat = lambda x, y, z: torch.cat([x, y, z])  # noqa: E731
    with fallback_policy("error"):
        for name, fn, expect in (
            ("one block", lambda x, y, z: cat(x, y, z)[5:10], Shard(0)),
            ("two blocks", lambda x, y, z: cat(x, y, z)[5:], StridedShard(0, 2)),
            ("narrow a block", lambda x, y, z: cat(x, y, z).narrow(0, 10, 5), Shard(0)),
            ("narrow_copy", lambda x, y, z: cat(x, y, z).narrow_copy(0, 0, 10), StridedShard(0, 2)),
        ):
            placements = [[Shard(0)]] * 3
            check(fn, [a, b, c], placements, mesh, expect=[expect], forward_collectives=NO_COMM, tag=name)
        d = [distribute_tensor(t, mesh, [Shard(0)]).requires_grad_() for t in (a, b, c)]
        out = cat(*d)
        g = torch.randn(15, 3, dtype=torch.float64)
        grad = distribute_tensor(g, mesh, [StridedShard(0, 3)])
        with record_collectives() as log:
            out.backward(grad)
        assert len(log) == 0, dict(log.counts())
        assert [t.grad.placements for t in d] == [(Shard(0),)] * 3
        for i, t in enumerate(d):
            torch.testing.assert_close(t.grad.full_tensor(), g[5 * i : 5 * i + 5], rtol=0, atol=0)
        # a slice that cuts a block is gathered, and right
        check(lambda x, y, z: cat(x, y, z)[3:12], [a, b, c], [[Shard(0)]] * 3, mesh, expect=[R])


@pytest.mark.distributed(world_size=2)
def test_reductions_of_uneven_strided_pieces(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """(5, 5, 5) S(1) -> (25, 5): pieces of 15 and 10 rows, where torch.chunk would cut 13 and 12."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 5, 5, dtype=torch.float64)
    merged = lambda t: t.view(25, 5)  # noqa: E731
    with fallback_policy("error"):
        for name, fn, expect, comm in (
            ("sum over the other dim", lambda t: merged(t).sum(-1), StridedShard(0, 5), NO_COMM),
            ("mean over the other dim", lambda t: merged(t).mean(1, True), StridedShard(0, 5), NO_COMM),
            ("sum over the strided dim", lambda t: merged(t).sum(0), Partial("sum"), NO_COMM),
            ("mean over the strided dim", lambda t: merged(t).mean(0), Partial("sum"), NO_COMM),
        ):
            check(fn, [x], [[Shard(1)]], mesh, expect=[expect], forward_collectives=comm, tag=name)
        # StridedShard(0, 4) of 4 rows over 2 ranks: pieces of 4 and 0 rows (torch.chunk: 2 and 2)
        y = torch.randn(4, 3, dtype=torch.float64)
        for name, fn, expect, comm in (
            ("mean of pieces of 4 and 0 rows", lambda t: t.mean(0), R, {"all_gather_into_tensor": 1}),
            ("amax of an empty piece", lambda t: t.amax(0), R, {"all_gather_into_tensor": 1}),
            ("sum of pieces of 4 and 0 rows", lambda t: t.sum(0), Partial("sum"), NO_COMM),
        ):
            check(fn, [y], [[StridedShard(0, 4)]], mesh, expect=[expect], forward_collectives=comm, tag=name)

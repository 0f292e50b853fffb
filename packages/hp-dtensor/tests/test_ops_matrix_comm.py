"""``add*`` products whose ``self`` term is the cut operand: the output takes its cut, nothing moves.

``addmm(bias S(0), mat1 R, mat2 R)`` is local: ``mat1`` is cut by rows on
each rank for free and the bias's rows line up with the product's. Values and
gradients are checked against full tensors (uneven sizes over 2 ranks), the
forward's collectives counted, and the fallback never taken.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import Partial, Replicate, Shard, fallback_stats

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R, P = Replicate(), Partial("sum")
NO_COMM: dict[str, int] = {}

# op, (self, a, b) shapes (uneven over 2 ranks), {self's shard dim: output's shard dim}
ADD_PRODUCTS = {
    "addmm": (
        lambda s, a, b: torch.addmm(s, a, b, beta=0.2, alpha=0.6),
        [(5, 3), (5, 4), (4, 3)],
        {0: 0, 1: 1},
    ),
    "addmm 1-D self": (lambda s, a, b: torch.addmm(s, a, b), [(3,), (5, 4), (4, 3)], {0: 1}),
    "baddbmm": (
        lambda s, a, b: torch.baddbmm(s, a, b, beta=0.5),
        [(3, 5, 7), (3, 5, 4), (3, 4, 7)],
        {0: 0, 1: 1, 2: 2},
    ),
    "addmv": (lambda s, a, b: torch.addmv(s, a, b, alpha=2.0), [(5,), (5, 3), (3,)], {0: 0}),
    "addr": (lambda s, a, b: torch.addr(s, a, b), [(5, 3), (5,), (3,)], {0: 0, 1: 1}),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(ADD_PRODUCTS))
def test_a_cut_self_term_cuts_the_output_with_no_communication(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    fn, shapes, cuts = ADD_PRODUCTS[name]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    inputs = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    before = fallback_stats()
    for dim, out_dim in cuts.items():
        check(
            fn,
            inputs,
            [[Shard(dim)], [R], [R]],
            mesh,
            expect=[Shard(out_dim)],
            forward_collectives=NO_COMM,
            tag=f"{name} self S({dim})",
        )
    # a partial self term keeps the product partial (one factor carries the terms)
    check(fn, inputs, [[P], [R], [R]], mesh, expect=[P], forward_collectives=NO_COMM, tag=f"{name} self P")
    assert fallback_stats() == before


@pytest.mark.distributed(world_size=2)
def test_a_self_term_cut_on_a_broadcast_dim_is_gathered_not_followed(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``baddbmm`` with a ``(1,)`` self: its size-1 dim is broadcast, so the output cannot follow the cut."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    inputs = [torch.randn(*s, dtype=torch.float64) for s in [(1,), (3, 5, 4), (3, 4, 7)]]
    check(torch.baddbmm, inputs, [[Shard(0)], [R], [R]], mesh, expect=[R], tag="baddbmm (1,) self")


@pytest.mark.distributed(world_size=4)
def test_self_term_cuts_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Each mesh dim follows its own operand: bias rows on one, ``mat2`` columns on the other."""
    mesh = device_mesh_factory((2, 2), ("a", "b"))
    torch.manual_seed(0)
    inputs = [torch.randn(*s, dtype=torch.float64) for s in [(5, 3), (5, 4), (4, 3)]]
    check(
        torch.addmm,
        inputs,
        [[Shard(0), Shard(1)], [R, R], [R, R]],
        mesh,
        expect=[Shard(0), Shard(1)],
        forward_collectives=NO_COMM,
        tag="addmm 2x2",
    )
    check(
        torch.addmm,
        inputs,
        [[Shard(0), R], [R, R], [R, Shard(1)]],
        mesh,
        expect=[Shard(0), Shard(1)],
        forward_collectives=NO_COMM,
        tag="addmm bias rows x mat2 columns",
    )

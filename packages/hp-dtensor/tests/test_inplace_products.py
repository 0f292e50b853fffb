"""In-place ``add*`` products (``addmm_``, ``baddbmm_``, ``addbmm_``, ``addmv_``, ``addr_``) take a rule.

The product is planned to land on ``self``'s own placement ([Note: in-place
add products] in ``ops/matrix.py``): values and gradients against full
tensors, ``self`` keeps its placement, collectives counted (none where the
operands already line up), and a max partial ``self`` is refused by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, fallback_policy

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R, P = Replicate(), Partial("sum")
NO_COMM: dict[str, int] = {}


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# (name, method, self shape, a shape, b shape)
_OPS = [
    ("addmm_", torch.Tensor.addmm_, (5, 3), (5, 4), (4, 3)),
    ("baddbmm_", torch.Tensor.baddbmm_, (3, 5, 2), (3, 5, 4), (3, 4, 2)),
    ("addbmm_", torch.Tensor.addbmm_, (5, 2), (3, 5, 4), (3, 4, 2)),
    ("addmv_", torch.Tensor.addmv_, (5,), (5, 4), (4,)),
    ("addr_", torch.Tensor.addr_, (5, 3), (5,), (3,)),
]


def _inplace(method):  # type: ignore[no-untyped-def]
    # a clone first: the leaves need gradients, and autograd refuses in-place writes into leaves
    return lambda s, a, b: method(s.clone(), a, b, beta=0.5, alpha=2.0)


@pytest.mark.distributed(world_size=2)
def test_inplace_products_keep_self_placement_without_communication(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Operands already lined up with ``self`` (uneven cuts: 5 rows over 2 ranks): no collective at all."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    lined_up = {
        "addmm_": [[Shard(0)], [Shard(0)], [R]],
        "baddbmm_": [[Shard(0)], [Shard(0)], [Shard(0)]],
        "addbmm_": [[Shard(0)], [Shard(1)], [R]],
        "addmv_": [[Shard(0)], [Shard(0)], [R]],
        "addr_": [[Shard(1)], [R], [Shard(0)]],
    }
    with fallback_policy("error"):
        for name, method, s, a, b in _OPS:
            check(
                _inplace(method),
                [_t(*s), _t(*a), _t(*b)],
                lined_up[name],
                mesh,
                expect=lined_up[name][0],
                forward_collectives=NO_COMM,
                tag=name,
            )


@pytest.mark.distributed(world_size=2)
def test_inplace_products_move_operands_not_self(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Operands cut otherwise: they move, ``self`` keeps its placement (replicated, cut or a sum partial)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    cases = [
        # the out-of-place plan would cut the output by rows; self stays replicated
        ("addmm_", [[R], [Shard(0)], [R]]),
        # contraction dim cut on both sides: the product is a partial sum, self is one too
        ("addmm_", [[P], [Shard(1)], [Shard(0)]]),
        # self cut by columns, operands by rows
        ("addmm_", [[Shard(1)], [Shard(0)], [R]]),
        ("baddbmm_", [[Shard(2)], [Shard(0)], [Shard(0)]]),
        ("addbmm_", [[R], [Shard(0)], [Shard(0)]]),
        ("addmv_", [[R], [Shard(1)], [Shard(0)]]),
        ("addr_", [[Shard(0)], [R], [Shard(0)]]),
    ]
    ops = {name: (method, s, a, b) for name, method, s, a, b in _OPS}
    with fallback_policy("error"):
        for name, placements in cases:
            method, s, a, b = ops[name]
            check(
                _inplace(method),
                [_t(*s), _t(*a), _t(*b)],
                placements,
                mesh,
                expect=placements[0],
                tag=f"{name} {placements}",
            )


@pytest.mark.distributed(world_size=4)
def test_inplace_addmm_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(2)
    with fallback_policy("error"):
        lined_up = (
            [[Shard(0), Shard(1)], [Shard(0), R], [R, Shard(1)]],
            [[Shard(0), P], [Shard(0), Shard(1)], [R, Shard(0)]],
        )
        for placements in lined_up:
            check(
                _inplace(torch.Tensor.addmm_),
                [_t(5, 6), _t(5, 4), _t(4, 6)],
                placements,
                mesh,
                expect=placements[0],
                forward_collectives=NO_COMM,
                tag=f"addmm_ {placements}",
            )


@pytest.mark.distributed(world_size=2)
def test_inplace_product_into_a_max_partial_is_refused(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    s = DTensor.from_local(_t(3, 3), mesh, [Partial("max")])
    a = distribute_tensor(_t(3, 4), mesh, [R])
    b = distribute_tensor(_t(4, 3), mesh, [R])
    with pytest.raises(ValueError, match=r"self has placements \[Partial\('max'\)\].*Redistribute self"):
        s.addmm_(a, b)

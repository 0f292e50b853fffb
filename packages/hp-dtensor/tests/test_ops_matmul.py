"""Matrix products in every shape torch.matmul accepts, their ``add*`` forms, and the ops built on them.

Every placement of every operand (replicated, partial, a shard of each dim)
is checked against full tensors, values and gradients, with no fallback;
where a rule avoids communication, the collectives are counted.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R, P = Replicate(), Partial("sum")
NO_COMM: dict[str, int] = {}


def _every(ndim: int) -> list:  # type: ignore[type-arg]
    return [R, P] + [Shard(d) for d in range(ndim)]


def _sweep(fn, shapes, mesh, name, *, with_self: bool = False) -> None:  # type: ignore[no-untyped-def]
    """``fn`` on every combination of placements of its operands (1-D mesh).

    ``with_self``: the first operand is the ``self`` term of an ``add*`` op;
    every placement of the two factors is tried with it replicated, and every
    placement of it with the factors cut (a row shard, a partial).
    """
    torch.manual_seed(0)
    inputs = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    if with_self:
        factors = list(itertools.product(*(_every(len(s)) for s in shapes[1:])))
        combos = [(R, *pair) for pair in factors]
        combos += [(s, Shard(0), R) for s in _every(len(shapes[0]))]
        combos += [(s, R, P) for s in _every(len(shapes[0]))]
    else:
        combos = list(itertools.product(*(_every(len(s)) for s in shapes)))
    for combo in combos:
        check(fn, inputs, [[p] for p in combo], mesh, tag=f"{name} {[str(p) for p in combo]}")


def _matmul(a, b):  # type: ignore[no-untyped-def]
    return a @ b


# Every shape pair torch.matmul accepts: dot, vector-matrix, matrix-vector, matrix-matrix,
# batched with a matrix or a vector on either side, batched with broadcast batch dims. The sizes
# are uneven over 2 ranks (5, 3) and over 4 ranks (every size but 4).
MATMUL_SHAPES = {
    "1-D x 1-D": [(5,), (5,)],
    "1-D x 2-D": [(5,), (5, 3)],
    "2-D x 1-D": [(4, 5), (5,)],
    "2-D x 2-D": [(4, 5), (5, 3)],
    "3-D x 2-D": [(3, 4, 5), (5, 3)],
    "2-D x 3-D": [(4, 5), (3, 5, 3)],
    "1-D x 3-D": [(5,), (3, 5, 3)],
    "3-D x 1-D": [(3, 4, 5), (5,)],
    "3-D x 3-D": [(3, 4, 5), (3, 5, 3)],
    "4-D x 4-D broadcast": [(2, 1, 4, 5), (1, 3, 5, 6)],
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("kind", list(MATMUL_SHAPES))
def test_matmul_every_shape_and_placement(rank, device_mesh_factory, kind) -> None:  # type: ignore[no-untyped-def]
    _sweep(_matmul, MATMUL_SHAPES[kind], device_mesh_factory((2,)), kind)


_BMM = [(3, 4, 5), (3, 5, 3)]
PRODUCTS = {
    "dot": (torch.dot, [(5,), (5,)]),
    "vdot": (torch.vdot, [(5,), (5,)]),
    "mv": (torch.mv, [(4, 5), (5,)]),
    "addmv": (lambda s, a, b: torch.addmv(s, a, b, beta=0.5, alpha=2.0), [(4,), (4, 5), (5,)]),
    "addr": (lambda s, a, b: torch.addr(s, a, b, beta=0.5, alpha=2.0), [(4, 5), (4,), (5,)]),
    "addbmm": (lambda s, a, b: torch.addbmm(s, a, b, beta=0.5, alpha=2.0), [(4, 3), (2, 4, 5), (2, 5, 3)]),
    "baddbmm": (lambda s, a, b: torch.baddbmm(s, a, b, beta=0.5, alpha=2.0), [(3, 4, 3), *_BMM]),
    "baddbmm broadcast self": (torch.baddbmm, [(4, 3), *_BMM]),
    "addmm": (lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=2.0), [(3,), (4, 5), (5, 3)]),
    "outer": (torch.outer, [(4,), (5,)]),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(PRODUCTS))
def test_products_every_placement(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    fn, shapes = PRODUCTS[name]
    _sweep(fn, shapes, device_mesh_factory((2,)), name, with_self=name.startswith(("add", "badd")))


@pytest.mark.distributed(world_size=4)
def test_uneven_products_on_four_ranks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Sizes 5, 3 and 2 over 4 ranks: some ranks hold one row, some none."""
    mesh = device_mesh_factory((4,))
    for kind in ("1-D x 2-D", "2-D x 1-D", "1-D x 1-D", "3-D x 2-D"):
        _sweep(_matmul, MATMUL_SHAPES[kind], mesh, kind)
    for name in ("addmv", "addr"):
        fn, shapes = PRODUCTS[name]
        _sweep(fn, shapes, mesh, name, with_self=True)


@pytest.mark.distributed(world_size=4)
def test_products_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Each mesh dim decides on its own: a batch cut on one, a contraction cut on the other."""
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(1)
    a, b = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    cut = [[Shard(0), Shard(2)], [Shard(0), Shard(1)]]
    out = check(torch.bmm, [a, b], cut, mesh, forward_collectives=NO_COMM)
    assert out.placements == (Shard(0), P)
    v, m = torch.randn(5, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    out = check(_matmul, [v, m], [[Shard(0), R], [Shard(0), Shard(1)]], mesh, forward_collectives=NO_COMM)
    assert out.placements == (P, Shard(0))
    x, w = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    out = check(_matmul, [x, w], [[Shard(0), R], [R, Shard(1)]], mesh, forward_collectives=NO_COMM)
    assert out.placements == (Shard(0), Shard(2))
    # nested: the contracted dim cut by both mesh dims on both operands
    m2 = torch.randn(4, 8, dtype=torch.float64)
    out = check(torch.mv, [m2, torch.randn(8, dtype=torch.float64)], [[Shard(1)] * 2, [Shard(0)] * 2], mesh)
    assert out.placements == (P, P)


@pytest.mark.distributed(world_size=2)
def test_products_that_need_no_communication(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Where torch's DTensor has a strategy that moves nothing, the rule moves nothing (forward)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(2)
    v, m, u = (torch.randn(*s, dtype=torch.float64) for s in [(5,), (5, 3), (3,)])
    S0, S1 = [Shard(0)], [Shard(1)]

    def expect(fn, inputs, placements, out) -> None:  # type: ignore[no-untyped-def]
        check(fn, inputs, placements, mesh, expect=out, forward_collectives=NO_COMM)

    # v @ M, the case (an IndexError before): columns of M give pieces of the result
    expect(_matmul, [v, m], [[R], S1], [Shard(0)])
    expect(_matmul, [v, m], [S0, S0], [P])
    expect(_matmul, [m.t(), v], [S0, [R]], [Shard(0)])
    expect(_matmul, [m.t(), v], [S1, S0], [P])
    expect(torch.dot, [v, v * 2], [S0, S0], [P])
    expect(torch.dot, [v, v * 2], [[P], [R]], [P])
    expect(torch.mv, [m.t(), v], [[P], [R]], [P])
    expect(torch.outer, [v, u], [S0, [R]], [Shard(0)])
    expect(torch.outer, [v, u], [[R], S0], [Shard(1)])
    expect(torch.addr, [torch.randn(5, 3, dtype=torch.float64), v, u], [S0, S0, [R]], [Shard(0)])
    expect(torch.addr, [torch.randn(5, 3, dtype=torch.float64), v, u], [[R], [P], [R]], [P])
    expect(torch.addmv, [u, m.t(), v], [[R], S1, S0], [P])  # the bias becomes partial locally
    a, b = torch.randn(4, 3, 5, dtype=torch.float64), torch.randn(4, 5, 2, dtype=torch.float64)
    expect(torch.addbmm, [torch.randn(3, 2, dtype=torch.float64), a, b], [[R], S0, S0], [P])
    expect(torch.addbmm, [torch.randn(3, 2, dtype=torch.float64), a, b], [S0, S1, [R]], [Shard(0)])
    expect(torch.baddbmm, [torch.randn(4, 3, 2, dtype=torch.float64), a, b], [S0, S0, S0], [Shard(0)])
    expect(torch.baddbmm, [torch.randn(4, 3, 2, dtype=torch.float64), a, b], [[R], [Shard(2)], S1], [P])
    # batched matmul with a vector, and broadcast batch dims
    expect(_matmul, [a, torch.randn(5, dtype=torch.float64)], [S0, [R]], [Shard(0)])
    expect(_matmul, [torch.randn(5, dtype=torch.float64), b], [[R], S0], [Shard(0)])
    x4, y4 = torch.randn(2, 1, 3, 5, dtype=torch.float64), torch.randn(1, 4, 5, 6, dtype=torch.float64)
    expect(_matmul, [x4, y4], [[R], [Shard(3)]], [Shard(3)])


@pytest.mark.distributed(world_size=2)
def test_the_smaller_operand_moves(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Two shards that cannot both stay: the smaller operand is gathered, the larger keeps its cut."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(3)
    big, small = torch.randn(64, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    a = distribute_tensor(big, mesh, [Shard(0)])
    b = distribute_tensor(small, mesh, [Shard(1)])
    with record_collectives() as log:
        out = a @ b
    assert out.placements == (Shard(0),)
    assert log.count("all_gather_into_tensor") == 1
    assert log.nbytes("all_gather_into_tensor") <= small.numel() * small.element_size()
    torch.testing.assert_close(out.full_tensor(), big @ small)
    a = distribute_tensor(small.t().contiguous(), mesh, [Shard(0)])
    b = distribute_tensor(big.t().contiguous(), mesh, [Shard(1)])
    with record_collectives() as log:
        out = a @ b
    assert out.placements == (Shard(1),)
    assert log.nbytes("all_gather_into_tensor") <= small.numel() * small.element_size()
    torch.testing.assert_close(out.full_tensor(), small.t() @ big.t())


EINSUM = {
    "ij,jk->ik": [(4, 5), (5, 3)],
    "bij,bjk->bik": [(2, 4, 5), (2, 5, 3)],
    "bhqd,bhkd->bhqk": [(2, 3, 4, 5), (2, 3, 6, 5)],
    "bsd,de->bse": [(2, 4, 5), (5, 3)],
    "bi,bi->b": [(4, 5), (4, 5)],
    "i,j->ij": [(4,), (5,)],
    "i,i->": [(5,), (5,)],
}


@pytest.mark.distributed(world_size=2)
def test_einsum_tensordot_vecdot(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """einsum patterns, tensordot and linalg.vecdot decompose into ruled ops: every placement, no fallback."""
    mesh = device_mesh_factory((2,))
    for equation, shapes in EINSUM.items():
        _sweep(lambda a, b, e=equation: torch.einsum(e, a, b), shapes, mesh, equation)
    _sweep(lambda a, b: torch.tensordot(a, b, dims=([1], [0])), [(4, 5), (5, 3)], mesh, "tensordot 1")
    _sweep(lambda a, b: torch.tensordot(a, b, dims=2), [(2, 4, 5), (4, 5, 3)], mesh, "tensordot 2")
    _sweep(lambda a, b: torch.tensordot(a, b, dims=([0], [0])), [(2, 3, 4), (2, 5)], mesh, "tensordot 0-0")
    # the issue's tensordot: a full contraction runs squeeze() on pieces of one row (views' fix)
    _sweep(lambda a, b: torch.tensordot(a, b, dims=([0, 1], [1, 0])), [(2, 4), (4, 2)], mesh, "tensordot all")
    _sweep(torch.linalg.vecdot, [(4, 5), (4, 5)], mesh, "vecdot")


@pytest.mark.distributed(world_size=2)
def test_in_place_views_change_the_dtensor_itself(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """squeeze_ / unsqueeze_ / t_ / transpose_ give the DTensor its new shape, layout and local piece."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(4)
    full = torch.randn(1, 5, 3, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(1)])
    same = x.squeeze_(0)
    assert same is x and x.shape == (5, 3) and x.stride() == (3, 1) and x.placements == (Shard(0),)
    assert x.to_local().shape == x._layout.local_shape()
    torch.testing.assert_close(x.full_tensor(), full[0])
    x.unsqueeze_(2)
    assert x.shape == (5, 3, 1) and x.placements == (Shard(0),)
    torch.testing.assert_close(x.full_tensor(), full[0].unsqueeze(2))
    x.squeeze_()
    x.t_()
    assert x.shape == (3, 5) and x.placements == (Shard(1),)
    torch.testing.assert_close(x.full_tensor(), full[0].t())
    x.transpose_(0, 1)
    torch.testing.assert_close(x.full_tensor(), full[0])
    assert isinstance(x, DTensor) and x.placements == (Shard(0),)

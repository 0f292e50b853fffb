"""The dispatcher asks every rule through ``strided.decide``: StridedShard inputs on both paths.

These tests use the dispatcher as it ships
([Note: rules and strided shards] in :mod:`hp_dtensor.ops.strided`). The
decision cache and the fast path are keyed by layouts, and a
``StridedShard(0, k)`` layout has the same shape and stride as the
``Shard(0)`` one, so the checks interleave the two on one op: a key that
mixed them up would label strided rows as contiguous ones (wrong values) or
gather a ``Shard`` for nothing (collectives counted).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import Replicate, Shard, StridedShard, distribute_tensor, fallback_policy
from hp_dtensor.ops import dispatch as D
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from test_dispatch_cache import counting_slow_path

aten = torch.ops.aten
R = Replicate()


@pytest.mark.distributed(world_size=2)
def test_cache_tells_strided_from_shard(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """One op, one shape and stride, Shard(0) and StridedShard(0, 2) in turn: each its own answer."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, w = torch.randn(8, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    cut = distribute_tensor(x, mesh, [Shard(0)])
    strided_cut = distribute_tensor(x, mesh, [StridedShard(0, 2)])
    dw = distribute_tensor(w, mesh, [R])
    D.clear_caches()
    for _ in range(3):  # the second and third rounds answer from the caches
        with record_collectives() as log:
            out = cut @ dw
        assert out.placements == (Shard(0),) and len(log) == 0
        torch.testing.assert_close(out.full_tensor(), x @ w, rtol=0, atol=0)
        # mm's rule knows no StridedShard: it sees a replicated input, which is gathered first
        with record_collectives() as log:
            out = strided_cut @ dw
        assert out.placements == (R,) and len(log) > 0
        torch.testing.assert_close(out.to_local(), x @ w, rtol=0, atol=0)
        # an elementwise op sees the Shard view and keeps the strided cut, moving nothing
        with record_collectives() as log, fallback_policy("error"):
            doubled, plain = strided_cut * 2.0, cut * 2.0
        assert len(log) == 0
        assert doubled.placements == (StridedShard(0, 2),) and plain.placements == (Shard(0),)
        torch.testing.assert_close(doubled.to_local(), strided_cut.to_local() * 2, rtol=0, atol=0)
        torch.testing.assert_close(doubled.full_tensor(), x * 2, rtol=0, atol=0)
        torch.testing.assert_close(plain.full_tensor(), x * 2, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_strided_calls_take_the_fast_path(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Repeats of a strided call hit the fast path (no rule, no meta run) and stay right."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    da = distribute_tensor(a, mesh, [StridedShard(0, 3)])
    db = distribute_tensor(b, mesh, [StridedShard(0, 3)])
    sa = distribute_tensor(a, mesh, [Shard(0)])
    with counting_slow_path(aten.add.Tensor) as calls, record_collectives() as log:
        outs = [da + db for _ in range(4)]
        assert len(calls) == 1, f"{len(calls)} of 4 identical strided calls took the slow path"
        mixed = [sa + sa for _ in range(2)]  # the Shard layout is another signature
        assert len(calls) == 2
    assert len(log) == 0
    for out in outs:
        assert out.placements == (StridedShard(0, 3),)
        torch.testing.assert_close(out.full_tensor(), a + b)
    for out in mixed:
        assert out.placements == (Shard(0),)
        torch.testing.assert_close(out.full_tensor(), 2 * a)


@pytest.mark.distributed(world_size=2)
def test_values_and_gradients_through_a_merged_view(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A view merging a cut inner dim, elementwise work and a reduction on the cut, then a matmul.

    The forward's view and elementwise ops move nothing; the matmul gathers
    the strided input. Values and the input's gradient match plain autograd,
    on the first call (slow path) and on the repeat (caches).
    """
    mesh = device_mesh_factory((2,))
    torch.manual_seed(2)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    w = torch.randn(3, 2, dtype=torch.float64)

    def step(t: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = t.view(24, 3)  # dim 1 cut: rows of dim 0 strided
        z = torch.tanh(y) * y
        return z.sum(1), z @ m

    ref_x = x.clone().requires_grad_()
    ref_rows, ref_mm = step(ref_x, w)
    (ref_rows.pow(2).sum() + ref_mm.sum()).backward()
    dw = distribute_tensor(w, mesh, [R])
    for _ in range(2):
        dx = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        with record_collectives() as log:
            y = dx.view(24, 3)
            assert y.placements == (StridedShard(0, 4),)
            z = torch.tanh(y) * y
            rows = z.sum(1)
        assert len(log) == 0 and rows.placements == (StridedShard(0, 4),)
        out = z @ dw
        torch.testing.assert_close(rows.full_tensor(), ref_rows.detach())
        torch.testing.assert_close(out.full_tensor(), ref_mm.detach())
        (rows.pow(2).sum() + out.sum()).backward()
        assert dx.grad is not None and dx.grad.placements == (Shard(1),)
        torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad)

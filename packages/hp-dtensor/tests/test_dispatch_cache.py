"""The dispatch fast path and the redistribution program cache: hits are exactly the slow path's answers.

See [Note: dispatch fast path] in ``hp_dtensor.ops.dispatch``. Every check
here compares a repeated call (a cache hit) with the full tensors, and
counts slow-path entries to prove the repeats really took the fast path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hp_dtensor import DTensor, Replicate, Shard, distribute_tensor
from hp_dtensor.ops import dispatch as D
from hp_testing import record_collectives

aten = torch.ops.aten


@contextmanager
def counting_slow_path(op: object) -> Iterator[list[object]]:
    """Count the calls of ``op`` that miss the fast path (each one enters ``dispatch``)."""
    calls: list[object] = []
    original = D.dispatch

    def counted(func, args, kwargs):  # type: ignore[no-untyped-def]
        if func is op:
            calls.append(func)
        return original(func, args, kwargs)

    D.clear_caches()
    D.dispatch = counted  # _torch_dispatch looks the name up at call time
    try:
        yield calls
    finally:
        D.dispatch = original
        D.clear_caches()


@pytest.mark.distributed(world_size=4)
def test_repeated_calls_hit_and_stay_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(0)
    a, b = torch.randn(10, 3), torch.randn(10, 3)  # uneven rows over 4 ranks: 3, 3, 3, 1
    da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
    with counting_slow_path(aten.add.Tensor) as calls:
        outs = [da + db for _ in range(4)]
        assert len(calls) == 1, f"{len(calls)} of 4 identical calls took the slow path"
        for out in outs:
            assert isinstance(out, DTensor) and out.placements == (Shard(0),)
            torch.testing.assert_close(out.full_tensor(), a + b)
        # another dtype with the same layouts is another signature, with its own answer
        d64 = distribute_tensor(a.double(), mesh, [Shard(0)])
        assert (d64 + d64).dtype == torch.float64 and len(calls) == 2
        torch.testing.assert_close((d64 + d64).full_tensor(), 2 * a.double())
        # an int and a float scalar are different signatures (1 == 1.0 in Python)
        ints = distribute_tensor(torch.arange(10).view(10, 1), mesh, [Shard(0)])
        assert (ints + 1).dtype == torch.int64
        assert (ints + 1.0).dtype == torch.float32
        torch.testing.assert_close((ints + 1.0).full_tensor(), torch.arange(10).view(10, 1) + 1.0)
    # in-place and three-argument ops through the fast path
    acc = distribute_tensor(torch.zeros(10, 3), mesh, [Shard(0)])
    for _ in range(3):
        acc.add_(da)
        acc = torch.addcmul(acc, da, db)
    expected = torch.zeros(10, 3)
    for _ in range(3):
        expected = torch.addcmul(expected + a, a, b)
    torch.testing.assert_close(acc.full_tensor(), expected)


@pytest.mark.distributed(world_size=4)
def test_equal_meshes_do_not_share_entries(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    first = device_mesh_factory((4,))
    second = device_mesh_factory((4,))  # a second, equal mesh object over the same groups
    assert first == second and first is not second
    t = torch.randn(8, 2)
    x1, x2 = distribute_tensor(t, first, [Shard(0)]), distribute_tensor(t, second, [Shard(0)])
    assert x1._layout == x2._layout and x1._layout.token() != x2._layout.token()
    with counting_slow_path(aten.mul.Tensor) as calls:
        y1, y2 = x1 * x1, x2 * x2
        assert len(calls) == 2, "a hit across equal mesh objects would hand out the other mesh's layout"
        assert y1.device_mesh is first and y2.device_mesh is second
        assert (x2 * x2).device_mesh is second and len(calls) == 2


@pytest.mark.distributed(world_size=4)
def test_redistribute_cache_and_autograd(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(1)
    t = torch.randn(6, 5)
    dt = distribute_tensor(t, mesh, [Shard(0), Shard(1)])
    with record_collectives() as log:
        first = dt.redistribute(placements=[Replicate(), Replicate()])
        second = dt.redistribute(placements=[Replicate(), Replicate()])
    # two gathers per call, both calls communicate
    assert log.counts() == {"all_gather_into_tensor": 4}, log.counts()
    assert first._layout is second._layout  # the cached program hands out the same layout
    assert first.grad_fn is None and not first.requires_grad  # no autograd Function without grads
    torch.testing.assert_close(second.to_local(), t)
    # with a gradient to carry, the autograd Function runs and the gradient comes back sharded
    leaf = distribute_tensor(t, mesh, [Shard(0), Shard(1)]).requires_grad_(True)
    out = leaf.redistribute(placements=[Replicate(), Replicate()])
    assert out.grad_fn is not None
    (out.to_local() * 2).sum().backward()
    assert leaf.grad is not None and leaf.grad.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(leaf.grad.full_tensor(), torch.full_like(t, 2.0))


@pytest.mark.distributed(world_size=2)
def test_float_scalars_of_pointwise_ops_key_by_type(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """AdamW divides by a bias correction that changes every step: one slow call, not one per value.

    See [Note: scalar-blind ops]. Each call still uses its own scalar, ints
    keep their value in the key, and the result dtype follows the scalar's
    type.
    """
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
    scalars = [1 - 0.9**step for step in range(1, 6)]
    with counting_slow_path(aten.div.Tensor) as calls:
        outs = [da / s for s in scalars]
        assert len(calls) == 1, f"{len(calls)} of {len(scalars)} divisions by new floats took the slow path"
        for out, s in zip(outs, scalars, strict=True):
            assert out.placements == (Shard(0),)
            torch.testing.assert_close(out.full_tensor(), a / s)
    with counting_slow_path(aten.lerp.Scalar) as calls:  # a float in third place: the general inline key
        outs = [torch.lerp(da, db, w) for w in (0.1, 0.25, 0.7)]
        assert len(calls) == 1
        for out, w in zip(outs, (0.1, 0.25, 0.7), strict=True):
            torch.testing.assert_close(out.full_tensor(), torch.lerp(a, b, w))
    with counting_slow_path(aten.mul.Tensor) as calls:  # complex: keyed by type through dispatch()
        outs = [da * complex(1, k) for k in range(3)]
        for out, k in zip(outs, range(3), strict=True):
            assert out.dtype == torch.complex64
            torch.testing.assert_close(out.full_tensor(), a * complex(1, k))
    with counting_slow_path(aten.add.Tensor) as calls:  # ints keep their value; types stay apart
        ints = distribute_tensor(torch.arange(6).view(6, 1), mesh, [Shard(0)])
        assert (ints + 1).dtype == torch.int64 and (ints + 2.5).dtype == torch.float32
        assert (ints + 3.5).dtype == torch.float32 and (ints + 4).dtype == torch.int64
        torch.testing.assert_close((ints + 2).full_tensor(), torch.arange(6).view(6, 1) + 2)
        torch.testing.assert_close((ints + 0.5).full_tensor(), torch.arange(6).view(6, 1) + 0.5)
        assert len(calls) == 4  # int 1, float 2.5 (3.5 and 0.5 hit), int 4, int 2
    # a view's size argument is an int list and keeps deciding the output
    assert da.view(24).shape == (24,) and da.view(3, 8).shape == (3, 8)

"""Elementwise wrappers and foreach ops keep a ``StridedShard`` cut with no communication.

Every rule wrapping ``pointwise_rule`` (casts, ``copy_``, fills,
``masked_fill``, untagged pointwise ops) is marked ``strided.elementwise``
and sees ``StridedShard(d, k)`` as ``Shard(d)``; foreach ops ask ``decide``
per list element ([Note: rules and strided shards] in ``hp_dtensor.ops.strided``).
"""

from __future__ import annotations

import pytest
import torch
from hp_dtensor import Replicate, StridedShard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

CUT = (StridedShard(0, 2),)


def _pair(mesh, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    x = torch.randn(8, 3, dtype=torch.float32)
    return x, distribute_tensor(x, mesh, list(CUT))


def _check(out, expected: torch.Tensor, log) -> None:  # type: ignore[no-untyped-def]
    assert len(log) == 0, log
    assert out.placements == CUT
    torch.testing.assert_close(out.full_tensor(), expected, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_cast_keeps_strided_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``.to(float64)`` (``_to_copy``): values and gradient as plain, the cut kept, nothing moved."""
    mesh = device_mesh_factory((2,))
    x, dx = _pair(mesh)
    dx = dx.detach().requires_grad_()
    with record_collectives() as log, fallback_policy("error"):
        out = dx.to(torch.float64)
    _check(out, x.to(torch.float64), log)
    assert out.dtype == torch.float64
    g = torch.arange(24, dtype=torch.float64).reshape(8, 3)
    out.backward(distribute_tensor(g, mesh, list(CUT)))
    torch.testing.assert_close(dx.grad.full_tensor(), g.float(), rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_inplace_wrappers_keep_strided_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``copy_`` from a strided or replicated source, ``fill_``, ``zero_``: the destination's cut kept."""
    mesh = device_mesh_factory((2,))
    _, dx = _pair(mesh)
    y, dy = _pair(mesh, seed=1)
    with record_collectives() as log, fallback_policy("error"):
        dx.copy_(dy)
    _check(dx, y, log)
    z = torch.randn(8, 3)
    dz = distribute_tensor(z, mesh, [Replicate()])
    with record_collectives() as log, fallback_policy("error"):
        dx.copy_(dz)
    _check(dx, z, log)
    with record_collectives() as log, fallback_policy("error"):
        dx.fill_(3.5)
    _check(dx, torch.full((8, 3), 3.5), log)
    with record_collectives() as log, fallback_policy("error"):
        dx.zero_()
    _check(dx, torch.zeros(8, 3), log)


@pytest.mark.distributed(world_size=2)
def test_masked_fill_keeps_strided_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``masked_fill`` / ``masked_fill_`` with a mask cut alike: values and gradient as plain."""
    mesh = device_mesh_factory((2,))
    x, dx = _pair(mesh)
    mask = x > 0
    dmask = distribute_tensor(mask, mesh, list(CUT))
    dx = dx.detach().requires_grad_()
    with record_collectives() as log, fallback_policy("error"):
        out = dx.masked_fill(dmask, -1.0)
    _check(out, x.masked_fill(mask, -1.0), log)
    out.sum().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), (~mask).float(), rtol=0, atol=0)
    _, target = _pair(mesh)
    with record_collectives() as log, fallback_policy("error"):
        target.masked_fill_(dmask, 2.0)
    _check(target, x.masked_fill(mask, 2.0), log)


@pytest.mark.distributed(world_size=2)
def test_untagged_pointwise_keeps_strided_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``hardswish`` (not tagged pointwise, registered by name) and ``floor_divide``: the cut kept."""
    mesh = device_mesh_factory((2,))
    x, dx = _pair(mesh)
    with record_collectives() as log, fallback_policy("error"):
        out = torch.nn.functional.hardswish(dx)
    _check(out, torch.nn.functional.hardswish(x), log)
    y, dy = _pair(mesh, seed=2)
    with record_collectives() as log, fallback_policy("error"):
        out = torch.floor_divide(dx, dy)
    _check(out, torch.floor_divide(x, y), log)


@pytest.mark.distributed(world_size=2)
def test_foreach_keeps_strided_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``_foreach_add`` / ``_foreach_mul`` with strided / replicated partners: the cut kept, nothing moved."""
    mesh = device_mesh_factory((2,))
    x, dx = _pair(mesh)
    y, dy = _pair(mesh, seed=1)
    z = torch.randn(8, 3)
    dz = distribute_tensor(z, mesh, [Replicate()])
    with record_collectives() as log, fallback_policy("error"):
        added = torch._foreach_add([dx, dy], [dy, dz])
        multiplied = torch._foreach_mul([dx, dx], [dz, dy])
    assert len(log) == 0, log
    for out, expected in zip(added + multiplied, [x + y, y + z, x * z, x * y], strict=True):
        assert out.placements == CUT
        torch.testing.assert_close(out.full_tensor(), expected, rtol=0, atol=0)
    with record_collectives() as log, fallback_policy("error"):
        torch._foreach_mul_([dx, dy], [dz, dx])
    assert len(log) == 0, log
    assert dx.placements == CUT and dy.placements == CUT
    torch.testing.assert_close(dx.full_tensor(), x * z, rtol=0, atol=0)
    torch.testing.assert_close(dy.full_tensor(), y * (x * z), rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_foreach_norm_of_a_strided_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``_foreach_norm`` of a strided cut: right values (kept partial, no gather: test_strided_foreach.py)."""
    mesh = device_mesh_factory((2,))
    x, dx = _pair(mesh)
    (norm,) = torch._foreach_norm([dx])
    torch.testing.assert_close(norm.full_tensor(), torch.linalg.vector_norm(x))


@pytest.mark.distributed(world_size=2)
def test_like_fill_complex_keep_strided_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``zeros_like``, out-of-place ``fill`` and ``complex(real, imag)`` keep the strided cut too."""
    mesh = device_mesh_factory((2,))
    x, dx = _pair(mesh)
    y, dy = _pair(mesh, seed=1)
    with record_collectives() as log, fallback_policy("error"):
        zeros = torch.zeros_like(dx)
        filled = torch.ops.aten.fill.Scalar(dx, 1.5)
        pairs = torch.complex(dx, dy)
    _check(zeros, torch.zeros(8, 3), log)
    _check(filled, torch.full((8, 3), 1.5), log)
    _check(pairs, torch.complex(x, y), log)

"""Every redistribution pair, against the full tensor, with collectives counted (4 ranks)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, explain_redistribute
from hp_testing import record_collectives

PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max")]


def _make(full: torch.Tensor, mesh, placements, rank: int) -> DTensor:  # type: ignore[no-untyped-def]
    """A DTensor of ``full`` under ``placements``; partial terms differ per rank but reduce to ``full``."""
    dt = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
    local = dt.to_local().clone()
    for m, p in enumerate(placements):
        n = mesh.size(m)
        me = mesh.get_local_rank(m)
        if isinstance(p, Partial) and p.reduce_op == "sum":
            local = local * 0.5 if me == 0 else local * (0.5 / (n - 1))
        elif isinstance(p, Partial) and p.reduce_op == "avg":
            local = local + (me - (n - 1) / 2)
        elif isinstance(p, Partial) and p.reduce_op == "max":
            local = local if me == 0 else local - 1.0
    rep = DTensor.from_local(local, mesh, [p if isinstance(p, Partial) else Replicate() for p in placements])
    shards = [p if not isinstance(p, Partial) else None for p in placements]
    # cut shards from the replicated-with-partials tensor locally
    from hp_dtensor.redistribute import slice_for_layout

    layout = rep._layout.with_placements(placements)
    return DTensor.from_local(
        slice_for_layout(
            local, layout.with_placements([p if p is not None else Replicate() for p in shards])
        ),
        mesh,
        placements,
        shape=full.shape,
    )


def _expected_1d(src, dst) -> dict[str, int]:  # type: ignore[no-untyped-def]
    if src == dst:
        return {}
    if isinstance(src, Shard) and dst == Replicate():
        return {"all_gather_into_tensor": 1}
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return {"all_to_all_single": 1}
    if isinstance(src, Partial) and dst == Replicate():
        return {"all_reduce": 1}
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return {"reduce_scatter_tensor": 1}
    if src == Replicate():
        return {}
    if isinstance(src, Shard) and isinstance(dst, Partial):
        return {"all_gather_into_tensor": 1}
    return {"all_reduce": 1}  # P -> P'


@pytest.mark.distributed(world_size=4)
def test_every_pair_on_a_1d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    for shape in [(8, 4), (5, 3), (3, 6)]:  # even, uneven, some ranks empty on dim 0
        torch.manual_seed(0)
        full = torch.randn(shape, dtype=torch.float64)
        for src, dst in itertools.product(PLACEMENTS, PLACEMENTS):
            dt = _make(full, mesh, [src], rank)
            torch.testing.assert_close(dt.full_tensor(), full, msg=f"{src} source wrong")
            with record_collectives() as log:
                out = dt.redistribute(placements=[dst])
            counts = log.counts()
            assert out.placements == (dst,)
            assert dict(counts) == _expected_1d(src, dst), f"{src}->{dst} {shape}: {dict(counts)}"
            torch.testing.assert_close(out.full_tensor(), full, msg=f"{src}->{dst} {shape}")
            if not isinstance(dst, Partial):
                offset = out._layout.local_offset()
                local_shape = out._layout.local_shape()
                piece = full[tuple(slice(o, o + s) for o, s in zip(offset, local_shape, strict=True))]
                torch.testing.assert_close(out.to_local(), piece)


@pytest.mark.distributed(world_size=4)
def test_every_pair_on_a_2x2_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    pairs = list(itertools.product(PLACEMENTS, PLACEMENTS))
    # 1,296 pairs per shape: the uneven one by default (it pads where the even one does not);
    # both with HP_COMPOSITION=full. The 1-D test covers even shapes too.
    shapes = [(5, 3), (4, 4)] if os.environ.get("HP_COMPOSITION") == "full" else [(5, 3)]
    for shape in shapes:
        torch.manual_seed(1)
        full = torch.randn(shape, dtype=torch.float64)
        for src in pairs:
            dt = _make(full, mesh, list(src), rank)
            for dst in pairs:
                with record_collectives() as log:
                    out = dt.redistribute(placements=list(dst))
                counts = log.counts()
                torch.testing.assert_close(out.full_tensor(), full, msg=f"{src}->{dst} {shape}")
                plan = explain_redistribute(dt, list(dst))
                assert sum(counts.values()) == plan.num_collectives, f"{src}->{dst}: {dict(counts)} {plan}"
                assert sum(counts.values()) <= 4


@pytest.mark.distributed(world_size=4)
def test_nested_shard_and_gradients(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    full = torch.arange(35.0, dtype=torch.float64).view(7, 5)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
    assert dt.to_local().shape[0] == [2, 2, 2, 1][rank]
    torch.testing.assert_close(dt.full_tensor(), full)
    plan = explain_redistribute(dt, [Replicate(), Replicate()])
    assert [s.mesh_dim for s in plan] == [1, 0], str(plan)
    x = full.clone().requires_grad_()
    d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    (d.redistribute(placements=[Replicate(), Shard(0)]).full_tensor() * 3).sum().backward()
    assert d.grad is not None and d.grad.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(d.grad.full_tensor(), torch.full_like(full, 3.0))


@pytest.mark.distributed(world_size=4)
def test_ragged_from_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    sizes = [3, 0, 1, 2]
    full = torch.arange(6 * 2, dtype=torch.float32).view(6, 2)
    start = sum(sizes[:rank])
    local = full[start : start + sizes[rank]].clone().requires_grad_()
    dt = DTensor.from_local(local, mesh, [Shard(0)], shape=(6, 2))
    assert dt.shape == (6, 2) and dt._layout.is_ragged()
    torch.testing.assert_close(dt.full_tensor(), full)
    torch.testing.assert_close((dt * 2).full_tensor(), full * 2)
    torch.testing.assert_close(dt.redistribute(placements=[Shard(1)]).full_tensor(), full)
    (dt.full_tensor() * torch.arange(6.0).view(6, 1)).sum().backward()
    torch.testing.assert_close(
        local.grad, torch.arange(6.0).view(6, 1).expand(6, 2)[start : start + sizes[rank]]
    )


@pytest.mark.distributed(world_size=2)
def test_bad_input_raises_before_communicating(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    t = torch.ones(4, 2)
    with record_collectives() as log:
        with pytest.raises(ValueError, match=r"2 placement.*1-D mesh"):
            distribute_tensor(t, mesh, [Shard(0), Replicate()])
        with pytest.raises(ValueError, match=r"Shard\(2\) is out of range for a 2-D"):
            distribute_tensor(t, mesh, [Shard(2)])
        with pytest.raises(ValueError, match="not supported"):
            Partial("mul")
        dt = DTensor.from_local(t, mesh, [Shard(0)])
        with pytest.raises(ValueError, match=r"2 placement.*1-D mesh"):
            dt.redistribute(placements=[Replicate(), Replicate()])
    assert len(log) == 0, list(log)
    with pytest.raises(ValueError, match="local shapes"):
        DTensor.from_local(torch.ones(2 + rank, 2), mesh, [Shard(0)], shape=(4, 2))
    with pytest.raises(ValueError, match=r"not sharded"):
        DTensor.from_local(torch.ones(2, 2 + rank), mesh, [Shard(0)], run_check=True)

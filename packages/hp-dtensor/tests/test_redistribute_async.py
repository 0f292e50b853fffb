"""``DTensor.redistribute(..., async_op=True, forward_dtype=, backward_dtype=)`` against plain tensors.

The async result's local tensor is a PendingTensor that waits on first use
([Note: asynchronous redistribution] in ``hp_dtensor/pending.py``). Checked
here: values for every placement pair (even, uneven, ragged), that the work
is in flight until first use (its hp_core handle, and a rank order that
would deadlock if the call blocked), that autograd through it is right, and
that the dtype options move the bytes they promise.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from hp_dtensor.pending import PendingTensor
from hp_testing import record_collectives

PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial("sum")]


def _make(full: torch.Tensor, mesh, placements) -> DTensor:  # type: ignore[no-untyped-def]
    """``full`` under ``placements``; a Partial mesh dim holds its value on group rank 0, zeros elsewhere."""
    local = full.clone()
    for m, p in enumerate(placements):
        if isinstance(p, Partial) and mesh.get_local_rank(m) != 0:
            local = torch.zeros_like(local)
    lifted = [p if isinstance(p, Partial) else Replicate() for p in placements]
    whole = DTensor.from_local(local, mesh, lifted)
    # Replicate -> Shard is a local cut: no communication, and the Partial dims stay partial.
    cut = whole.redistribute(placements=placements)
    assert cut.placements == tuple(placements)
    return cut


@pytest.mark.distributed(world_size=4)
def test_every_pair_matches_the_synchronous_result(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    full = torch.arange(5 * 6, dtype=torch.float64).reshape(5, 6)  # uneven over 2 on both dims
    for src in itertools.product(PLACEMENTS, repeat=2):
        for dst in itertools.product([p for p in PLACEMENTS if not isinstance(p, Partial)], repeat=2):
            x = _make(full, mesh, src)
            with record_collectives() as sync_log:
                expected = x.redistribute(placements=dst)
            with record_collectives() as log:
                y = x.redistribute(placements=dst, async_op=True)
            assert y.placements == dst and y.shape == full.shape
            flags = [record.async_op for record in log.of()]
            assert log.counts() == sync_log.counts(), (src, dst)
            if flags:  # the last collective is in flight, the earlier ones were waited for
                assert flags == [False] * (len(flags) - 1) + [True], (src, dst, flags)
                assert isinstance(y._local, PendingTensor) and not y._local.completed
            torch.testing.assert_close(y.to_local() + 0, expected.to_local(), rtol=0, atol=0)
            torch.testing.assert_close(y.full_tensor(), full)


@pytest.mark.distributed(world_size=2)
def test_ragged_source(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    rows = [(0, 2), (2, 7)][rank]  # 2 and 5 rows: not torch.chunk's 4 and 3
    x = DTensor.from_local(full[rows[0] : rows[1]], mesh, [Shard(0)], shape=full.shape)
    for dst in ([Replicate()], [Shard(1)], [Shard(0)]):
        y = x.redistribute(placements=dst, async_op=True)
        assert isinstance(y._local, PendingTensor) and not y._local.completed
        torch.testing.assert_close(y.full_tensor(), full)


@pytest.mark.distributed(world_size=2)
def test_work_is_pending_until_first_use(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(full, mesh, [Shard(0)])
    token = torch.zeros(1)
    side = dist.new_group([0, 1])
    if rank == 0:
        # Rank 1 joins the all-gather only after rank 0 sends it a token, which rank 0 does after
        # its redistribute returned: were the call blocking until the gather completed, both would
        # wait forever (the harness's timeout fails the test).
        y = x.redistribute(placements=[Replicate()], async_op=True)
        work = y._local.work
        assert work is not None and not work.is_completed()
        dist.send(token, dst=1, group=side)
        local = y.to_local()  # a view: still in flight, as torch's AsyncCollectiveTensor
        assert isinstance(local, PendingTensor) and not work.is_completed()
        doubled = local * 2  # first use: waits
        assert work.is_completed() and y._local.completed
        assert type(doubled) is torch.Tensor
        torch.testing.assert_close(doubled, full * 2)
        torch.testing.assert_close(local.t() + 0, full.t())
    else:
        dist.recv(token, src=0, group=side)
        y = x.redistribute(placements=[Replicate()])
        torch.testing.assert_close(y.to_local(), full)
    # A DTensor op on the pending tensor waits too, and the result is a plain DTensor again.
    z = x.redistribute(placements=[Replicate()], async_op=True)
    assert not z._local.completed
    total = (z * 3).sum()
    assert z._local.completed and not isinstance(total._local, PendingTensor)
    torch.testing.assert_close(total.full_tensor(), full.sum() * 3)
    # Redistributing a pending tensor again waits for it first.
    again = x.redistribute(placements=[Replicate()], async_op=True).redistribute(placements=[Shard(1)])
    torch.testing.assert_close(again.full_tensor(), full)


@pytest.mark.distributed(world_size=2)
def test_autograd_through_async_and_dtypes(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(4, 6, generator=gen)
    weight = torch.randn(4, 6, generator=gen)

    # Reference on plain tensors: the cast to bf16 and back is what the forward does.
    ref = full.clone().requires_grad_()
    (ref.to(torch.bfloat16).float() * weight).sum().backward()

    for backward_dtype, expected in ((None, torch.float32), (torch.float16, torch.float16)):
        x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        with record_collectives() as log:
            y = x.redistribute(
                placements=[Shard(1)],
                async_op=True,
                forward_dtype=torch.bfloat16,
                backward_dtype=backward_dtype,
            )
        assert y.dtype == torch.bfloat16 and y.placements == (Shard(1),)
        assert [(r.name, r.dtype, r.async_op) for r in log.of()] == [
            ("all_to_all_single", torch.bfloat16, True)
        ]
        w = distribute_tensor(weight, mesh, [Shard(1)])
        with record_collectives() as log:
            (y.float() * w).sum().backward()
        # The gradient's all-to-all ran at backward_dtype (the input's when None) and async.
        assert [(r.name, r.dtype, r.async_op) for r in log.of("all_to_all_single")] == [
            ("all_to_all_single", expected, True)
        ]
        assert x.grad.dtype == torch.float32 and x.grad.placements == (Shard(0),)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad)

    # Without async_op the same path is synchronous and gives the same values.
    x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    y = x.redistribute(placements=[Replicate()], forward_dtype=torch.bfloat16)
    assert not isinstance(y._local, PendingTensor)
    torch.testing.assert_close(y.to_local(), full.to(torch.bfloat16))
    # Same placements but another dtype still casts (torch's behaviour); same dtype returns self.
    assert x.redistribute(placements=[Shard(0)], forward_dtype=torch.float64).dtype == torch.float64
    assert x.redistribute(placements=[Shard(0)], forward_dtype=torch.float32) is x


@pytest.mark.distributed(world_size=2)
def test_bad_options_raise_before_communicating(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with record_collectives() as log:
        with pytest.raises(TypeError, match=r"async_op must be True or False, got str 'yes'"):
            x.redistribute(placements=[Replicate()], async_op="yes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"forward_dtype must be a torch.dtype or None, got str 'bf16'"):
            x.redistribute(placements=[Replicate()], forward_dtype="bf16")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"backward_dtype must be a torch.dtype"):
            x.redistribute(placements=[Replicate()], backward_dtype=16)  # type: ignore[arg-type]
    assert log.count() == 0

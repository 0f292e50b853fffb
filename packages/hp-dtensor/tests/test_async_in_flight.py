"""Several asynchronous redistributions in flight at once, and pending values entering torch.compile.

``redistribute(..., async_op=True)`` leaves its last collective in flight
([Note: asynchronous redistribution] in ``hp_dtensor/pending.py``): issued
back to back, several redistributions (on one mesh dim or on different ones
of a 2-D mesh) all return before any completes, and each result waits on its
own first use. A pending local tensor handed to a ``torch.compile``d
function waits at the compiled code's entry ([Note: a pending tensor entering
a compiled region]). Values against plain tensors; collectives counted.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from hp_dtensor import DTensor, Replicate, Shard, distribute_tensor
from hp_dtensor.pending import PendingTensor
from hp_testing import record_collectives


def _full(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _issue(x: DTensor, targets) -> list[DTensor]:  # type: ignore[no-untyped-def]
    return [x.redistribute(placements=t, async_op=True) for t in targets]


@pytest.mark.distributed(world_size=4)
def test_back_to_back_redistributions_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    full = _full(6, 5, 0)  # uneven on both dims
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    targets = [
        [Replicate(), Shard(1)],  # an all-gather over mesh dim 0
        [Shard(0), Replicate()],  # an all-gather over mesh dim 1
        [Shard(0), Shard(0)],  # an all-to-all over mesh dim 1
    ]
    token = torch.zeros(1)
    side = dist.new_group([0, 1, 2, 3])
    if rank == 0:
        # The others join the collectives only after rank 0 sends them a token, which it does once every
        # redistribution has returned: had any call blocked until its collective completed, all would hang.
        with record_collectives() as log:
            ys = _issue(x, targets)
        for peer in (1, 2, 3):
            dist.send(token, dst=peer, group=side)
    else:
        dist.recv(token, src=0, group=side)
        with record_collectives() as log:
            ys = _issue(x, targets)
    # A plan of two steps: the second gathers what the first gathered, so the first is waited for
    # before the second is issued ([Note: asynchronous redistribution]); the last is in flight.
    with record_collectives() as two_steps:
        ys += _issue(x, [[Replicate(), Replicate()]])
    targets.append([Replicate(), Replicate()])
    assert [(r.name, r.async_op) for r in [*log.of(), *two_steps.of()]] == [
        ("all_gather_into_tensor", True),
        ("all_gather_into_tensor", True),
        ("all_to_all_single", True),
        ("all_gather_into_tensor", False),
        ("all_gather_into_tensor", True),
    ]
    pending = [y._local for y in ys]
    assert all(isinstance(p, PendingTensor) and not p.completed for p in pending)  # four in flight
    # Each waits on its own first use, in any order; the others stay in flight.
    order = [2, 0, 3, 1]
    for used, index in enumerate(order):
        y = ys[index]
        torch.testing.assert_close(y.full_tensor(), full)
        assert [p.completed for p in pending] == [i in order[: used + 1] for i in range(4)]
    for y, target in zip(ys, targets, strict=True):
        assert y.placements == tuple(target)


@pytest.mark.distributed(world_size=2)
def test_pending_tensors_entering_compiled_functions(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch._dynamo.reset()
    step = torch.compile(lambda t: (t * 2 + 1).sum(0), backend="aot_eager", fullgraph=True)
    for seed in (1, 2):  # the second call runs the compiled code with a new pending value
        full = _full(6, 4, seed)
        x = distribute_tensor(full, mesh, [Shard(0)])
        y, z = _issue(x, [[Replicate()], [Shard(1)]])  # two in flight
        local = y.to_local()
        assert isinstance(local, PendingTensor) and not y._local.completed
        out = step(local)  # waits at the compiled code's entry
        assert type(out) is torch.Tensor and y._local.completed and not z._local.completed
        torch.testing.assert_close(out, (full * 2 + 1).sum(0))
        # A DTensor whose local tensor is pending, into a compiled DTensor function.
        torch.testing.assert_close(
            torch.compile(lambda d: (d * 3).to_local(), backend="aot_eager", fullgraph=True)(z),
            (full * 3)[:, [0, 1] if rank == 0 else [2, 3]],
        )
        assert z._local.completed

"""The hot paths make no host sync: FSDP, FSDP x TP with clipping and AdamW, redistributions, 1F1B.

A device->host read inside a training step stalls the GPU/NPU stream every
step; on CPU it costs nothing, so only counting finds it
(:func:`hp_testing.count_host_syncs`). Each path below trains or moves tiny
tensors for a warm-up step (first-use work: lazy init, plans built once), then
counts the host syncs of the next steps, which must be zero, and checks the
numbers against a plain single-process copy, so a path that stopped syncing by
computing something else would fail too. The warm-up step is not asserted on
(the ranks agree on the plan there, once); the reads in ``ALLOW`` are CPU-only
or the pipeline's failure vote, by design (see there).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Partial,
    Replicate,
    RowwiseParallel,
    Shard,
    distribute_tensor,
    parallelize_module,
)
from hp_fsdp import MixedPrecisionPolicy, fully_shard
from hp_pipeline import PipelineStage, Schedule1F1B
from hp_testing import HostSyncLog, count_host_syncs
from torch import nn

WIDTH, HIDDEN = 8, 12  # HIDDEN even: TP over 2 ranks cuts it evenly
RTOL, ATOL = 1e-5, 1e-6
# Reads that are not device syncs, or are by design:
# - FSDP checks that the ranks' reductions paired up by reading the reduced tag only where the
#   buffers live on the CPU ([Note: one unit's reduction met another's] in hp_fsdp/collectives.py);
#   on an accelerator it is skipped, so on CPU it is the one read a device run does not make;
# - the pipeline's end-of-step failure vote is the one host wait a step needs by design (every rank
#   must learn whether any failed before step() returns); on an accelerator it waits on a side
#   stream only ([Note: vote off the compute stream] in hp_pipeline/vote.py).
ALLOW = ["hp_fsdp/collectives.py:check_paired", "hp_pipeline/vote.py:close"]


def _no_syncs(log: HostSyncLog, where: str) -> None:
    assert log.count == 0, f"{where}: {log.report()}"


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Mlp(nn.Module):
    """``x + down(gelu(up(x)))``: TP cuts ``up`` by columns and ``down`` by rows."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def _model(blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Mlp() for _ in range(blocks)])


def _data(step: int, n: int, out: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, WIDTH, generator=gen), torch.randn(n, out, generator=gen)


def _compare_params(model: nn.Module, reference: nn.Module, where: str) -> None:
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        _close(_full(p.detach()).to(want[name].dtype), want[name].detach(), f"{where}: {name}")


# -- FSDP: mixed precision, gradient accumulation, explicit prefetch, fused AdamW -----------------

PER_MICRO, MICRO, STEPS = 2, 2, 3
OUT = 5  # the head's rows: cut 3 / 2 over 2 ranks, an uneven shard


@pytest.mark.distributed(world_size=2, timeout=120)
def test_fsdp_step_makes_no_host_sync(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    """fully_shard per block, head and root, float64 compute over float32 shards, 2 micro-batches a step."""
    mesh = device_mesh_factory((world_size,), ("dp",))
    model = nn.Sequential(*_model(), nn.Linear(WIDTH, OUT))
    reference = copy.deepcopy(model).double()
    mp = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    blocks = list(model)
    for i in range(len(blocks) - 1):
        blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])
        blocks[i + 1].set_modules_to_backward_prefetch([blocks[i]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)

    def step(i: int) -> list[torch.Tensor]:
        losses = []
        for micro in range(MICRO):
            x, y = _data(10 * i + micro, world_size * PER_MICRO, OUT)
            mine = slice(rank * PER_MICRO, (rank + 1) * PER_MICRO)
            model.set_requires_gradient_sync(micro == MICRO - 1)
            loss = nn.functional.mse_loss(model(x[mine]), y[mine]) / MICRO
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        return losses

    for i in range(STEPS):
        with count_host_syncs(allow=ALLOW) as log:
            losses = step(i)
        if i:  # the first step also agrees on the plan across ranks, once
            _no_syncs(log, f"FSDP step {i}")
        ref_losses = []
        for micro in range(MICRO):
            x, y = _data(10 * i + micro, world_size * PER_MICRO, OUT)
            ref_loss = nn.functional.mse_loss(reference(x.double()), y.double()) / MICRO
            ref_loss.backward()
            ref_losses.append(ref_loss.detach())
        ref_opt.step()
        ref_opt.zero_grad()
        for micro, loss in enumerate(losses):
            mean = loss.clone()
            dist.all_reduce(mean)
            _close(mean / world_size, ref_losses[micro], f"FSDP step {i} micro {micro}: loss")
        _compare_params(model, reference, f"FSDP step {i}")


# -- FSDP x TP: clip_grad_norm_ and AdamW (fused, foreach) -------------------------------------


@pytest.mark.distributed(world_size=4, timeout=180)
@pytest.mark.parametrize("optim", ["fused", "foreach"])
def test_fsdp_x_tp_clip_and_adamw_make_no_host_sync(rank: int, device_mesh_factory: Any, optim: str) -> None:
    """dp=2 x tp=2, every parameter on a 2-D mesh; the clip and the step are counted with the rest."""
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    model = _model(2).double()
    reference = copy.deepcopy(model)
    for block in model:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    kwargs = {"fused": True} if optim == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    dp_rank = mesh.get_local_rank("dp")
    for i in range(STEPS):
        x, y = _data(i, 2 * PER_MICRO)
        mine = slice(dp_rank * PER_MICRO, (dp_rank + 1) * PER_MICRO)
        with count_host_syncs(allow=ALLOW) as log:
            loss = nn.functional.mse_loss(model(x[mine].double()), y[mine].double())
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1, foreach=True)
            opt.step()
            opt.zero_grad()
        if i:
            _no_syncs(log, f"FSDP x TP ({optim} AdamW) step {i}")
        ref_loss = nn.functional.mse_loss(reference(x.double()), y.double())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1, foreach=False)
        ref_opt.step()
        ref_opt.zero_grad()
        assert float(ref_norm) > 0.1, "every step clips"
        _close(_full(norm), ref_norm, f"step {i}: total norm")
        _compare_params(model, reference, f"FSDP x TP ({optim}) step {i}")


# -- DTensor redistributions, even and uneven --------------------------------------------------

# (shape, from, to): uneven shapes put 3 rows on rank 0 and 2 on rank 1.
MOVES = [
    ((4, 6), Shard(0), Replicate()),
    ((5, 3), Shard(0), Replicate()),
    ((5, 3), Shard(0), Shard(1)),
    ((3, 5), Shard(1), Shard(0)),
    ((5, 3), Replicate(), Shard(0)),
    ((5, 3), Partial(), Replicate()),
    ((5, 3), Partial(), Shard(0)),
    ((7,), Shard(0), Replicate()),
]


@pytest.mark.distributed(world_size=2, timeout=120)
def test_redistributions_make_no_host_sync(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    mesh = device_mesh_factory((world_size,))
    for shape, src, dst in MOVES:
        gen = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
        whole = torch.randn(shape, generator=gen, requires_grad=True)
        where = f"{src} -> {dst} of {tuple(shape)}"
        if isinstance(src, Partial):
            part = whole.detach() / world_size  # each rank holds an equal share of the sum
            start = DTensor.from_local(part.clone(), mesh, [src])
        else:
            start = distribute_tensor(whole.detach(), mesh, [src])
        start = start.detach().requires_grad_()  # a leaf, whose .grad the backward fills
        for attempt in range(2):
            with count_host_syncs(allow=ALLOW) as log:
                moved = start.redistribute(mesh, [dst])
                out = (moved * 2).sum() if not isinstance(dst, Partial) else moved.to_local().sum()
                out.backward()
            if attempt:  # the first move plans it, once
                _no_syncs(log, where)
            grad = start.grad
            start.grad = None
        _close(moved.full_tensor(), whole.detach(), f"{where}: values")
        assert grad is not None
        if not isinstance(src, Partial):
            _close(_full(grad), torch.full(shape, 2.0), f"{where}: gradient")


# -- a pipeline step: hp_pipeline's executor running 1F1B --------------------------------------


# What the vote reads: gloo's flags (host tensors), or NCCL's side-stream event and pinned buffer.
VOTE_READS = {"aten._local_scalar_dense", "event.synchronize()"}


@pytest.mark.parametrize(
    "backend_name",
    [
        pytest.param(b, marks=pytest.mark.distributed(world_size=2, backend=b, timeout=120), id=b)
        for b in ("gloo", "nccl-emu")
    ],
)
def test_1f1b_step_makes_no_host_sync(rank: int, world_size: int, backend_name: str) -> None:
    """hp_pipeline's executor: p2p transfers waited, losses and grads; only the vote reads (ALLOW)."""
    blocks = list(_model(2))
    reference = nn.Sequential(*copy.deepcopy(blocks))
    stage = PipelineStage(copy.deepcopy(blocks[rank]), rank, world_size)
    schedule = Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    for i in range(STEPS):
        x, y = _data(i, 8)
        losses: list[torch.Tensor] = []
        with count_host_syncs(allow=ALLOW) as log:
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        if i:  # the first step agrees on the schedule across ranks and learns the shapes, once
            _no_syncs(log, f"1F1B step {i} on rank {rank}")
            assert {s.what for s in log.allowed} <= VOTE_READS, log.allowed
        reference.zero_grad()
        pieces = zip(x.chunk(4), y.chunk(4), strict=True)
        ref_losses = [nn.functional.mse_loss(reference(xm), ym) for xm, ym in pieces]
        (sum(ref_losses) / 4).backward()  # type: ignore[union-attr]  # the schedule averages grads
        if rank == 1:
            for got, want in zip(losses, ref_losses, strict=True):
                _close(got.detach(), want.detach(), f"1F1B step {i}: loss")
        for name, p in stage.submod.named_parameters():
            want = dict(reference[rank].named_parameters())[name]
            _close(p.grad, want.grad, f"1F1B step {i}: grad of {name}")
        stage.submod.zero_grad()

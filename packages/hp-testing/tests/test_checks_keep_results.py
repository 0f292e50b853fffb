"""The cross-rank checks must never change a program's numbers.

torch's own FSDP2 waits an async all-gather only when its handle is a
``torch.distributed.Work`` (``isinstance(work, dist.distributed_c10d.Work)`` in
``_fsdp_collectives.foreach_all_gather_copy_out``); a handle of another type is
taken for "already done". The checks once returned such a handle (a wrapper
around torch's work, so that the comparison with the peers runs at ``wait()``),
and FSDP2 read the unsharded parameters while gloo was still gathering them:
torch's ``ScheduleInterleaved1F1B`` over ``fully_shard`` stages (which unshard
with ``async_op=True``) got gradients off by O(1) or NaN under the checks and
right ones without. Likewise torch code must take the same path under the
layer as without it: ``dist.P2POp`` keeps ``dist.isend`` (torch's pipelining
tells an all-send list by identity). The numeric cases run the same program
on one process and compare values and gradients.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

# -- the handles themselves ------------------------------------------------------------------


def _async_ops_return_torch_works(rank: int) -> None:
    """Every async call hands back a ``dist.Work`` whose ``wait()`` leaves the real result in place."""
    peer = 1 - rank
    inp = torch.full((3,), float(rank + 1))
    out = torch.empty(6)
    gather = dist.all_gather_into_tensor(out, inp, async_op=True)
    summed = torch.full((2,), float(rank + 1))
    reduce = dist.all_reduce(summed, async_op=True)
    sent, got = torch.full((4,), 10.0 + rank), torch.empty(4)
    send, recv = dist.isend, dist.irecv  # each send meets its receive (NCCL runs a pair's ops in order)
    p2p = [send(sent, peer), recv(got, peer)] if rank == 0 else [recv(got, peer), send(sent, peer)]
    sent2, got2 = torch.full((5,), 20.0 + rank), torch.empty(5)
    batch = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent2, peer), dist.P2POp(dist.irecv, got2, peer)])
    works = [gather, reduce, *p2p, *batch]
    kinds = [type(w).__name__ for w in works if not isinstance(w, dist.Work)]
    assert not kinds, f"handles that torch's isinstance(work, dist.Work) tests take for done: {kinds}"
    for work in works:
        work.wait()
    assert torch.equal(out, torch.tensor([1.0] * 3 + [2.0] * 3))
    assert torch.equal(summed, torch.full((2,), 3.0))
    assert torch.equal(got, torch.full((4,), 10.0 + peer))
    assert torch.equal(got2, torch.full((5,), 20.0 + peer))


@pytest.mark.distributed(world_size=2)
def test_async_handles_are_torch_works(rank: int) -> None:
    _async_ops_return_torch_works(rank)


@pytest.mark.distributed(world_size=2, strict=True)
def test_async_handles_are_torch_works_strict(rank: int) -> None:
    _async_ops_return_torch_works(rank)


@pytest.mark.distributed(world_size=2, backend="nccl-emu", strict=True)
def test_async_handles_are_torch_works_nccl_emu_strict(rank: int) -> None:
    _async_ops_return_torch_works(rank)


# -- P2POp keeps dist.isend / dist.irecv ----------------------------------------------------


def _issue(ops: list[dist.P2POp]) -> list[dist.Work]:
    """What torch's pipelining does with a list of ops (``schedules._batch_p2p``, in short): an
    all-send or all-receive list as single ops, told apart by identity with ``dist.isend``."""
    kinds = {op.op for op in ops}
    if kinds == {dist.isend} or kinds == {dist.irecv}:
        return [op.op(op.tensor, op.peer) for op in ops]
    return dist.batch_isend_irecv(ops)


@pytest.mark.distributed(world_size=2)
def test_p2pop_keeps_the_functions_torch_code_compares_with(rank: int) -> None:
    """A ``P2POp`` holds ``dist.isend`` itself, and a mixed batch of them still moves the right data."""
    peer = 1 - rank
    sent, got = torch.full((3,), 1.0 + rank), torch.empty(3)
    ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, got, peer)]
    assert ops[0].op is dist.isend and ops[1].op is dist.irecv
    for work in _issue(ops):
        work.wait()
    assert torch.equal(got, torch.full((3,), 1.0 + peer))


@pytest.mark.distributed(world_size=3, backend="nccl-emu")
def test_single_sends_of_torch_pipelining_are_not_a_first_batch(rank: int) -> None:
    """Ranks 0 and 1 exchange as torch's pipelining does, rank 2 takes no part: on NCCL these are
    single sends and receives, not a group's first ``batch_isend_irecv`` (which every rank of the
    group must join); the layer once turned them into one and reported rank 2 missing."""
    tensor = torch.full((2,), 5.0) if rank == 0 else torch.empty(2)
    if rank == 0:
        works = _issue([dist.P2POp(dist.isend, tensor, 1)])
    elif rank == 1:
        works = _issue([dist.P2POp(dist.irecv, tensor, 0)])
    else:
        works = []
    for work in works:
        work.wait()
    if rank == 1:
        assert torch.equal(tensor, torch.full((2,), 5.0))


# -- the smallest torch program that showed it -----------------------------------------------


@pytest.mark.distributed(world_size=2)
def test_fsdp2_async_unshard_reads_the_gathered_weights(rank: int) -> None:
    """``fully_shard(...).unshard(async_op=True).wait()`` then forward/backward, as PP schedules do.

    Rank 1 joins the all-gather late, so rank 0's gather is surely still in
    flight when it asks for the parameters: a handle FSDP2 does not wait
    shows up as a wrong output on rank 0.
    """
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    whole = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    part = copy.deepcopy(whole)
    fully_shard(part)
    part.set_gradient_divide_factor(1.0)
    part.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    if rank == 1:
        time.sleep(0.5)  # orders the ranks only; nothing is measured
    part.unshard(async_op=True).wait()
    out = part(x)
    out.sum().backward()
    expected = whole(x)
    expected.sum().backward()
    assert torch.allclose(out, expected), f"rank {rank}: max |diff| {(out - expected).abs().max().item()}"
    for (name, ours), theirs in zip(part.named_parameters(), whole.parameters(), strict=True):
        grad = ours.grad.full_tensor() / 2  # both ranks ran the same batch; the sum reduction adds them
        assert torch.allclose(grad, theirs.grad), (
            f"{name}: max |diff| {(grad - theirs.grad).abs().max().item()}"
        )


# -- torch's own PP x FSDP (was packages/hp-torchtitan/tests/test_pipeline_harness_repro.py) ---


def _pp_grads_match_one_process(pp: int, world: int, steps: int = 3) -> None:
    """torch's ``ScheduleInterleaved1F1B`` over ``fully_shard`` stages on a (pp, dp) mesh, vs one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    dp, num_stages = world // pp, 2 * pp
    torch.manual_seed(0)
    whole = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(num_stages)])
    inputs, targets = torch.randn(steps, 4 * dp, 64), torch.randn(steps, 4 * dp, 64)
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    mine = [pp_rank + s * pp for s in range(2)]
    parts = [copy.deepcopy(whole[i]) for i in mine]
    for part in parts:
        fully_shard(part, mesh=mesh["dp"])
        part.set_gradient_divide_factor(1.0)
        part.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    stages = [
        PipelineStage(part, index, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        for part, index in zip(parts, mine, strict=True)
    ]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).sum()

    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=loss_fn, scale_grads=False)
    wrong = []
    rows = slice(dp_rank * 4, (dp_rank + 1) * 4)
    for step in range(steps):
        for part in parts:
            part.zero_grad()
        whole.zero_grad()
        args = (inputs[step][rows],) if pp_rank == 0 else ()
        schedule.step(*args, target=targets[step][rows] if stages[-1].is_last else None)
        loss_fn(whole(inputs[step]), targets[step]).backward()
        for part, index in zip(parts, mine, strict=True):
            for (name, ours), theirs in zip(part.named_parameters(), whole[index].parameters(), strict=True):
                grad = ours.grad.full_tensor()
                if not torch.allclose(grad, theirs.grad, rtol=1e-4, atol=1e-4):
                    wrong.append((step, index, name, (grad - theirs.grad).abs().max().item()))
    assert not wrong, f"(step, stage, param, max |diff|): {wrong[:4]}"


@pytest.mark.distributed(world_size=4, timeout=200)
def test_torch_interleaved_pp_x_fsdp_gradients(rank: int) -> None:
    _pp_grads_match_one_process(pp=2, world=4)


@pytest.mark.distributed(world_size=2, timeout=200)
def test_torch_interleaved_pp_gradients(rank: int) -> None:
    _pp_grads_match_one_process(pp=2, world=2)

"""Cross-rank checks with planted bugs: each is caught on every rank with the right message.

One inner pytest session per group of scenarios (pools are reused inside it),
so the planted bugs cost a second or two each. Every bug has a correct
neighbour in the same session that must pass: no false positives.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest

HEADER = "import pytest\nimport torch\nimport torch.distributed as dist\nimport hp_core\n"


def _run(inner: Any, body: str) -> tuple[pytest.RunResult, dict[str, str]]:
    """``body`` (dedented, after the common imports) in an inner session (the ``inner`` fixture)."""
    return inner(HEADER + textwrap.dedent(body))


COLLECTIVES = """
@pytest.mark.distributed(world_size=2)
def test_bug_different_op(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(4), src=0)

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_bug_skipped_collective(rank):
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2)
def test_bug_shape(rank):
    dist.all_reduce(torch.ones(4 + rank))

@pytest.mark.distributed(world_size=2, backend="hccl-emu")
def test_bug_dtype(rank):
    dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float16))

@pytest.mark.distributed(world_size=2)
def test_bug_reduce_op(rank):
    dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)

@pytest.mark.distributed(world_size=4)
def test_bug_group_order(rank):
    a = dist.new_group([0, 1, 2, 3])
    b = dist.new_group([0, 1, 2, 3])
    first, second = (a, b) if rank != 3 else (b, a)
    dist.all_reduce(torch.ones(1), group=first)
    dist.all_reduce(torch.ones(1), group=second)

@pytest.mark.distributed(world_size=4)
def test_bug_non_member(rank):
    g = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=g)

@pytest.mark.distributed(world_size=2)
def test_bug_all_to_all_splits(rank):
    out = torch.empty(3)
    ins = [1, 2] if rank == 0 else [1, 2]
    outs = [1, 2] if rank == 0 else [1, 2]
    dist.all_to_all_single(out, torch.ones(3), outs, ins)

@pytest.mark.distributed(world_size=2)
def test_bug_broadcast_object_list_lengths(rank):
    dist.broadcast_object_list([1, 2] if rank == 0 else [None], src=0)

@pytest.mark.distributed(world_size=2, timeout=600)
def test_bug_rank_raises_mid_step(rank):
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        raise ValueError("boom in step 3 on rank 1")
    dist.all_reduce(torch.ones(1))

@pytest.mark.distributed(world_size=4, backend="nccl-emu")
def test_ok_same_program(rank, device_mesh_factory):
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    t = torch.ones(2, 4)
    dist.all_reduce(t.view(8))  # same count, other shape: fine on every backend
    hp_core.all_reduce(torch.ones(3), "avg", group=mesh["dp"])
    hp_core.all_gather_into_tensor(torch.empty(3), torch.ones(1 + mesh.get_local_rank("tp")),
                                   mesh["tp"], input_sizes=[1, 2])
    hp_core.reduce_scatter_tensor(torch.empty(2), torch.ones(4), "premul_sum", mesh["tp"], scale=0.5)
    hp_core.broadcast(torch.ones(2), src=0)
    hp_core.barrier()
    assert hp_core.all_gather_object(rank) == [0, 1, 2, 3]
"""


def test_collective_mismatches_are_reported_side_by_side(inner: Any) -> None:
    result, sections = _run(inner, COLLECTIVES)
    result.assert_outcomes(passed=1, failed=10)

    text = sections["test_bug_different_op"]
    assert "disagree on collective #0 of this test" in text
    assert re.search(
        r"rank 0: all_reduce\(tensor 4 torch.float32, op SUM\)\s+at .*test_inner.py:\d+ in test_bug_",
        text,
    )
    assert re.search(
        r"rank 1: broadcast\(tensor 4 torch.float32, root 0\)\s+at .*test_inner.py:\d+ in test_bug_",
        text,
    )
    assert "failed on rank(s) [0, 1]" in text  # raised on every rank

    text = sections["test_bug_skipped_collective"]
    assert "rank 1 finished the test while rank 0 waited for it in all_reduce(tensor 2" in text
    assert "It issued 1 collective(s) on that group; the last was all_reduce(tensor 1" in text

    assert re.search(
        r"rank 0: all_reduce\(tensor 4 torch.float32.*\n.*rank 1: all_reduce\(tensor 5",
        sections["test_bug_shape"],
    )
    assert "torch.float16" in sections["test_bug_dtype"] and "hccl-emu" in sections["test_bug_dtype"]
    assert "op MAX" in sections["test_bug_reduce_op"]

    text = sections["test_bug_group_order"]
    assert "disagree on collective #0" in text or "deadlock" in text

    text = sections["test_bug_non_member"]
    assert "rank 2 is not a member of the group it passed" in text
    assert "rank 3 is not a member" in text

    text = sections["test_bug_all_to_all_splits"]
    assert "split sizes disagree" in text
    assert "rank 0 sends 2 to rank 1 (input split 1" in text and "rank 1 expects 1 from rank 0" in text

    assert "disagree" in sections["test_bug_broadcast_object_list_lengths"]

    text = sections["test_bug_rank_raises_mid_step"]
    assert "ValueError: boom in step 3 on rank 1" in text
    assert "rank 1 failed while rank 0 waited for it in all_reduce" in text
    assert "timeout" not in text


P2P = """
@pytest.mark.distributed(world_size=2)
def test_bug_send_without_receive(rank):
    if rank == 0:
        dist.isend(torch.ones(2), 1).wait()

@pytest.mark.distributed(world_size=2, strict=False)  # strict mode would report the wait first
def test_bug_send_never_waited_nor_received(rank):
    if rank == 0:
        dist.isend(torch.ones(2), 1)

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_bug_batch_shapes(rank):
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, torch.ones(2 + rank), peer), dist.P2POp(dist.irecv, torch.empty(2), peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()

@pytest.mark.distributed(world_size=3, backend="nccl-emu")
def test_bug_batch_peers(rank):
    # rank 0 sends to 1, but rank 1 expects from 2 and rank 2 expects from 0
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.ones(1), 1), dist.P2POp(dist.irecv, torch.empty(1), 2)]
    elif rank == 1:
        ops = [dist.P2POp(dist.isend, torch.ones(1), 2), dist.P2POp(dist.irecv, torch.empty(1), 2)]
    else:
        ops = [dist.P2POp(dist.isend, torch.ones(1), 0), dist.P2POp(dist.irecv, torch.empty(1), 0)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_bug_send_send_deadlock(rank):
    peer = 1 - rank
    dist.send(torch.ones(2), peer)
    dist.recv(torch.empty(2), peer)

@pytest.mark.distributed(world_size=2, backend="hccl-emu")
def test_bug_isend_irecv_opposite_order(rank):
    peer = 1 - rank
    works = [dist.isend(torch.ones(2), peer), dist.irecv(torch.empty(2), peer)]
    for w in works:
        w.wait()

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_bug_tags_cross(rank):
    if rank == 0:
        a, b = dist.isend(torch.ones(1), 1, tag=1), dist.isend(torch.ones(1), 1, tag=2)
    else:
        b, a = dist.irecv(torch.empty(1), 0, tag=2), dist.irecv(torch.empty(1), 0, tag=1)
    a.wait(); b.wait()

@pytest.mark.distributed(world_size=4, backend="nccl-emu")
def test_ok_ring_and_pipeline(rank):
    nxt, prev = (rank + 1) % 4, (rank - 1) % 4
    got = torch.empty(2)
    hp_core.batch_isend_irecv([hp_core.P2POp("isend", torch.full((2,), float(rank)), nxt),
                               hp_core.P2POp("irecv", got, prev)]).wait()
    assert got.tolist() == [float(prev)] * 2
    if rank % 2 == 0:
        dist.send(torch.ones(3), rank + 1)
        dist.recv(got, rank + 1)
    else:
        dist.recv(torch.empty(3), rank - 1)
        dist.send(torch.ones(2), rank - 1)
    works = [dist.irecv(torch.empty(1), prev), dist.isend(torch.ones(1), nxt)] if rank else \\
        [dist.isend(torch.ones(1), nxt), dist.irecv(torch.empty(1), prev)]
    for w in works:
        w.wait()
"""


def test_p2p_bugs_name_both_ends(inner: Any) -> None:
    result, sections = _run(inner, P2P)
    result.assert_outcomes(passed=1, failed=7)

    text = sections["test_bug_send_without_receive"]
    assert "rank 1 finished the test while rank 0 waited for it in isend(2 torch.float32 to rank 1)" in text
    assert "waiting for rank 1's matching receive" in text

    text = sections["test_bug_send_never_waited_nor_received"]
    assert "failed on rank(s) [0, 1]" in text  # both ends report it
    assert "rank 0 sent 1 message(s) to rank 1 but rank 1 received 0" in text
    assert "first unreceived: #0 isend(2 torch.float32 to rank 1) at" in text

    text = sections["test_bug_batch_shapes"]
    assert "message #0 from rank 1 to rank 0: the two ends disagree" in text
    assert re.search(r"rank 0: irecv\(2 torch.float32 from rank 1\)\s+at .*test_inner.py:\d+", text)
    assert re.search(r"rank 1: isend\(3 torch.float32 to rank 0\)\s+at .*test_inner.py:\d+", text)

    text = sections["test_bug_batch_peers"]  # wrong peers: every rank's posted ops, unmatched ones marked
    assert "UnmatchedError: unmatched point-to-point ops: ranks [" in text
    assert "Point-to-point ops posted by each rank since its last fully matched point (4 without" in text
    assert re.search(
        r"rank 0: isend\(1 torch.float32 to rank 1\)\s+message #0 0->1  NO COUNTERPART: rank 1 "
        r"posted no receive from rank 0  at .*test_inner.py:\d+",
        text,
    )
    assert re.search(r"irecv\(1 torch.float32 from rank 2\)\s+message #0 2->0  matched", text)
    assert "NO COUNTERPART: rank 2 posted no send to rank 1" in text

    text = sections["test_bug_send_send_deadlock"]
    assert re.search(r"deadlock: ranks \[\d, \d\] wait on each other in a cycle", text)
    assert re.search(r"rank 0: waits in send\(2 torch.float32 to rank 1\).*test_inner.py:\d+", text)
    assert re.search(r"rank 1: waits in send\(2 torch.float32 to rank 0\).*test_inner.py:\d+", text)

    text = sections["test_bug_isend_irecv_opposite_order"]
    assert "post their point-to-point ops to each other in opposite orders" in text
    assert "batch_isend_irecv" in text

    assert "the tags differ" in sections["test_bug_tags_cross"]


STRICT = """
@pytest.mark.distributed(world_size=2, strict=True)
def test_bug_read_before_wait(rank):
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True)
    total = t.sum().item()  # too early
    work.wait()
    assert total == 4.0, f"read {total} before wait()"

@pytest.mark.distributed(world_size=2, strict=True)
def test_bug_input_modified_before_wait(rank):
    shard = torch.ones(2)
    work = dist.all_gather_into_tensor(torch.empty(4), shard, async_op=True)
    shard.add_(1)
    work.wait()

@pytest.mark.distributed(world_size=2, strict=True)
def test_bug_write_the_guard_cannot_see(rank):
    # a write the read guard does not see (dispatch modes off, as another thread's would be):
    # the snapshot comparison at wait() still reports it
    from torch.utils._python_dispatch import _disable_current_modes
    shard = torch.ones(2)
    work = dist.all_gather_into_tensor(torch.empty(4), shard, async_op=True)
    with _disable_current_modes():
        shard.add_(1)
    work.wait()

@pytest.mark.distributed(world_size=2, strict=True)
def test_bug_never_waited(rank):
    dist.all_reduce(torch.ones(2), async_op=True)

@pytest.mark.distributed(world_size=2, strict=True, backend="nccl-emu")
def test_ok_async_done_right(rank):
    t = torch.ones(2)
    out = torch.empty(4)
    works = [hp_core.all_reduce(t, "avg", async_op=True),
             hp_core.all_gather_into_tensor(out, torch.full((2,), float(rank)), async_op=True)]
    for w in works:
        w.wait()
    assert t.tolist() == [1.0, 1.0] and out.tolist() == [0.0, 0.0, 1.0, 1.0]
    got = torch.empty(1)
    hp_core.batch_isend_irecv([hp_core.P2POp("isend", torch.ones(1), 1 - rank),
                               hp_core.P2POp("irecv", got, 1 - rank)]).wait()
    assert got.item() == 1.0

@pytest.mark.distributed(world_size=2, strict=True, backend="nccl-emu")
def test_ok_in_place_all_gather(rank):
    # the input is this rank's chunk of the output, as FSDP's fused gathers pass it
    out = torch.zeros(4)
    out[2 * rank : 2 * rank + 2] = float(rank + 1)
    hp_core.all_gather_into_tensor(out, out[2 * rank : 2 * rank + 2], async_op=True).wait()
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0], out

@pytest.mark.distributed(world_size=2)
def test_ok_not_strict_by_default(rank):
    dist.all_reduce(torch.ones(2), async_op=True).wait()
"""


ASYNC_OVERLAP = """
def overlap(rank, size):
    # Rank 0 posts the sum before the send rank 1 needs first; rank 1 posts it after the
    # receive. Fine on gloo (each op progresses alone); a cycle on a one-queue backend.
    work = None
    if rank == 0:
        work = dist.all_reduce(torch.ones(size), async_op=True)
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(torch.empty(2), 0)
        work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_ok_async_collective_overlaps_p2p_on_gloo(rank):
    overlap(rank, 3)

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_bug_async_collective_before_send_on_nccl(rank):
    overlap(rank, 3)

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_bug_async_collectives_disagree_on_gloo(rank):
    overlap(rank, 4 if rank == 0 else 3)
"""


def test_async_collectives_are_checked_without_false_deadlocks(inner: Any) -> None:
    """[Note: deferred async checks]: gloo's overlap passes, NCCL's queue deadlocks, a mismatch is named."""
    result, sections = _run(inner, ASYNC_OVERLAP)
    result.assert_outcomes(passed=1, failed=2)
    text = sections["test_bug_async_collective_before_send_on_nccl"]
    assert "deadlock" in text and "all_reduce" in text
    text = sections["test_bug_async_collectives_disagree_on_gloo"]
    assert "disagree on collective #0" in text
    assert "4 torch.float32" in text and "3 torch.float32" in text


def test_strict_mode_catches_async_hazards(inner: Any) -> None:
    result, sections = _run(inner, STRICT)
    result.assert_outcomes(passed=3, failed=4)
    text = sections["test_bug_read_before_wait"]  # raised at the read, not a NaN found later
    assert re.search(
        r"AsyncHazardError: aten.sum at .*test_inner.py:\d+ in test_bug_read_before_wait read the output "
        r"tensor before its wait\(\): all_reduce\(tensor 2 torch.float32, op SUM\) was issued at "
        r".*test_inner.py:\d+ in test_bug_read_before_wait and is still pending",
        text,
    )
    assert "read nan" not in text
    text = sections["test_bug_input_modified_before_wait"]
    assert re.search(
        r"aten.add_ at .*test_inner.py:\d+ in test_bug_input_modified_before_wait wrote to the input "
        r"input_tensor before its wait\(\): all_gather_single\(in 2 out 4 torch.float32\) was issued at",
        text,
    )
    text = sections["test_bug_write_the_guard_cannot_see"]
    assert "all_gather_single(in 2 out 4 torch.float32) issued with async_op=True at" in text
    assert "its input input_tensor was modified" in text
    text = sections["test_bug_never_waited"]
    assert "was never waited" in text
    assert re.search(
        r"all_reduce\(tensor 2 torch.float32, op SUM\) at .*test_inner.py:\d+ in test_bug_never_waited", text
    )


FUNCTIONAL = """
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_bug_funcol_skipped(rank):
    funcol.all_gather_single(torch.ones(2), 0, dist.group.WORLD).wait()
    if rank == 0:
        funcol.all_gather_single(torch.ones(3), 0, dist.group.WORLD).wait()

@pytest.mark.distributed(world_size=2)
def test_bug_funcol_sizes(rank):
    funcol.all_reduce(torch.ones(4 + rank), "sum", dist.group.WORLD).wait()

@pytest.mark.distributed(world_size=2, backend="hccl-emu")
def test_bug_funcol_dtype_rule(rank):
    funcol.all_reduce(torch.ones(2, dtype=torch.uint8), "sum", [0, 1]).wait()

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_bug_torch_dtensor_on_one_rank(rank):
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    if rank == 0:
        x.full_tensor()  # torch's DTensor gathers with a functional all-gather
    else:
        dist.all_reduce(torch.ones(1))

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_ok_functional_and_classic_mixed(rank):
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    assert x.redistribute(mesh, [Replicate()]).to_local().tolist() == list(range(8))
    out = torch.empty(4)
    if rank == 0:  # the same wire operation written two ways: fine on NCCL too
        out = funcol.all_gather_single(torch.full((2,), 0.0), 0, mesh).wait()
    else:
        dist.all_gather_single(out, torch.full((2,), 1.0))
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0]
    got = funcol.reduce_scatter_single(torch.ones(4), "sum", 0, mesh).wait()
    assert got.tolist() == [2.0, 2.0]
"""


def test_functional_collectives_are_checked(inner: Any) -> None:
    result, sections = _run(inner, FUNCTIONAL)
    result.assert_outcomes(passed=1, failed=4)

    text = sections["test_bug_funcol_skipped"]
    assert "rank 1 finished the test while rank 0 waited for it in funcol.all_gather_single:" in text
    assert re.search(r"the last was funcol.all_gather_single: .* at .*test_inner.py:\d+", text)

    text = sections["test_bug_funcol_sizes"]
    assert re.search(r"rank 0: funcol.all_reduce: all_reduce\(tensor 4 torch.float32, op SUM\)", text)
    assert re.search(r"rank 1: funcol.all_reduce: all_reduce\(tensor 5 torch.float32, op SUM\)", text)
    assert "test_inner.py" in text

    text = sections["test_bug_funcol_dtype_rule"]
    assert "funcol.all_reduce() under backend='hccl-emu'" in text
    assert "torch.uint8 cannot be reduced by hccl" in text

    text = sections["test_bug_torch_dtensor_on_one_rank"]
    assert "disagree on collective #" in text
    assert re.search(r"rank 0: funcol.all_gather_single: all_gather_single\(in 4 out 8", text)
    assert re.search(r"rank 1: all_reduce\(tensor 1 torch.float32, op SUM\)\s+at .*test_inner.py", text)

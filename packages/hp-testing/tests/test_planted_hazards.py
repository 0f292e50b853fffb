"""Planted bugs under the marker: reads before wait(), unmatched p2p, NCCL's first-batch rule.

Each bug runs at 2 and 4 ranks under ``nccl-emu`` and ``hccl-emu`` in one
inner pytest session (pools are reused inside it), beside correct neighbours
that must pass: the read guard must not fire on views, on the layer's own
work, on reads of an input, or after ``wait()``.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest

HEADER = "import pytest\nimport torch\nimport torch.distributed as dist\nimport hp_core\n"

CASES = [(2, "nccl-emu"), (4, "nccl-emu"), (2, "hccl-emu"), (4, "hccl-emu")]

BODY = """
@pytest.mark.distributed(world_size={n}, backend="{backend}", strict=True)
def test_bug_item_{tag}(rank):
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True)
    seen = t[0].item()  # every rank reads too early
    work.wait()

@pytest.mark.distributed(world_size={n}, backend="{backend}", strict=True)
def test_bug_print_{tag}(rank):
    out = torch.empty(2 * {n})
    work = dist.all_gather_into_tensor(out, torch.ones(2), async_op=True)
    print(out)
    work.wait()

@pytest.mark.distributed(world_size={n}, backend="{backend}", strict=True)
def test_bug_tolist_irecv_{tag}(rank):
    nxt, prev = (rank + 1) % {n}, (rank - 1) % {n}
    got = torch.empty(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), nxt),
                                    dist.P2POp(dist.irecv, got, prev)])
    got.tolist()
    for w in works:
        w.wait()

@pytest.mark.distributed(world_size={n}, backend="{backend}", strict=True)
def test_bug_in_place_update_{tag}(rank):
    out = torch.empty({n})
    work = dist.reduce_scatter_tensor(out[:1], torch.ones({n}), async_op=True)
    out.mul_(2)  # the output is a view of out: the update touches it
    work.wait()

@pytest.mark.distributed(world_size={n}, backend="{backend}", strict=True)
def test_bug_isend_buffer_written_{tag}(rank):
    nxt, prev = (rank + 1) % {n}, (rank - 1) % {n}
    buf = torch.ones(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, nxt),
                                    dist.P2POp(dist.irecv, torch.empty(2), prev)])
    buf[0] = 5.0
    for w in works:
        w.wait()

@pytest.mark.distributed(world_size={n}, backend="{backend}", strict=True)
def test_ok_async_used_right_{tag}(rank):
    t = torch.full((4,), float(rank))
    scratch = torch.arange(4.0)
    work = dist.all_reduce(t, async_op=True)
    views = (t.view(2, 2), t[1:], t.split(2), t.detach(), torch.empty_like(t))  # no data read
    other = scratch.sum().item()  # unrelated tensors are free
    work.wait()
    total = sum(range({n}))
    assert t.tolist() == [float(total)] * 4 and views[1].tolist() == [float(total)] * 3, t
    shard = torch.full((2,), float(rank))
    out = torch.empty(2 * {n})
    work = hp_core.all_gather_into_tensor(out, shard, async_op=True)
    assert shard.sum().item() == 2.0 * rank  # reading a pending input is fine
    print(shard)
    work.wait()
    assert out.view({n}, 2)[:, 0].tolist() == [float(r) for r in range({n})]

@pytest.mark.distributed(world_size={n}, backend="{backend}", strict=True)
def test_bug_unmatched_{tag}(rank):
    if {n} == 2:
        # rank 1 posts a second send where its receive should be
        kind = dist.isend if rank == 1 else dist.irecv
        ops = [dist.P2POp(dist.isend, torch.ones(2), 1 - rank), dist.P2POp(kind, torch.ones(2), 1 - rank)]
    else:
        # a ring whose rank 2 receives from 3 instead of 1 (a wrong receive peer)
        prev = 3 if rank == 2 else (rank - 1) % 4
        ops = [dist.P2POp(dist.isend, torch.ones(2), (rank + 1) % 4),
               dist.P2POp(dist.irecv, torch.empty(2), prev)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
"""

FIRST_BATCH = """
def exchange_pair(rank):
    if rank < 2:
        got = torch.empty(1)
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), 1 - rank),
                                dist.P2POp(dist.irecv, got, 1 - rank)])[0].wait()

@pytest.mark.distributed(world_size=4, backend="nccl-emu")
def test_bug_first_batch_without_ranks_2_3(rank):
    exchange_pair(rank)  # ranks 2 and 3 never touch the world group

@pytest.mark.distributed(world_size=4, backend="hccl-emu")
def test_ok_first_batch_rule_is_nccl_only(rank):
    exchange_pair(rank)

@pytest.mark.distributed(world_size=4, backend="nccl-emu")
def test_ok_first_batch_after_a_collective(rank):
    dist.barrier()
    exchange_pair(rank)

@pytest.mark.distributed(world_size=4, backend="nccl-emu")
def test_ok_first_batch_while_others_join_by_a_collective(rank):
    exchange_pair(rank)  # ranks 2 and 3 join the communicator in the barrier below
    dist.barrier()

@pytest.mark.distributed(world_size=4, backend="nccl-emu")
def test_ok_first_batch_on_a_pair_group(rank):
    pair = dist.new_group([0, 1])
    if rank < 2:
        got = torch.empty(1)
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), 1 - rank, pair),
                                dist.P2POp(dist.irecv, got, 1 - rank, pair)])[0].wait()
"""


def _run(inner: Any, body: str) -> tuple[pytest.RunResult, dict[str, str]]:
    """``body`` (dedented, after the common imports) in an inner session (the ``inner`` fixture)."""
    return inner(HEADER + textwrap.dedent(body))


def _failed_ranks(text: str) -> str:
    match = re.search(r"failed on rank\(s\) (\[[\d, ]+\])", text)
    return match.group(1) if match else ""


def test_reads_and_writes_before_wait_raise_on_every_rank(inner: Any) -> None:
    body = "".join(
        BODY.format(n=n, backend=backend, tag=f"{n}_{backend.split('-')[0]}") for n, backend in CASES
    )
    result, sections = _run(inner, body)
    result.assert_outcomes(passed=4, failed=24)
    site = r".*test_inner.py:\d+ in "
    for n, backend in CASES:
        tag = f"{n}_{backend.split('-')[0]}"
        every = str(list(range(n)))

        text = sections[f"test_bug_item_{tag}"]
        assert _failed_ranks(text) == every, text
        assert text.count("AsyncHazardError") >= n
        assert re.search(
            rf"\.item\(\) \(aten._local_scalar_dense\) at {site}test_bug_item_{tag} read the output tensor "
            rf"before its wait\(\): all_reduce\(tensor 2 torch.float32, op SUM\) was issued at "
            rf"{site}test_bug_item_{tag} and is still pending",
            text,
        ), text

        text = sections[f"test_bug_print_{tag}"]
        assert _failed_ranks(text) == every, text
        assert re.search(
            rf"print / repr\(\) at {site}test_bug_print_{tag} read the output output_tensor before its "
            rf"wait\(\): all_gather_single\(in 2 out {2 * n} torch.float32\) was issued at {site}",
            text,
        ), text

        text = sections[f"test_bug_tolist_irecv_{tag}"]
        assert _failed_ranks(text) == every, text
        assert re.search(
            rf"\.tolist\(\) at {site}test_bug_tolist_irecv_{tag} read the buffer of irecv\(3 torch.float32 "
            rf"from rank \d\) before its wait\(\): batch_isend_irecv was issued at {site}",
            text,
        ), text

        text = sections[f"test_bug_in_place_update_{tag}"]
        assert _failed_ranks(text) == every, text
        written = rf"aten.mul_ at {site}test_bug_in_place_update_{tag} wrote to the output before"
        assert re.search(written, text), text

        text = sections[f"test_bug_isend_buffer_written_{tag}"]
        assert _failed_ranks(text) == every, text
        assert re.search(
            rf"aten.(copy_|fill_) at {site}test_bug_isend_buffer_written_{tag} wrote to the buffer of "
            rf"isend\(2 torch.float32 to rank \d\) before its wait\(\)",
            text,
        ), text

        text = sections[f"test_bug_unmatched_{tag}"]
        assert "Point-to-point ops posted by each rank since its last fully matched point" in text, text
        for rank in range(n):
            assert re.search(rf"rank {rank}: [ai]s?[a-z]*\(2 torch.float32", text), (rank, text)
        if n == 2:
            assert "UnmatchedError: unmatched point-to-point ops: ranks [" in text
            assert "(2 without a counterpart)" in text
            assert "NO COUNTERPART: rank 1 posted no receive from rank 0" in text
            assert "NO COUNTERPART: rank 0 posted no receive from rank 1" in text
        else:
            assert "(2 without a counterpart)" in text
            assert re.search(r"message #0 1->2  NO COUNTERPART: rank 2 posted no receive from rank 1", text)
            assert re.search(r"message #0 3->2  NO COUNTERPART: rank 3 posted no send to rank 2", text)
            assert re.search(r"message #0 0->1  matched", text)


def test_first_batch_on_a_group_needs_every_rank_under_nccl(inner: Any) -> None:
    result, sections = _run(inner, FIRST_BATCH)
    result.assert_outcomes(passed=4, failed=1)
    text = sections["test_bug_first_batch_without_ranks_2_3"]
    rule = "the first batch_isend_irecv on group [0, 1, 2, 3], where NCCL creates the group's communicator"
    assert rule in text, text
    assert re.search(r"rank [23] finished the test while rank [01] waited for it in isend", text), text

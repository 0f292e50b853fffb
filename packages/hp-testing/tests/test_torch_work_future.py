"""``work.get_future().wait()`` runs the checks ``work.wait()`` runs ([Note: deferred async checks]).

DDP's comm hooks and some training loops wait for an async collective through
its future. A planted mismatch that ``work.wait()`` reports on the rank that
issued first must be reported there through the future too (it used to hang
until the pool's timeout), strict mode must count a future's wait as the wait,
and the future still carries the collective's result to ``then()`` callbacks.
"""

from __future__ import annotations

import textwrap
from typing import Any

SCENARIOS = """
import pytest
import torch
import torch.distributed as dist


def overlap_through_future(rank, size):
    # rank 0 issues first and waits through the future; rank 1 issues after a receive
    if rank == 0:
        work = dist.all_reduce(torch.ones(size), async_op=True)
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(torch.empty(2), 0)
        work = dist.all_reduce(torch.ones(3), async_op=True)
    return work.get_future().wait()


@pytest.mark.distributed(world_size=2, backend="gloo")
def test_ok_future_carries_the_result(rank):
    (out,) = overlap_through_future(rank, 3)
    assert out.tolist() == [2.0, 2.0, 2.0]
    t = torch.full((2,), rank + 1.0)
    chained = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 10)
    assert chained.wait().tolist() == [30.0, 30.0]  # 10 * (1 + 2), as torch gives without the checks
    assert t.tolist() == [3.0, 3.0]


@pytest.mark.distributed(world_size=2, backend="gloo")
def test_bug_disagree_through_future(rank):
    overlap_through_future(rank, 4 if rank == 0 else 3)


@pytest.mark.distributed(world_size=2, strict=True)
def test_ok_strict_waited_through_future(rank):
    t = torch.ones(2)
    dist.all_reduce(t, async_op=True).get_future().wait()
    assert t.tolist() == [2.0, 2.0]
"""


def test_future_wait_runs_the_deferred_checks(inner: Any) -> None:
    result, sections = inner(textwrap.dedent(SCENARIOS))
    result.assert_outcomes(passed=2, failed=1)
    text = sections["test_bug_disagree_through_future"]
    assert "timeout" not in text and "hung" not in text, text
    rank0 = text.split("rank 0 failed")[1].split("rank 1 failed")[0] if "rank 1 failed" in text else ""
    assert "disagree on collective #0" in rank0, text
    assert "4 torch.float32" in rank0 and "3 torch.float32" in rank0

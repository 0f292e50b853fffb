"""Planted bugs under ``hp-run --emulate``: a read before wait(), unmatched point-to-point.

The same script runs at 2 and 4 ranks under ``--emulate nccl`` and
``--emulate hccl`` (strict by default there): each test takes two of the four
pairs by default, the two tests together all four, and each test all four with
``HP_COMPOSITION=full`` (an hp-run costs seconds on a 2-core CI machine). The read must fail on every
rank that reads, naming the read's line and the collective's; the unmatched
exchange must list every rank's posted sends and receives and mark the ones
without a counterpart. Under plain ``hp-run`` the read goes unnoticed (gloo
finishes first), which is why the emulation exists. The module's launches are
independent: they start together when the module does (:mod:`hp_run_jobs`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hp_run_jobs import Job, Launched, launcher_job, module_jobs, planted_script

PLANTED = """
import sys, torch, torch.distributed as dist, hp_core
hp_core.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
if sys.argv[1] == "read":
    t = torch.ones(2)
    work = dist.all_reduce(t, async_op=True)
    print(f"rank {rank} sees {t}")  # before wait(): every rank reads too early
    work.wait()
else:  # "unmatched": one receive names the wrong peer
    nxt = (rank + 1) % world
    prev = (rank - 1) % world
    if world == 2 and rank == 1:
        ops = [dist.P2POp(dist.isend, torch.ones(2), nxt), dist.P2POp(dist.isend, torch.ones(2), prev)]
    else:
        if world > 2 and rank == 2:
            prev = 3
        ops = [dist.P2POp(dist.isend, torch.ones(2), nxt), dist.P2POp(dist.irecv, torch.empty(2), prev)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
dist.barrier()
hp_core.destroy_distributed()
"""


def _hp_run(script: Path, test: str, n: int, *args: str) -> Job:
    return launcher_job(n, *args[:-1], str(script), args[-1], tests=(test,))


def _cases(first: list[tuple[int, str]]) -> list[tuple[int, str]]:
    every = [(2, "nccl"), (2, "hccl"), (4, "nccl"), (4, "hccl")]
    return every if os.environ.get("HP_COMPOSITION") == "full" else first


READ_CASES = _cases([(2, "nccl"), (4, "hccl")])
UNMATCHED_CASES = _cases([(2, "hccl"), (4, "nccl")])


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    """Every hp-run launch of this module, started at once (:mod:`hp_run_jobs`)."""
    script, name = planted_script(tmp_path_factory, "planted", PLANTED)
    read = "test_read_before_wait_fails_every_reading_rank"
    unmatched = "test_unmatched_exchange_lists_every_rank"
    jobs = {
        f"read-{n}-{emulate}": _hp_run(script, read, n, "--emulate", emulate, "read")
        for n, emulate in READ_CASES
    }
    jobs["read-plain"] = _hp_run(script, "test_read_before_wait_passes_plain_gloo", 2, "read")
    for n, emulate in UNMATCHED_CASES:
        jobs[f"unmatched-{n}-{emulate}"] = _hp_run(script, unmatched, n, "--emulate", emulate, "unmatched")
    with module_jobs(request, jobs) as running:
        yield running, name


@pytest.mark.parametrize(("n", "emulate"), READ_CASES)
def test_read_before_wait_fails_every_reading_rank(launches: Launched, n: int, emulate: str) -> None:
    jobs, name = launches
    run = jobs.result(f"read-{n}-{emulate}")
    assert run.returncode == 1, run.stdout + run.stderr
    expected = (
        f"AsyncHazardError: print / repr() at {name}:8 in <module> read the output tensor before its "
        f"wait(): all_reduce(tensor 2 torch.float32, op SUM) was issued at {name}:7 in <module> and is "
        "still pending"
    )
    text = run.stderr
    for rank in range(n):  # each rank's own report, not a peer's echo of it
        assert re.search(rf"\[rank{rank}\]: hp_testing\._hazards\.{re.escape(expected)}", text), (rank, text)
    assert "sees tensor" not in run.stdout  # no rank printed the stale values


def test_read_before_wait_passes_plain_gloo(launches: Launched) -> None:
    run = launches[0].result("read-plain")
    assert run.returncode == 0, run.stdout + run.stderr  # gloo hides the bug


@pytest.mark.parametrize(("n", "emulate"), UNMATCHED_CASES)
def test_unmatched_exchange_lists_every_rank(launches: Launched, n: int, emulate: str) -> None:
    run = launches[0].result(f"unmatched-{n}-{emulate}")
    assert run.returncode != 0, run.stdout + run.stderr
    text = run.stderr
    assert "Point-to-point ops posted by each rank since its last fully matched point (2 without" in text
    for rank in range(n):
        assert re.search(
            rf"rank {rank}: i(send|recv)\(2 torch.float32 (to|from) rank \d\)\s+message #", text
        ), (
            rank,
            text,
        )
    if n == 2:
        assert "unmatched point-to-point ops: ranks [" in text
        assert "message #0 0->1  NO COUNTERPART: rank 1 posted no receive from rank 0" in text
        assert "message #1 1->0  NO COUNTERPART: rank 0 posted no receive from rank 1" in text
    else:
        assert "message #0 1->2  NO COUNTERPART: rank 2 posted no receive from rank 1" in text
        assert "message #0 3->2  NO COUNTERPART: rank 3 posted no send to rank 2" in text

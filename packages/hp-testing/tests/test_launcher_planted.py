"""Planted bugs under ``hp-run --emulate``: a read before wait(), unmatched point-to-point.

The same script runs at 2 and 4 ranks under ``--emulate nccl`` and
``--emulate hccl`` (strict by default there): each test takes two of the four
pairs by default, the two tests together all four, and each test all four with
``HP_COMPOSITION=full`` (an hp-run costs seconds on a 2-core CI machine). The read must fail on every
rank that reads, naming the read's line and the collective's; the unmatched
exchange must list every rank's posted sends and receives and mark the ones
without a counterpart. Under plain ``hp-run`` the read goes unnoticed (gloo
finishes first), which is why the emulation exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


def _hp_run(tmp_path: Path, n: int, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "planted.py"
    script.write_text(textwrap.dedent(PLANTED))
    cmd = [sys.executable, "-m", "hp_testing.launcher", "-n", str(n), *args[:-1], str(script), args[-1]]
    env = {k: v for k, v in os.environ.items() if k != "HP_RUN_STRICT"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def _cases(first: list[tuple[int, str]]) -> list[tuple[int, str]]:
    every = [(2, "nccl"), (2, "hccl"), (4, "nccl"), (4, "hccl")]
    return every if os.environ.get("HP_COMPOSITION") == "full" else first


@pytest.mark.parametrize(("n", "emulate"), _cases([(2, "nccl"), (4, "hccl")]))
def test_read_before_wait_fails_every_reading_rank(tmp_path: Path, n: int, emulate: str) -> None:
    run = _hp_run(tmp_path, n, "--emulate", emulate, "read")
    assert run.returncode == 1, run.stdout + run.stderr
    name = f"{tmp_path.name}/planted.py"
    expected = (
        f"AsyncHazardError: print / repr() at {name}:8 in <module> read the output tensor before its "
        f"wait(): all_reduce(tensor 2 torch.float32, op SUM) was issued at {name}:7 in <module> and is "
        "still pending"
    )
    text = run.stderr
    for rank in range(n):  # each rank's own report, not a peer's echo of it
        assert re.search(rf"\[rank{rank}\]: hp_testing\._hazards\.{re.escape(expected)}", text), (rank, text)
    assert "sees tensor" not in run.stdout  # no rank printed the stale values


def test_read_before_wait_passes_plain_gloo(tmp_path: Path) -> None:
    run = _hp_run(tmp_path, 2, "read")
    assert run.returncode == 0, run.stdout + run.stderr  # gloo hides the bug


@pytest.mark.parametrize(("n", "emulate"), _cases([(2, "hccl"), (4, "nccl")]))
def test_unmatched_exchange_lists_every_rank(tmp_path: Path, n: int, emulate: str) -> None:
    run = _hp_run(tmp_path, n, "--emulate", emulate, "unmatched")
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

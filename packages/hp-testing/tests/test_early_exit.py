"""A rank that ends early (any exit code, 0 included) while its peers wait for it.

Each planted bug is one script or one inner pytest session; the checks are
that every waiting rank's error names the rank that left, its exit code and
the call it waits in, and that the run ends (a bounded ``timeout``, never a
time assertion). The hp-run launches start together when the module does
(:mod:`hp_run_jobs`), beside the inner session.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hp_run_jobs import Job, Jobs, module_jobs

# Rank 1 leaves with code 0 (its "data" ran out) while rank 0 (and ranks 2, 3) issue another
# all_reduce; with 4 ranks rank 3 also waits for rank 1 in a blocking receive.
EARLY = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dist.all_reduce(torch.ones(2))
if rank == 1:
    if world == 4:
        sys.exit(3)
    sys.exit(0)
if rank == 3:
    dist.recv(torch.empty(2), src=1)  # RECV_LINE
dist.all_reduce(torch.ones(2))  # SECOND_LINE
"""


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(EARLY.splitlines(), start=1) if marker in text)


MARKER = """
import os, sys, torch, torch.distributed as dist, pytest

@pytest.mark.distributed(world_size=4, timeout=120)
def test_sys_exit(rank):
    dist.all_reduce(torch.ones(2))
    if rank == 2:
        sys.exit(0)
    dist.all_reduce(torch.ones(2))

@pytest.mark.distributed(world_size=2, backend="nccl-emu", timeout=120)
def test_os_exit(rank):
    dist.all_reduce(torch.ones(2))
    if rank == 0:
        os._exit(0)
    dist.all_reduce(torch.ones(2))
"""


def test_marker_names_the_rank_that_exited(pytester: pytest.Pytester, launches: Jobs) -> None:
    del launches  # started first, so the hp-run launches below run beside this inner session
    pytester.makepyfile(test_inner=MARKER)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    for rank in (0, 1, 3):
        assert f"rank 2 exited (code 0) while rank {rank} waits for it in all_reduce(tensor 2" in out, out
    assert "It called sys.exit() in the middle of the test." in out
    assert "rank 0 exited (code 0) while rank 1 waits for it in all_reduce(tensor 2" in out, out
    assert "(collective #1 on group [0, 1]) at " in out and "test_inner.py:15 in test_os_exit" in out


CASES = [(2, None), (4, "nccl"), (2, "hccl")]
IDS = ["plain-2", "nccl-4", "hccl-2"]


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """Every hp-run launch of this module, started at once (:mod:`hp_run_jobs`)."""
    script = tmp_path_factory.mktemp("early") / "early.py"
    script.write_text(EARLY)
    jobs = {}
    for key, (n, emulate) in zip(IDS, CASES, strict=True):
        extra = ["--emulate", emulate] if emulate else []
        cmd = [sys.executable, "-m", "hp_testing.launcher", "-n", str(n), *extra, str(script)]
        # bounded: a regression shows as TimeoutExpired here, not as a hung suite
        jobs[key] = Job(cmd, ("test_hp_run_names_the_rank_that_exited",), ranks=n, timeout=240)
    with module_jobs(request, jobs) as running:
        yield running


@pytest.mark.parametrize(("n", "emulate"), CASES, ids=IDS)
def test_hp_run_names_the_rank_that_exited(launches: Jobs, n: int, emulate: str | None) -> None:
    proc = launches.result(IDS[CASES.index((n, emulate))])
    out = proc.stdout + proc.stderr
    code = 3 if n == 4 else 0
    assert proc.returncode == (code or 1), out  # the first failing rank's status, as always
    waiters = [0, 2] if n == 4 else [0]
    for rank in waiters:
        assert (
            f"rank 1 exited (code {code}) while rank {rank} waits for it in all_reduce(tensor 2 "
            f"torch.float32, op SUM) (collective #1 on group {list(range(n))}) at "
        ) in out, out
    assert f"early.py:{_line('SECOND_LINE')} in <module>; stopped waiting" in out
    if n == 4:
        assert (
            "rank 1 exited (code 3) while rank 3 waits for it in recv(2 torch.float32 from rank 1) "
            "(message #0 from rank 1 to rank 3, waiting for rank 1's matching send) at "
        ) in out, out
        assert f"early.py:{_line('RECV_LINE')} in <module>; stopped waiting" in out

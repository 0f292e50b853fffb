"""Fault injection: each fault is reported, the peers stop waiting, and the pool recovers without leaks."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable

import pytest
from hp_testing import faults

HEADER = "import pytest\nimport torch\nimport torch.distributed as dist\nfrom hp_testing import faults\n"

FAULTS = """
from hp_testing.faults import InjectedFault
from hp_testing._sidechannel import PeerFailedError, DroppedMessageError

@pytest.mark.distributed(world_size=2, faults=[faults.delay(rank=1, seconds=0.2, at=0)])
def test_delay(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

@pytest.mark.distributed(world_size=2, faults=[faults.fail(rank=1, at=1)])
def test_fail(rank):
    dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1))

@pytest.mark.distributed(world_size=2, faults=faults.fail(rank=0, at=0))
def test_fail_handled_by_user_code(rank):
    try:
        dist.all_reduce(torch.ones(1))
    except InjectedFault:
        assert rank == 0
    except PeerFailedError as exc:
        assert rank == 1 and "injected fault: fail rank 0 at collective #0" in str(exc)
    else:
        raise AssertionError("the fault did not surface")

@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_clean_after_fail(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

@pytest.mark.distributed(world_size=2, timeout=600, faults=[faults.kill(rank=0, at=1, exit_code=77)])
def test_kill(rank):
    dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1))

@pytest.mark.distributed(world_size=2, faults=[faults.drop(rank=0, at=0)])
def test_drop(rank):
    if rank == 0:
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(torch.empty(2), 0)

@pytest.mark.distributed(world_size=2, faults=[faults.fail(rank=1, at=5)])
def test_fault_that_never_fires(rank):
    dist.barrier()

@pytest.mark.distributed(world_size=2)
def test_clean_at_the_end(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


def test_faults_are_reported_and_the_pool_recovers(
    pytester: pytest.Pytester, rank_processes: Callable[[], list[int]]
) -> None:
    pytester.makepyfile(test_inner=HEADER + textwrap.dedent(FAULTS))
    before_kids = set(rank_processes())
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=4, failed=4)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*injected faults*", "rank 1: delay rank 1 by 0.2 s before collective #0"])
    assert "rank 1: fail rank 1 at collective #1" in out
    assert "InjectedFault: injected fault: fail rank 1 at collective #1" in out
    assert "rank 1 failed while rank 0 waited for it in all_reduce" in out
    # the kill: rank 0 dies with its code, rank 1 stops waiting at once with that news
    assert "rank(s) [0] died" in out and "the process exited with code 77" in out
    assert "rank 0 exited (code 77) while rank 1 waits for it in all_reduce" in out
    assert "message #0 from rank 0 to rank 1 (send(2 torch.float32 to rank 1)" in out
    assert "was dropped by fault injection" in out
    assert "did NOT fire: fail rank 1 at collective #5" in out
    assert "planned fault(s) never fired on this rank: fail rank 1 at collective #5" in out
    assert "rank 0: kill rank 0 (exit code 77) at collective #1 (the process exited with code 77)" in out
    left = set(rank_processes()) - before_kids
    assert left == set(), f"rank processes {sorted(left)} outlived the inner session"


def test_repeated_fault_sessions_leak_no_file_descriptors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner=HEADER
        + textwrap.dedent(
            """
            @pytest.mark.distributed(world_size=2, faults=[faults.kill(rank=1, at=0)])
            def test_kill(rank):
                dist.barrier()

            @pytest.mark.distributed(world_size=2, faults=[faults.fail(rank=0, at=0)])
            def test_fail(rank):
                dist.barrier()
            """
        )
    )
    counts = []
    for _ in range(3):
        pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(failed=2)
        counts.append(len(os.listdir("/proc/self/fd")))
    assert counts[2] <= counts[1], f"open file descriptors grew session after session: {counts}"


def test_fault_values_are_checked() -> None:
    with pytest.raises(ValueError, match="a fail fault needs at=K"):
        faults.Fault("fail", 0)
    with pytest.raises(ValueError, match="unknown fault kind 'melt'"):
        faults.Fault("melt", 0, 1)
    with pytest.raises(ValueError, match="delay seconds must be >= 0"):
        faults.delay(0, -1.0)
    assert faults.kill(2, at=3, exit_code=9).describe() == "kill rank 2 (exit code 9) at collective #3"
    assert faults.drop(1, at=0).describe() == "drop send #0 of rank 1"


def test_bad_marker_options_are_usage_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner=HEADER
        + textwrap.dedent(
            """
            @pytest.mark.distributed(world_size=2, faults=["kill rank 1"])
            def test_a(rank):
                pass

            @pytest.mark.distributed(world_size=2, strict="yes")
            def test_b(rank):
                pass

            @pytest.mark.distributed(world_size=2, checks=False, faults=[faults.fail(0, at=0)])
            def test_c(rank):
                pass
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "faults must be hp_testing.faults.Fault values" in out
    assert "strict must be True or False, got 'yes'" in out
    assert "faults need checks=True" in out

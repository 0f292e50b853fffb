"""hp-run and signals: SIGINT/SIGTERM reach every rank, and no rank outlives hp-run.

Each test starts ``hp-run -n 4`` on a script whose ranks write their PIDs to a
directory and sleep, signals hp-run, and then checks by PID that every rank
is gone. The waits are bounded deadlines for a process to disappear, not
measurements: a loaded machine makes them slower, never wrong.

Ranks that obey the signal get a grace (``OBEY_GRACE``) far longer than they
ever need, so "nothing needed killing" holds however slowly they exit: a rank
that gets SIGINT raises KeyboardInterrupt, prints its traceback, runs the
layer's excepthook and Python's finalization with torch loaded, which took
over the former 3 s grace at a load average near 10 (the SIGINT case failed
once with "killing ranks ... still running 3 s after SIGINT"). SIGTERM and
SIGHUP end a Python process at once, which is why only SIGINT showed it. hp-run
returns as soon as the last rank is gone, so the long grace costs nothing when
the ranks obey.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

NPROC = 4
START_DEADLINE_S = 120.0  # four Python start-ups on a busy 2-core machine
GONE_DEADLINE_S = 30.0
OBEY_GRACE_S = 120.0  # ranks that obey a signal: never reached, however loaded the machine

SLEEPER = """
import os, signal, sys, time
from pathlib import Path

if "ignore" in sys.argv:  # a rank stuck where signals cannot stop it (as inside a gloo collective)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid_dir = Path(sys.argv[1])
tmp = pid_dir / f".{os.environ['RANK']}.tmp"
tmp.write_text(str(os.getpid()))
tmp.rename(pid_dir / f"{os.environ['RANK']}.pid")  # whole, or not there at all
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs; a zombie (exited, not yet reaped by init) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists
    return state != "Z"


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[list[int]]:
    """PIDs of the ranks the test started; any still alive at the end is killed (by PID)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _start(tmp_path: Path, *script_args: str, grace: str) -> tuple[subprocess.Popen[bytes], Path]:
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    cmd = [sys.executable, "-m", "hp_testing.launcher", "-n", str(NPROC), "--grace", grace]
    cmd += [str(script), str(pid_dir), *script_args]
    # Files, not pipes: an orphaned rank would hold a pipe open and hide hp-run's own exit.
    with open(tmp_path / "out.txt", "wb") as out, open(tmp_path / "err.txt", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
    return proc, pid_dir


def _finish(proc: subprocess.Popen[bytes], tmp_path: Path) -> str:
    """Wait (bounded, past any grace a test gives) for hp-run to exit; its stderr."""
    try:
        proc.wait(timeout=OBEY_GRACE_S + GONE_DEADLINE_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return (tmp_path / "err.txt").read_text(errors="replace")


def _rank_pids(proc: subprocess.Popen[bytes], pid_dir: Path, pids: list[int]) -> None:
    """Wait (bounded) until every rank has written its PID; fills ``pids``."""
    deadline = time.monotonic() + START_DEADLINE_S
    while len(list(pid_dir.glob("*.pid"))) < NPROC:
        if proc.poll() is not None:
            err = (pid_dir.parent / "err.txt").read_text(errors="replace")
            pytest.fail(f"hp-run exited with {proc.returncode} before its ranks started:\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the ranks did not all start within {START_DEADLINE_S:g} s")
        time.sleep(0.05)
    pids.extend(int((pid_dir / f"{rank}.pid").read_text()) for rank in range(NPROC))


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + GONE_DEADLINE_S
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _alive(pid)]
    assert not left, f"rank processes {left} outlived hp-run (of {pids})"


# SIGHUP takes SIGTERM's path through hp-run; it runs with HP_COMPOSITION=full.
FULL = os.environ.get("HP_COMPOSITION") == "full"
SIGNALS = [signal.SIGTERM, signal.SIGINT, *([signal.SIGHUP] if FULL else [])]


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_signal_is_forwarded_to_every_rank(
    tmp_path: Path, launched: list[int], signum: signal.Signals
) -> None:
    proc, pid_dir = _start(tmp_path, grace=f"{OBEY_GRACE_S:g}")
    _rank_pids(proc, pid_dir, launched)
    proc.send_signal(signum)
    err = _finish(proc, tmp_path)
    assert proc.returncode == 128 + signum, err
    assert f"got {signum.name}; forwarding it to ranks [0, 1, 2, 3]" in err
    assert "killing ranks" not in err  # they obeyed the signal: nothing needed killing
    _assert_gone(launched)


def test_ranks_that_ignore_the_signal_are_killed_after_the_grace(tmp_path: Path, launched: list[int]) -> None:
    proc, pid_dir = _start(tmp_path, "ignore", grace="1")
    _rank_pids(proc, pid_dir, launched)
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc, tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "killing ranks [0, 1, 2, 3], still running 1 s after SIGTERM" in err
    _assert_gone(launched)


def test_a_second_signal_kills_at_once(tmp_path: Path, launched: list[int]) -> None:
    proc, pid_dir = _start(tmp_path, "ignore", grace="600")
    _rank_pids(proc, pid_dir, launched)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while "got SIGINT" not in (tmp_path / "err.txt").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # the second must come after hp-run has forwarded the first
    proc.send_signal(signal.SIGINT)
    err = _finish(proc, tmp_path)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "killing ranks [0, 1, 2, 3], still running after a second signal" in err
    _assert_gone(launched)


def test_ranks_die_with_a_killed_hp_run(tmp_path: Path, launched: list[int]) -> None:
    proc, pid_dir = _start(tmp_path, grace=f"{OBEY_GRACE_S:g}")
    _rank_pids(proc, pid_dir, launched)
    proc.kill()  # SIGKILL: hp-run runs no code at all; the kernel must end the ranks
    _finish(proc, tmp_path)
    assert proc.returncode == -signal.SIGKILL
    _assert_gone(launched)

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
the ranks obey. The scenarios are independent: two at a time run side by side in
threads from when the module starts, and each test asserts on its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hp_run_jobs import selected_tests

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


def _left(pids: list[int]) -> list[int]:
    """The ones of ``pids`` still alive after waiting (bounded) for them to disappear."""
    deadline = time.monotonic() + GONE_DEADLINE_S
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


@dataclass(frozen=True)
class Seen:
    """What one scenario saw: hp-run's exit status and stderr, and its ranks left alive after it."""

    returncode: int | None
    err: str
    pids: list[int]
    left: list[int]

    def assert_gone(self) -> None:
        assert not self.left, f"rank processes {self.left} outlived hp-run (of {self.pids})"


Act = Callable[[subprocess.Popen[bytes], Path], None]


def _scenario(tmp_path: Path, launched: list[int], act: Act, *script_args: str, grace: str) -> Seen:
    """Start hp-run, wait for its ranks (their PIDs go to ``launched``), ``act`` on it, watch it end."""
    proc, pid_dir = _start(tmp_path, *script_args, grace=grace)
    pids: list[int] = []
    try:
        _rank_pids(proc, pid_dir, pids)
    finally:
        launched.extend(pids)
    act(proc, tmp_path)
    err = _finish(proc, tmp_path)
    return Seen(proc.returncode, err, pids, _left(pids))


def _send(signum: int) -> Act:
    return lambda proc, tmp_path: proc.send_signal(signum)


def _sigint_twice(proc: subprocess.Popen[bytes], tmp_path: Path) -> None:
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while "got SIGINT" not in (tmp_path / "err.txt").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # the second must come after hp-run has forwarded the first
    proc.send_signal(signal.SIGINT)


def _kill_hp_run(proc: subprocess.Popen[bytes], tmp_path: Path) -> None:
    proc.kill()  # SIGKILL: hp-run runs no code at all; the kernel must end the ranks


# SIGHUP takes SIGTERM's path through hp-run; it runs with HP_COMPOSITION=full.
FULL = os.environ.get("HP_COMPOSITION") == "full"
SIGNALS = [signal.SIGTERM, signal.SIGINT, *([signal.SIGHUP] if FULL else [])]
PARALLEL = 2  # scenarios at once: four ranks and hp-run each


@pytest.fixture(scope="module")
def seen(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Seen]]]:
    """Each selected test's scenario, run in the background; ranks still alive at the end are killed."""
    obey = f"{OBEY_GRACE_S:g}"
    scenarios: dict[str, tuple[str, Act, tuple[str, ...], str]] = {
        **{s.name: ("test_signal_is_forwarded_to_every_rank", _send(s), (), obey) for s in SIGNALS},
        "ignored": (
            "test_ranks_that_ignore_the_signal_are_killed_after_the_grace",
            _send(signal.SIGTERM),
            ("ignore",),
            "1",
        ),
        "twice": ("test_a_second_signal_kills_at_once", _sigint_twice, ("ignore",), "600"),
        "killed": ("test_ranks_die_with_a_killed_hp_run", _kill_hp_run, (), obey),
    }
    selected = selected_tests(request)
    launched: list[int] = []
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {
        key: pool.submit(_scenario, tmp_path_factory.mktemp(key), launched, act, *args, grace=grace)
        for key, (test, act, args, grace) in scenarios.items()
        if test in selected
    }
    try:
        yield futures
    finally:
        pool.shutdown(wait=True)  # every scenario ends: hp-run's wait is bounded
        for pid in launched:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_signal_is_forwarded_to_every_rank(seen: dict[str, Future[Seen]], signum: signal.Signals) -> None:
    run = seen[signum.name].result()
    assert run.returncode == 128 + signum, run.err
    assert f"got {signum.name}; forwarding it to ranks [0, 1, 2, 3]" in run.err
    assert "killing ranks" not in run.err  # they obeyed the signal: nothing needed killing
    run.assert_gone()


def test_ranks_that_ignore_the_signal_are_killed_after_the_grace(seen: dict[str, Future[Seen]]) -> None:
    run = seen["ignored"].result()
    assert run.returncode == 128 + signal.SIGTERM, run.err
    assert "killing ranks [0, 1, 2, 3], still running 1 s after SIGTERM" in run.err
    run.assert_gone()


def test_a_second_signal_kills_at_once(seen: dict[str, Future[Seen]]) -> None:
    run = seen["twice"].result()
    assert run.returncode == 128 + signal.SIGINT, run.err
    assert "killing ranks [0, 1, 2, 3], still running after a second signal" in run.err
    run.assert_gone()


def test_ranks_die_with_a_killed_hp_run(seen: dict[str, Future[Seen]]) -> None:
    run = seen["killed"].result()
    assert run.returncode == -signal.SIGKILL
    run.assert_gone()

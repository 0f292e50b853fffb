"""Independent ``hp-run`` launches of one test module, started together so their start-ups overlap.

A launch spends most of its wall time importing torch: first in the launcher, on
one core while the other of a 2-core CI machine idles, then in every rank, then
waiting (a grace period, a peer's timeout). Launches that do not depend on each
other run here side by side, a bounded number of rank processes at a time, and
each test waits for its own and asserts on it exactly as before: the same runs
and checks, less wall time. Only the launches of the tests selected in the
session start, in the order given, so the first test's launch starts first.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MAX_RANKS = 6  # rank processes running at once, launchers not counted: memory stays bounded


@dataclass(frozen=True)
class Job:
    """One launch: its command line, environment (None: inherited), rank count and time limit."""

    cmd: list[str]
    tests: tuple[str, ...]  # the test functions that read its result: it starts if one is selected
    ranks: int = 2
    env: dict[str, str] | None = None
    timeout: float = 240.0
    cwd: Path | None = None


@dataclass
class _State:
    done: threading.Event = field(default_factory=threading.Event)
    proc: subprocess.Popen[str] | None = None
    result: subprocess.CompletedProcess[str] | None = None
    error: BaseException | None = None


def launcher_job(n: int, *args: str, tests: tuple[str, ...], env: dict[str, str] | None = None) -> Job:
    """``python -m hp_testing.launcher -n N *args`` with ``env`` added to a copy of ours less
    ``HP_RUN_STRICT`` (the strict tests choose it themselves)."""
    full_env = {k: v for k, v in os.environ.items() if k != "HP_RUN_STRICT"}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "hp_testing.launcher", "-n", str(n), *args]
    return Job(cmd, tests, ranks=n, env=full_env)


def planted_script(tmp_path_factory: pytest.TempPathFactory, folder: str, body: str) -> tuple[Path, str]:
    """``body`` as ``planted.py`` in a new folder; and ``folder/planted.py``, as error messages name it."""
    script = tmp_path_factory.mktemp(folder) / "planted.py"
    script.write_text(textwrap.dedent(body))
    return script, f"{script.parent.name}/planted.py"


class Jobs:
    """Runs ``Job``s in background threads, at most ``max_ranks`` ranks at once; ``result`` waits for one."""

    def __init__(self, jobs: dict[str, Job], max_ranks: int = MAX_RANKS) -> None:
        self._jobs = jobs
        self._max = max_ranks
        self._states = {key: _State() for key in jobs}
        self._cond = threading.Condition()
        self._queue = list(jobs)  # waiting to start, first come first served
        self._running = 0
        self._closing = False
        self._threads = [threading.Thread(target=self._run, args=(key,), daemon=True) for key in jobs]
        for thread in self._threads:
            thread.start()

    def _run(self, key: str) -> None:
        job, state = self._jobs[key], self._states[key]
        weight = min(job.ranks, self._max)  # a launch larger than the bound runs alone
        try:
            with self._cond:
                while not self._closing and (self._queue[0] != key or self._running + weight > self._max):
                    self._cond.wait()
                self._queue.remove(key)
                self._cond.notify_all()
                if self._closing:
                    raise RuntimeError(f"launch {key!r} was not started: the test module ended first")
                state.proc = subprocess.Popen(
                    job.cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=job.env,
                    cwd=job.cwd,
                )
                self._running += weight
            try:
                out, err = state.proc.communicate(timeout=job.timeout)
            except subprocess.TimeoutExpired as exc:
                state.proc.kill()  # as subprocess.run does before re-raising
                state.proc.communicate()
                state.error = exc
            else:
                state.result = subprocess.CompletedProcess(job.cmd, state.proc.returncode, out, err)
        except BaseException as exc:
            state.error = exc
        finally:
            with self._cond:
                if state.proc is not None:
                    self._running -= weight
                self._cond.notify_all()
            state.done.set()

    def result(self, key: str) -> subprocess.CompletedProcess[str]:
        """Wait for launch ``key``; its result, or what ``subprocess.run`` would have raised."""
        if key not in self._states:
            raise KeyError(f"no launch {key!r}; this module's launches: {sorted(self._states)}")
        state = self._states[key]
        state.done.wait()
        if state.error is not None:
            raise state.error
        assert state.result is not None
        return state.result

    def close(self) -> None:
        """Kill what still runs (a test failed or was interrupted) and wait for every thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for state in self._states.values():
            if state.proc is not None and state.proc.poll() is None:
                with contextlib.suppress(OSError):
                    state.proc.kill()
        for thread in self._threads:
            thread.join()


def selected_tests(request: pytest.FixtureRequest) -> set[str]:
    """The test functions of ``request``'s module that the session selected (parametrized: once)."""
    return {
        getattr(item, "originalname", item.name)
        for item in request.session.items
        if item.path == request.path
    }


#: A module's launches, and the name its planted script has in error messages.
Launched = tuple["Jobs", str]


@contextlib.contextmanager
def module_jobs(request: pytest.FixtureRequest, jobs: dict[str, Job]) -> Iterator[Jobs]:
    """The launches of the tests of ``request``'s module that the session selected, started now."""
    selected = selected_tests(request)
    runner = Jobs({key: job for key, job in jobs.items() if selected.intersection(job.tests)})
    try:
        yield runner
    finally:
        runner.close()

"""What ``hp-run`` does while its ranks run: a failed rank stops the rest, a signal stops them all.

A SIGINT, SIGTERM or SIGHUP is forwarded to every live rank, the ones left after a grace
period are killed, and ``hp-run`` exits with ``128 + signum``, as ``torchrun`` does:
[Note: signals reach every rank].
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

__all__ = ["FORWARDED_SIGNALS", "SignalCatcher", "exit_status", "stop_after_failure", "supervise"]

FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_S = 0.05
_TERM_GRACE_S = 3.0  # after a rank failure: SIGTERM, then this long before SIGKILL

Procs = list["subprocess.Popen[bytes]"]


def _say(text: str) -> None:
    print(f"[hp-run] {text}", file=sys.stderr, flush=True)


def exit_status(returncode: int) -> int:
    """A rank's exit as a shell reports it: ``128 + signum`` for one a signal ended (Popen's ``-signum``)."""
    return returncode if returncode >= 0 else 128 - returncode


# [Note: signals reach every rank]
# ``torchrun`` forwards SIGINT, SIGTERM and SIGHUP to its workers and kills the
# ones still alive after a timeout; ``hp-run`` does the same, so ``kill``, a
# job scheduler's stop or a Ctrl-C never leaves ranks running with their ports
# held:
#
# - the ranks run in their own sessions (as torchrun's workers do), so a
#   terminal's Ctrl-C reaches them once, through ``hp-run``, rather than twice;
# - on the first such signal ``hp-run`` sends the same signal to every live
#   rank, gives them ``grace_s`` seconds to exit, then SIGKILLs what is left;
#   a second signal kills them at once;
# - ``hp-run`` then exits with ``128 + signum``, the status a shell reports
#   for a process that a signal ended;
# - if ``hp-run`` itself is killed hard (SIGKILL), nothing of it runs, so the
#   ranks rely on the kernel instead: [Note: dying with the parent] in
#   :mod:`hp_testing._lifetime`.
class SignalCatcher:
    """Records SIGINT/SIGTERM/SIGHUP for the supervising loop instead of letting them end ``hp-run``.

    The loop, not the handler, forwards them: the handler may run while the
    ranks are still being started, and forwarding from there would miss the
    ranks started after it.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalCatcher:
        for signum in FORWARDED_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals stay with whoever owns them
                break
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.received.append(signum)


def _live(procs: Procs) -> list[int]:
    return [rank for rank, proc in enumerate(procs) if proc.poll() is None]


def _send(procs: Procs, signum: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)


def _wait_all(procs: Procs, deadline: float, catcher: SignalCatcher | None = None) -> None:
    """Wait for every rank until ``deadline``; with ``catcher``, only until a second signal arrives."""
    while _live(procs) and time.monotonic() < deadline:
        if catcher is not None and len(catcher.received) > 1:
            return
        time.sleep(_POLL_S)


def _kill(procs: Procs) -> None:
    _send(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def stop_after_failure(procs: Procs) -> None:
    """SIGTERM every live rank, then SIGKILL the ones still alive a few seconds later."""
    _send(procs, signal.SIGTERM)
    _wait_all(procs, time.monotonic() + _TERM_GRACE_S)
    _kill(procs)


def _stop_on_signal(procs: Procs, catcher: SignalCatcher, grace_s: float) -> int:
    """Forward the first signal to every rank, kill what is left after ``grace_s``; ``128 + signum``."""
    signum = catcher.received[0]
    name = signal.Signals(signum).name
    running = _live(procs)
    _say(
        f"got {name}; forwarding it to ranks {running} and killing any still running after "
        f"{grace_s:g} s (send it again to kill them now)"
    )
    _send(procs, signum)
    _wait_all(procs, time.monotonic() + grace_s, catcher)
    left = _live(procs)
    if left:
        again = len(catcher.received) > 1
        why = "after a second signal" if again else f"{grace_s:g} s after {name}"
        _say(f"killing ranks {left}, still running {why}")
    _kill(procs)
    return 128 + signum


def supervise(
    procs: Procs,
    grace_s: float,
    catcher: SignalCatcher,
    on_exit: Callable[[int, int], None] | None = None,
) -> int:
    """Wait for the ranks; returns hp-run's exit status (see the module docstring and the README).

    ``on_exit(rank, code)`` is called once for each rank whose process ends
    while another is still running: the checks of the others learn of it
    there ([Note: a rank that exits early] in :mod:`hp_testing.launcher`).
    """
    first_failure: tuple[int, int] | None = None
    stop_at: float | None = None
    announced: set[int] = set()
    while True:
        if catcher.received:
            return _stop_on_signal(procs, catcher, grace_s)
        codes = [p.poll() for p in procs]
        if on_exit is not None and any(code is None for code in codes):
            for rank, code in enumerate(codes):
                if code is not None and rank not in announced:
                    announced.add(rank)
                    on_exit(rank, exit_status(code))
        if first_failure is None:
            for rank, code in enumerate(codes):
                if code is not None and code != 0:
                    first_failure = (rank, code)
                    stop_at = time.monotonic() + grace_s
                    _say(
                        f"rank {rank} exited with code {code}; the other ranks get "
                        f"{grace_s:g} s to finish before they are stopped"
                    )
                    break
        if all(code is not None for code in codes):
            break
        if first_failure is not None and stop_at is not None and time.monotonic() >= stop_at:
            running = [rank for rank, code in enumerate(codes) if code is None]
            _say(f"stopping ranks {running}, still running after rank {first_failure[0]} failed")
            stop_after_failure(procs)
            break
        time.sleep(_POLL_S)
    if catcher.received:  # arrived while the failed ranks were being stopped
        return 128 + catcher.received[0]
    return 0 if first_failure is None else exit_status(first_failure[1])

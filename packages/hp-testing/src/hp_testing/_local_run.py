"""``hp-run --local``: a script on every rank of a local world, in the launcher's own process.

Each rank runs the script as ``python script.py`` would (``runpy`` with
``__name__ == "__main__"``, the script's folder first on ``sys.path``, the
same ``sys.argv``), with the torchrun environment of its rank and its default
group already initialised over the in-memory backend, so
``hp_core.init_distributed()`` is a no-op there. A rank's output is buffered
and printed after the run, each line prefixed with ``[rankN]:``, since the
ranks take turns and their lines would interleave by turn, not by time.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from typing import IO

from hp_testing.local import run_local_outcomes

__all__ = ["run_script"]


def _exit_code(exc: BaseException | None) -> int:
    """The status ``python script.py`` would have ended with."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    return 1


def _emit(text: str, rank: int, sink: IO[str]) -> None:
    for line in text.splitlines():
        sink.write(f"[rank{rank}]: {line}\n")


def run_script(
    target: str, module: bool, script_args: Sequence[str], nproc: int, emulate: str | None = None
) -> int:
    """Run ``target`` on ``nproc`` local ranks; 0, or the first failing rank's exit code.

    ``emulate`` (``"nccl"``, ``"hccl"``) is :func:`hp_testing.run_local`'s."""
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    # runpy swaps sys.modules["__main__"] for the script's module and restores the one it saw; with
    # ranks taking turns inside their runs, a rank can "restore" another rank's script module, which
    # multiprocessing then re-runs in every child it spawns. Put the caller's back ourselves.
    saved_main = sys.modules.get("__main__")
    sys.argv = [target, *script_args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))

    def body(rank: int) -> None:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=False)
        else:
            runpy.run_path(target, run_name="__main__")

    try:
        outcomes = run_local_outcomes(body, nproc, emulate=emulate)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
    first: tuple[int, int] | None = None
    for outcome in outcomes:
        _emit(outcome.stdout, outcome.rank, sys.stdout)
        _emit(outcome.stderr, outcome.rank, sys.stderr)
        code = _exit_code(outcome.exception)
        if code != 0:
            if not isinstance(outcome.exception, SystemExit):
                _emit(outcome.error, outcome.rank, sys.stderr)
            if first is None:
                first = (outcome.rank, code)
    sys.stdout.flush()
    if first is None:
        return 0
    rank, code = first
    print(f"[hp-run] rank {rank} failed with exit code {code} (local mode)", file=sys.stderr)
    return code

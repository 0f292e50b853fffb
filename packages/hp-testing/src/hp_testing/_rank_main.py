"""How an ``hp-run`` rank runs the user's script and ends: as ``python script.py`` would, minus finalization.

Every hp-run rank starts here (``--no-checks`` included); :mod:`hp_testing._emulated_main`
installs the emulation layer first and then does the same. A rank does what Python does at
exit up to finalization and then leaves with ``os._exit``, which avoids a gloo race that
aborts a script that succeeded: [Note: a rank ends without interpreter finalization].
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import threading
from collections.abc import Callable


def run_script(rest: list[str]) -> None:
    """Run the user's script (``[path, *args]``) or module (``["-m", name, *args]``) as ``__main__``."""
    if rest and rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        # ``python script.py`` puts the script's folder first, not the working directory
        # that ``python -m hp_testing._rank_main`` put there.
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
        runpy.run_path(rest[0], run_name="__main__")


def _status(code: object) -> int:
    """The process status ``SystemExit(code)`` gives in Python (a non-int code is printed, then 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# [Note: a rank ends without interpreter finalization]
# gloo's worker thread drops a finished collective's work object a moment after the caller's
# ``wait()`` returns. When that object holds the last reference to a tensor whose Python object
# has already died, dropping it takes the GIL. If the main thread has meanwhile entered
# interpreter finalization (the script's last collective was right before its end), Python ends
# the worker with ``pthread_exit``, whose unwinding crosses a ``noexcept`` destructor:
# ``terminate called without an active exception`` and exit code 134, after the script
# succeeded. gdb shows it as ``take_gil`` under ``decref_pyobject`` under
# ``ProcessGroupGloo::AsyncWork::~AsyncWork`` in ``runLoop``. A plain two-rank script whose rank
# 1 calls ``sys.exit(0)`` after one ``all_reduce`` hits it about once in 20 runs on a loaded
# machine; CI saw it about once per full run across hp-run's tests. torch tracks it as issue
# 190489 (its ``atexit`` fix, PR 179291, was abandoned: destroying groups at exit can block on a
# peer that is gone).
#
# So a rank does what Python does at exit up to finalization (join non-daemon threads, run the
# ``atexit`` handlers, flush stdio) and then leaves with ``os._exit``, as ``multiprocessing``'s
# children do. Nothing is skipped that a script can observe, and nothing can block: no process
# group is destroyed. The exit status is Python's: 0, the ``SystemExit`` code, or 1 after an
# uncaught exception that ``sys.excepthook`` printed. An uncaught ``KeyboardInterrupt`` ends the
# rank by ``SIGINT``, as Python does. Under plain ``torchrun`` the race is torch's; calling
# ``destroy_process_group()`` and dropping every object that holds a group makes it rarer, not
# impossible.
def run_and_exit(body: Callable[[], None]) -> None:
    """Run ``body`` (the script), then end the process without finalization; never returns."""
    status = 0
    interrupted = False
    try:
        body()
    except SystemExit as exc:
        status = _status(exc.code)
    except KeyboardInterrupt as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status, interrupted = 1, True
    except BaseException as exc:  # reported as Python reports it, then status 1
        sys.excepthook(type(exc), exc, exc.__traceback__)
        status = 1
    _leave(status, interrupted)


def _leave(status: int, interrupted: bool) -> None:
    """What ``Py_FinalizeEx`` does before tearing down the interpreter, then ``os._exit``."""
    # private, as multiprocessing's children use it: joins the non-daemon threads
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()  # prints a failing handler's error and goes on, as at a normal exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the script
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)  # as the OS truncates Python's own status


def main(argv: list[str]) -> None:
    """``argv``: the target, as for :func:`run_script`."""
    run_and_exit(lambda: run_script(argv))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Child processes that die with their parent, for the pool's ranks and for ``hp-run``'s.

On Linux the kernel kills a rank when its parent exits, however it exits
([Note: dying with the parent]); elsewhere this is a no-op. This module
imports nothing heavy: ``hp-run`` uses it without importing torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "preexec_die_with_parent"]

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where there is none (not Linux, or no loadable libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl


# [Note: dying with the parent]
# A rank blocked inside a gloo collective never returns to Python, so no
# ``finally`` or ``atexit`` of ours can clean it up; if its parent (the pytest
# process's forkserver, or ``hp-run``) is killed hard, it would live on, holding
# its ports, until someone finds it. On Linux ``prctl(PR_SET_PDEATHSIG,
# SIGKILL)`` asks the kernel to kill the child when the parent thread that
# created it exits, however that happens. Elsewhere this is a no-op and the
# launcher's own signal forwarding is all there is.
#
# The signal is armed in the child, so there is a window between its creation
# and the ``prctl`` call; a parent that died in that window is caught by
# comparing ``getppid()`` with the parent we expected. For ``subprocess.Popen``
# the call runs between ``fork`` and ``exec`` (``preexec_fn``), where only
# async-signal-safe work is sound, so :func:`preexec_die_with_parent` resolves
# ``prctl`` in the parent and the child only calls a function pointer.
def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (see [Note: dying with the parent])."""
    prctl = _prctl()
    if prctl is not None:
        with contextlib.suppress(Exception):
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


def preexec_die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child die with this process.

    Returns None where the platform cannot do it, so the caller passes
    ``preexec_fn=None`` and loses nothing else.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(128 + int(signal.SIGKILL))

    return arm

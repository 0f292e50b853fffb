"""Start the rank forkserver as soon as pytest loads the plugin.

The forkserver imports torch once so every rank forked from it starts in
milliseconds. That import takes about two seconds; started here, before the
pytest process has imported torch itself (for the plugin and the test
modules), the two imports run side by side instead of one after the other.
Only the pytest process starts it: not the forkserver, not the ranks, not a
rank of a torchrun launch (RANK set). ``HP_TEST_PRESTART=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

PRELOAD = ["hp_testing._worker"]
_started_by: int | None = None  # pid of the process that started the forkserver


def forkserver_context() -> object:
    """The forkserver context with torch (through the worker module) preloaded."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_forkserver() -> None:
    """Start the forkserver (a no-op once it runs) with torch's C++ warnings off.

    The cross-rank checks wait on the store with short timeouts; each timeout
    makes c10d print a socket warning, which would bury the test's own output.
    The level is read once, when the forkserver imports torch.
    """
    global _started_by
    from multiprocessing import forkserver

    forkserver_context()
    if _started_by is not None and _started_by != os.getpid():
        # A fork of the process that started it (pytest-forked's children):
        # the inherited forkserver is not our child, so multiprocessing can
        # neither wait for it nor rely on it; forget it and start our own.
        server: Any = forkserver._forkserver
        for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid"):
            setattr(server, name, None)
    _started_by = os.getpid()
    saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
    if saved is None:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def start_forkserver_early() -> None:
    """Called when hp_testing is imported: start the forkserver if this is a pytest process."""
    if "_pytest.config" not in sys.modules or "RANK" in os.environ:
        return
    if os.environ.get("HP_TEST_PRESTART", "1") == "0":
        return
    with contextlib.suppress(Exception):  # the pool starts it later if this fails
        start_forkserver()

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
import itertools
import os
import re
import sys
from collections.abc import Iterator
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


# [Note: no early forkserver for torch's test classes]
# When torch's test classes are pooled, the plugin replaces the forkserver after
# collection with one forked from the pytest process (pool.preload), so the early
# one's import of torch is wasted: on a busy 2-core machine it competes with the
# pytest process's own import (the 40-test benchmark's pooled session: 22.5-27.6 s
# with it, 17.5-17.7 s without). Collection has not run yet when hp_testing is
# imported, so the test files named on the command line are read for torch's
# harness module; a hit means no early start. A miss only costs what the early
# start saves; a false hit only what it would have saved (the pool starts one).
#: An import of torch's harness, or a class derived from one of its classes, in a test file.
_TORCH_CLASSES = re.compile(
    rb"^\s*(from|import) torch\.testing\._internal\.(common_distributed|distributed\._tensor\.common_dtensor)"
    rb"|^class \w+\([^)]*(MultiProcessTestCase|MultiProcContinuousTest|DTensorTestBase)",
    re.MULTILINE,
)
_SCAN_LIMIT = 2000  # test files read at most; beyond that, start early as usual
_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "build", "dist"}


def _test_files(paths: list[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
            for name in sorted(files):
                if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
                    yield os.path.join(folder, name)


def session_pools_torch_classes(argv: list[str]) -> bool:
    """Whether the test files named in ``argv`` use torch's multi-process test classes, pooled."""
    flag = "--hp-torch-testcases"
    pairs = [f"{a}={b}" for a, b in itertools.pairwise(argv) if a == flag]
    if f"{flag}=torch" in [*argv, *pairs]:
        return False  # torch's harness runs them: nothing replaces the early forkserver
    paths = [arg.split("::")[0] for arg in argv if not arg.startswith("-")]
    paths = [path for path in paths if os.path.exists(path)]
    for count, name in enumerate(_test_files(paths)):
        if count >= _SCAN_LIMIT:
            return False
        try:
            with open(name, "rb") as f:
                text = f.read()
        except OSError:
            continue
        if _TORCH_CLASSES.search(text):
            return True
    return False


def start_forkserver_early() -> None:
    """Called when hp_testing is imported: start the forkserver if this is a pytest process."""
    if "_pytest.config" not in sys.modules or "RANK" in os.environ:
        return
    if os.environ.get("HP_TEST_PRESTART", "1") == "0":
        return
    with contextlib.suppress(Exception):
        if session_pools_torch_classes(sys.argv[1:]):
            return  # [Note: no early forkserver for torch's test classes]
    with contextlib.suppress(Exception):  # the pool starts it later if this fails
        start_forkserver()

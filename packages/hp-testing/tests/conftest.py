"""Shared helpers for hp-testing's own tests."""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable

import pytest
from hp_testing.local import _import_state_modules

# [Note: local mode beside pytester]
# Local mode runs its ranks in this pytest process and imports hp's packages (and, through
# them, torch's DTensor and functional collectives) here. pytester's in-process inner sessions
# (this module's and other modules') forget every module first imported during them, and a
# second import of those torch modules registers their operator libraries twice
# ("Only a single TORCH_LIBRARY ...", "Tried to register an operator ... multiple times").
# Imported here, before any test module and any inner session, they are never forgotten
# (whichever test files a run selects).
_import_state_modules(())
importlib.import_module("torch.distributed._functional_collectives")

#: Runs a test module's source in an inner pytest session: (result, report section per failed test).
Inner = Callable[[str], tuple[pytest.RunResult, dict[str, str]]]


def _forkserver_children() -> list[int]:
    """Live rank processes: children of the multiprocessing forkserver (read from /proc)."""
    from multiprocessing import forkserver

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server is None:
        return []
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == server and fields[0] != "Z":
            kids.append(int(entry))
    return kids


@pytest.fixture
def rank_processes() -> Callable[[], list[int]]:
    """A function listing the live rank processes, to check none outlives a session."""
    return _forkserver_children


@pytest.fixture
def inner(pytester: pytest.Pytester) -> Inner:
    """Run planted-bug scenarios as ``test_inner.py`` in an inner session; split its report per test."""

    def run(source: str) -> tuple[pytest.RunResult, dict[str, str]]:
        pytester.makepyfile(test_inner=source)
        result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
        sections: dict[str, str] = {}
        current = None
        for line in result.stdout.lines:
            if "short test summary info" in line:
                break  # the summary repeats every message (in full when CI is set)
            match = re.match(r"^_+ (test_\w+(?:\[[^\]]*\])?) _+$", line)
            if match:
                current = match.group(1)
                sections[current] = ""
            elif current is not None:
                sections[current] += line + "\n"
        return result, sections

    return run

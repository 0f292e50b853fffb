"""Shared helpers for hp-testing's own tests."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest


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

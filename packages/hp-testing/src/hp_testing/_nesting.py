"""Which calls the emulation layer sees: only the outermost one on each thread.

[Note: one call through the layer]
Nested calls (torch's ``all_gather_object`` calling ``all_gather``, our own
emulations calling gloo, the layer's own clones and copies) pass straight
through: a thread-local depth counter makes only the outermost call count,
so sequence numbers match what the user wrote on every rank, and the strict
read guard (:mod:`hp_testing._read_guard`) never mistakes the layer's own
tensor work for the user's.
"""

from __future__ import annotations

import threading

__all__ = ["STATE", "Nested", "depth"]


class _State(threading.local):
    """Per-thread nesting depth; a class default, so reading it on a fresh thread raises nothing.

    The strict read guard reads it on every aten op while work is pending:
    ``getattr(local, "depth", 0)`` on a thread that never set it raises and
    catches an AttributeError inside each read, which cost more than the check.
    """

    depth = 0


#: This thread's nesting state; the read guard reads ``STATE.depth`` directly (one attribute load).
STATE = _State()


def depth() -> int:
    """How many layer calls are open on this thread (0: the user's own code is running)."""
    return STATE.depth


class Nested:
    """``with Nested():`` marks the block as the layer's own work ([Note: one call through the layer])."""

    def __enter__(self) -> None:
        STATE.depth += 1

    def __exit__(self, *exc: object) -> None:
        STATE.depth -= 1

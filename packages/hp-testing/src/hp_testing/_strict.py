"""Strict mode on one rank: which buffers of an async call are watched, and the work not waited yet.

Strict mode (the marker's ``strict=True``, ``HP_TEST_STRICT=1``, ``hp-run``
under ``--emulate``) has three layers of defence, from the earliest to the last:

1. the read guard (:mod:`hp_testing._read_guard`) raises when the program
   touches a pending output or writes a pending input, naming both call sites;
2. the input snapshots (:mod:`hp_testing._hazards`), compared at ``wait()``,
   for writes the guard cannot see (another thread, a buffer protocol);
3. work never waited is listed at the end of the test or script.

:class:`StrictMode` decides, per kind of call, which tensors are outputs
(written by the backend until ``wait()``) and which are inputs (read by it),
and ties the three together for each async call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from hp_testing._calls import Call
from hp_testing._hazards import AsyncBuffers, AsyncHazardError, CheckedWork
from hp_testing._read_guard import ReadGuard

__all__ = ["StrictMode"]


class StrictMode:
    """The strict-mode state of one rank: the read guard and the async work not waited yet."""

    def __init__(self) -> None:
        self.guard = ReadGuard()
        self.unwaited: dict[int, tuple[str, str]] = {}
        self._tokens = itertools.count()

    def check_passed(self, call: Call) -> None:
        """A buffer still pending may not be handed to another call (read as input, written as output)."""
        if self.guard.buffers:
            # Passing a pending output anywhere reads or writes it; a pending input may be read.
            tensors = [(label, t, True) for label, t in call.outputs]
            outputs = [t for _, t in call.outputs]
            tensors += [(label, t, False) for label, t in call.inputs if all(t is not o for o in outputs)]
            self.guard.check_passed(tensors, call.shown)

    def collective_buffers(self, name: str, call: Call, rank: int) -> AsyncBuffers:
        """The outputs and inputs of collective ``name``, inputs snapshotted (see :mod:`._hazards`)."""
        buffers = AsyncBuffers(call.shown, call.site)
        root_reads = name == "broadcast" and call.root == rank  # the root's tensor is only read
        if not root_reads:
            for label, tensor in call.outputs:
                buffers.output(label, tensor)
        for label, tensor in call.inputs:
            buffers.input(label, tensor)
        return buffers

    def p2p_buffers(
        self, call: Call, tensor: torch.Tensor, *, send: bool, label: str = "tensor"
    ) -> AsyncBuffers:
        """One isend (its buffer is an input) or irecv (an output)."""
        buffers = AsyncBuffers(call.shown, call.site)
        if send:
            buffers.input(label, tensor)
        else:
            buffers.output(label, tensor)
        return buffers

    def watch(
        self, buffers: AsyncBuffers, what: str, site: str, *, unwaited: bool = True
    ) -> Callable[[CheckedWork], None]:
        """Start watching the call's buffers; the returned hook ends it at ``wait()``.

        ``unwaited``: list the call at the end if it is never waited.
        """
        token = next(self._tokens)
        if unwaited:
            self.unwaited[token] = (what, site)
        watched = [(user, _phrase("output", label), True) for label, user in buffers.outputs]
        watched += [(user, _phrase("input", label), False) for label, user, _ in buffers.inputs]
        self.guard.add(token, watched, what, site)

        def waited(_: CheckedWork) -> None:
            self.unwaited.pop(token, None)
            self.guard.remove(token)

        return waited

    def check_unwaited(self) -> None:
        """Raise for async work never waited (end of a test, or of an ``hp-run`` script)."""
        self.guard.clear()
        if self.unwaited:
            lines = "\n".join(f"  {what} at {site}" for what, site in self.unwaited.values())
            self.unwaited = {}
            raise AsyncHazardError(
                "async work issued with async_op=True was never waited:\n"
                + lines
                + "\nOn a GPU its result would be read (or its buffers reused) while the collective is "
                "still running. Call .wait() on every work handle."
            )

    def clear(self) -> None:
        """Forget the test's work and take the read guard off."""
        self.unwaited = {}
        self.guard.clear()


def _phrase(side: str, label: str) -> str:
    """How a report names a buffer: ``the output tensor``, ``the buffer of irecv(...)``."""
    if label.startswith("the "):
        return label
    return f"the {side}" if label == side else f"the {side} {label}"

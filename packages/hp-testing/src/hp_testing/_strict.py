"""Strict mode on one rank: which buffers of an async call are shadowed, watched and waited for.

Strict mode (the marker's ``strict=True``, ``HP_TEST_STRICT=1``, ``hp-run``
under ``--emulate``) has three layers of defence, from the earliest to the last:

1. the read guard (:mod:`hp_testing._read_guard`) raises when the program
   touches a pending output or writes a pending input, naming both call sites;
2. the shadows (:mod:`hp_testing._hazards`): the collective runs on private
   copies and the caller's outputs hold poison until ``wait()``, which checks
   that nothing escaped the guard (another thread, a buffer protocol);
3. work never waited is listed at the end of the test or script.

:class:`StrictMode` decides, per kind of call, which tensors are outputs
(written by the backend until ``wait()``) and which are inputs (read by it),
and ties the three together for each async call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from hp_testing._calls import Call
from hp_testing._hazards import AsyncHazardError, CheckedWork, Shadows
from hp_testing._read_guard import ReadGuard

__all__ = ["StrictMode"]

#: The argument that holds the output of each collective (written until ``wait()``).
_OUTPUT_ARG = {
    "all_reduce": "tensor",
    "reduce": "tensor",
    "all_gather_single": "output_tensor",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_single": "output",
    "reduce_scatter_tensor": "output",
    "reduce_scatter": "output",
    "all_to_all_single": "output",
}
_OUTPUT_LIST_ARG = {"all_gather": "tensor_list", "all_to_all": "output_tensor_list"}


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

    def shadow_collective(self, name: str, call: Call, args: dict[str, Any], rank: int) -> Shadows:
        """Swap the outputs in ``args`` for shadows and snapshot the inputs (see :mod:`._hazards`)."""
        shadows = Shadows(call.shown, call.site)
        key = _OUTPUT_ARG.get(name)
        if name == "broadcast" and call.root != rank:
            key = "tensor"  # the root's tensor is an input: it is only read
        if key is not None:
            args[key] = shadows.shadow_output(key, args[key])
        elif name in _OUTPUT_LIST_ARG:
            key = _OUTPUT_LIST_ARG[name]
            args[key] = [shadows.shadow_output(f"{key}[{i}]", t) for i, t in enumerate(args[key])]
        for label, tensor in call.inputs:
            aliased = shadows.alias_in_shadow(tensor)
            if aliased is not None and label in args:
                args[label] = aliased  # an in-place collective's input: read it from the shadow
                continue
            shadows.snapshot_input(label, tensor)
        return shadows

    def shadow_p2p(
        self, call: Call, tensor: torch.Tensor, *, send: bool, label: str = "tensor"
    ) -> tuple[Shadows, torch.Tensor]:
        """One isend (its buffer is an input) or irecv (an output); returns what gloo gets."""
        shadows = Shadows(call.shown, call.site)
        if send:
            shadows.snapshot_input(label, tensor)
            return shadows, tensor
        return shadows, shadows.shadow_output(label, tensor)

    def watch(
        self, shadows: Shadows, what: str, site: str, *, unwaited: bool = True
    ) -> Callable[[CheckedWork], None]:
        """Poison the outputs, start watching the buffers; the returned hook ends it at ``wait()``.

        ``unwaited``: list the call at the end if it is never waited.
        """
        shadows.poison()
        token = next(self._tokens)
        if unwaited:
            self.unwaited[token] = (what, site)
        buffers = [(user, _phrase("output", label), True) for label, user, _ in shadows.outputs]
        buffers += [(user, _phrase("input", label), False) for label, user, _ in shadows.inputs]
        self.guard.add(token, buffers, what, site)

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

"""What strict mode keeps of an async call until ``wait()``: its buffers, input snapshots, the work handle.

On a GPU an async collective writes its output some time before ``wait()``
returns and reads its input until then; gloo on a CPU usually finishes before
the caller looks, so races stay invisible. The read guard
(:mod:`hp_testing._read_guard`) raises at the touch itself; this module is
what it watches and its backstop: :class:`AsyncBuffers` records a call's
outputs and inputs, snapshots each input at issue and compares it at
``wait()``, so a write the guard cannot see (another thread, the buffer
protocol) is still reported, with the call's site. Outputs are the caller's
own tensors ([Note: why outputs are not shadowed]).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_testing._checked_future import CheckedFuture

__all__ = ["AsyncBuffers", "AsyncHazardError", "CheckedWork", "DoneWork"]


class AsyncHazardError(RuntimeError):
    """An async collective's buffer was touched between issue and ``wait()``, or never waited."""


# [Note: handles are torch Works]
# torch code decides whether to wait a handle by its type: FSDP2 waits an async
# all-gather only ``if isinstance(work, dist.distributed_c10d.Work)`` (a handle
# of any other type is taken for a finished op) and then reads the gathered
# parameters. A handle the layer returns that is not a ``dist.Work`` is therefore
# never waited: FSDP2 read buffers gloo was still writing, and torch's PP x FSDP
# got wrong or NaN gradients under the checks only. Both handles below subclass
# ``dist.Work`` (a pybind class with a Python trampoline, as in torch's own
# Python process groups), and every method of ``Work`` is defined here, since
# the base class's own would answer for an empty C++ work, not the real one.
class DoneWork(dist.Work):
    """A work handle for something that already finished (emulated synchronously)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        del timeout
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return []

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result([])
        return future

    def synchronize(self) -> None:
        return None


# [Note: why outputs are not shadowed]
# Strict mode once ran each async collective on private copies of its outputs
# and filled the caller's with NaN until ``wait()``. An early read then showed
# up, if at all, as a wrong number somewhere later, and the copies, the fill,
# the check and the copy back cost more than the rest of strict mode together
# (2.4x a plain gloo step in ``benchmarks/emulation_overhead.py``, against 1.5x
# without them). With the guard every read on the rank's thread raises where
# it happens, so the outputs are now the caller's own tensors, written by gloo.
class AsyncBuffers:
    """The buffers of one async call in strict mode: outputs (written by it), inputs (read by it)."""

    def __init__(self, what: str, site: str) -> None:
        self.what = what
        self.site = site
        self.outputs: list[tuple[str, torch.Tensor]] = []  # label, the caller's tensor
        self.inputs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # label, tensor, snapshot at issue

    def output(self, label: str, tensor: torch.Tensor) -> None:
        if all(user is not tensor for _, user in self.outputs):
            self.outputs.append((label, tensor))

    def _inside_output(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares storage with an output (an in-place collective's input)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(user.untyped_storage().data_ptr() == ptr for _, user in self.outputs)

    def input(self, label: str, tensor: torch.Tensor) -> None:
        """Snapshot an input, unless it is (part of) an output: an all-reduce's tensor, FSDP's
        in-place all-gather chunk; the output's own check covers those."""
        if tensor.numel() and not self._inside_output(tensor):
            self.inputs.append((label, tensor, tensor.detach().clone()))

    def settle(self) -> None:
        """At ``wait()``: every input must still equal its snapshot."""
        problems = []
        for label, user, snapshot in self.inputs:
            same = user.shape == snapshot.shape and bool(
                torch.equal(user.detach(), snapshot)
                or (
                    (user.is_floating_point() or user.is_complex())
                    and torch.equal(torch.isnan(user), torch.isnan(snapshot))
                    and torch.equal(torch.nan_to_num(user.detach()), torch.nan_to_num(snapshot))
                )
            )
            if not same:
                problems.append(f"its input {label} was modified")
        if problems:
            raise AsyncHazardError(
                f"{self.what} issued with async_op=True at {self.site}: between the issue and wait(), "
                + " and ".join(problems)
                + ". On a GPU the collective reads its input and writes its output until wait() returns, "
                "so this races with the communication. Call wait() before touching the buffers "
                "(or clone them)."
            )


class CheckedWork(dist.Work):
    """A torch ``Work`` plus what must run at ``wait()`` (p2p matching, strict-mode hand-over).

    A ``dist.Work`` itself ([Note: handles are torch Works]); what only reads
    the real work's state goes to it, what waits runs the checks first.
    """

    def __init__(
        self,
        inner: Any,
        before: Sequence[Callable[[], object]],
        after: Sequence[Callable[[], object]],
        on_waited: Callable[[CheckedWork], None] | None = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._before = before
        self._after = after
        self._on_waited = on_waited
        self._waited = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._waited:
            self._waited = True
            if self._on_waited is not None:
                self._on_waited(self)
            for step in self._before:
                step()
            if timeout is None:
                self._inner.wait()
            else:
                self._inner.wait(timeout)
            for step in self._after:
                step()
        return True

    def is_completed(self) -> bool:
        if self._waited:
            return True
        if self._inner.is_completed():
            self.wait()
            return True
        return False

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()  # on gloo's CPU "stream" blocking it means waiting

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def result(self) -> Any:
        return self._inner.result()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def get_future(self) -> Any:
        return CheckedFuture(self.wait, self._inner.get_future())  # its wait() runs the checks wait() runs

    def get_future_result(self) -> Any:
        return self._inner.get_future_result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

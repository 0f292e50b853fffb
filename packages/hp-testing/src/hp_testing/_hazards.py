"""Async hazards in strict mode: poisoned outputs, inputs changed before ``wait()``, works never waited.

On a GPU an async collective writes its output some time before ``wait()``
returns and reads its input until then; gloo on a CPU usually finishes before
the caller looks, so races stay invisible. In strict mode the collective runs
on private copies (a *shadow* of each output, taken at issue), the caller's
output is filled with a poison value (NaN, or the dtype's largest integer)
until ``wait()`` copies the result in, and each input is compared at
``wait()`` with a snapshot taken at issue. This is the backstop behind the
read guard (:mod:`hp_testing._read_guard`), which raises at the touch itself:
a read the guard cannot see (another thread, the buffer protocol) still finds
poison, and a write it cannot see is reported at ``wait()`` with the call's site.

:class:`CheckedWork` is what a wrapped call returns whenever something must
happen at ``wait()``; every other attribute is the torch ``Work``'s.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["AsyncHazardError", "CheckedWork", "DoneWork", "Shadows", "poison_value"]


class AsyncHazardError(RuntimeError):
    """An async collective's buffer was touched between issue and ``wait()``, or never waited."""


class DoneWork:
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


def poison_value(tensor: torch.Tensor) -> float | int | bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    if tensor.dtype == torch.bool:
        return True
    return int(torch.iinfo(tensor.dtype).max)


def _is_poisoned(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0:
        return True
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).all())
    return bool((tensor == poison_value(tensor)).all())


class Shadows:
    """The strict-mode bookkeeping of one async call."""

    def __init__(self, what: str, site: str) -> None:
        self.what = what
        self.site = site
        self.outputs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # label, user tensor, shadow
        self.inputs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # label, user tensor, snapshot

    def shadow_output(self, label: str, tensor: torch.Tensor) -> torch.Tensor:
        for _, user, shadow in self.outputs:
            if user is tensor:
                return shadow
        shadow = tensor.detach().clone()
        self.outputs.append((label, tensor, shadow))
        return shadow

    def alias_in_shadow(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The shadow's view of ``tensor`` when it is a piece of a shadowed output, else None.

        An in-place all-gather passes its input as this rank's chunk of the
        output (FSDP's gathers do): poisoning the output poisons that input
        too, so the collective must read the chunk from the shadow, and the
        input is covered by the output's check instead of a snapshot of its own.
        """
        for _, user, shadow in self.outputs:
            if tensor.untyped_storage().data_ptr() != user.untyped_storage().data_ptr():
                continue
            offset = tensor.storage_offset() - user.storage_offset()
            if (
                tensor.is_contiguous()
                and user.is_contiguous()
                and 0 <= offset <= user.numel() - tensor.numel()
            ):
                return shadow.view(-1)[offset : offset + tensor.numel()].view(tensor.shape)
        return None

    def snapshot_input(self, label: str, tensor: torch.Tensor) -> None:
        if any(user is tensor for _, user, _ in self.outputs):
            return
        self.inputs.append((label, tensor, tensor.detach().clone()))

    def poison(self) -> None:
        with torch.no_grad():
            for _, user, _ in self.outputs:
                if user.numel():
                    user.fill_(poison_value(user))

    def settle(self) -> None:
        """At ``wait()``: check nothing was touched, then hand the results over."""
        problems = []
        for label, user, _ in self.outputs:
            if not _is_poisoned(user):
                problems.append(f"its output {label} was written to")
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
        with torch.no_grad():
            for _, user, shadow in self.outputs:
                user.copy_(shadow)
        if problems:
            raise AsyncHazardError(
                f"{self.what} issued with async_op=True at {self.site}: between the issue and wait(), "
                + " and ".join(problems)
                + ". On a GPU the collective reads its input and writes its output until wait() returns, "
                "so this races with the communication. Call wait() before touching the buffers "
                "(or clone them)."
            )


class CheckedWork:
    """A torch ``Work`` plus what must run at ``wait()`` (p2p matching, strict-mode hand-over)."""

    def __init__(
        self,
        inner: Any,
        before: Sequence[Callable[[], object]],
        after: Sequence[Callable[[], object]],
        on_waited: Callable[[CheckedWork], None] | None = None,
    ) -> None:
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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

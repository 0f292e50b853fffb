"""Strict mode: touching a pending async collective's buffers raises at the touch, naming both sites.

[Note: catching a read before wait()]
On a GPU an async collective (or ``irecv``) writes its output until
``wait()`` returns and reads its input until then. A program that reads the
output early (``.item()``, ``print``, ``.tolist()``, any op) sees partial
data, and one that writes the input early corrupts what the peers receive.
gloo on a CPU usually finishes first, so the race stays invisible there.

While strict mode has async work pending on this rank, a
``TorchDispatchMode`` sees every aten op the rank's thread runs and compares
the byte range of each tensor argument (``data_ptr`` to the end of its
strided extent) with the ranges of the pending buffers:

- any op that touches a pending *output* (an all-reduce's tensor, an
  all-gather's output, an ``irecv`` buffer) raises, reading or writing;
- an op that *writes* (its schema marks the argument mutable) to a pending
  *input* (a reduce-scatter's input, an ``isend`` buffer) raises.

View and metadata ops (``view``, slicing, ``split``, ``detach``,
``empty_like``, ...) read no data and pass. ``print`` and ``.tolist()`` read
without dispatching an op (torch's printing switches dispatch modes off), so
``Tensor.__repr__``, ``tolist`` and ``numpy`` are wrapped for as long as the
mode is on. The layer's own work (input snapshots, the check at ``wait()``,
gloo's threads) runs nested or on other threads and is not seen
([Note: one call through the layer]).

The cost is paid only in strict mode and only while something is pending:
the mode is pushed when the first async call of a quiet rank is issued and
popped when the last one is waited. If the program pushed a dispatch mode of
its own in between, ours stays under it (inert) until it is on top again.
Writes that escape the mode (another thread, a buffer protocol) to an input
are still found at ``wait()`` by the snapshots of :mod:`hp_testing._hazards`;
reads that escape it are not caught ([Note: why outputs are not shadowed]).

``__torch_dispatch__`` is not wrapped in ``torch._disable_dynamo`` (as torch
does by default for a mode): that wrapper costs more per op than the check
itself, and the mode is never compiled (it is pushed and popped in eager code).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from hp_testing._calls import call_site
from hp_testing._hazards import AsyncHazardError
from hp_testing._nesting import depth

__all__ = ["PendingBuffer", "ReadGuard"]

#: Ops that take a tensor but read none of its data.
_METADATA_OPS = frozenset(
    {
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "size",
        "stride",
        "dim",
        "is_contiguous",
        "record_stream",
        "lift_fresh",
        "_version",
    }
)

_FRIENDLY = {"_local_scalar_dense": ".item() (aten._local_scalar_dense)"}


@dataclass(frozen=True)
class PendingBuffer:
    """One buffer of an async call that is not waited yet."""

    start: int  # byte range [start, end) in this process's memory
    end: int
    label: str  # "the output tensor", "the input input_tensor", "the buffer of irecv(...)"
    output: bool  # written by the collective (no touching) or read by it (no writing)
    what: str  # the call, as the reports show it
    site: str  # where it was issued


def _extent(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The byte range ``tensor`` covers, or None when it has no plain storage (meta, fake, wrappers)."""
    try:
        count = tensor.numel()
        if count == 0 or tensor.device.type == "meta":
            return None
        start = tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if start == 0:
        return None
    size = tensor.element_size()
    if tensor.is_contiguous():
        return start, start + count * size
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True) if n > 1)
    return start, start + span * size


@functools.cache
def _op_info(func: Any) -> tuple[bool, frozenset[int], frozenset[str]]:
    """(reads no data, positions written, keyword arguments written) of an aten overload."""
    schema = func._schema
    base = schema.name.split("::")[-1]
    if getattr(func, "is_view", False) or base in _METADATA_OPS:
        return True, frozenset(), frozenset()
    positions, names = set(), set()
    for index, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is not None and info.is_write:
            positions.add(index)
            names.add(argument.name)
    return False, frozenset(positions), frozenset(names)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


class _Mode(TorchDispatchMode):
    """The dispatch mode that routes every aten op of this thread through :meth:`ReadGuard.inspect`."""

    def __init__(self, guard: ReadGuard) -> None:
        super().__init__()
        self.guard = guard

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # see the module docstring: no _disable_dynamo wrapper per op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.guard.buffers and not depth():
            self.guard.inspect(func, args, kwargs)
        return func(*args, **kwargs)


class ReadGuard:
    """This rank's pending buffers and the mode that watches them ([Note: catching a read before wait()])."""

    def __init__(self) -> None:
        self.buffers: list[PendingBuffer] = []
        self._by_token: dict[int, list[PendingBuffer]] = {}
        self._mode: _Mode | None = None
        self._patched: dict[str, Any] = {}
        self._warm = False

    # -- pending work ----------------------------------------------------------------

    def add(self, token: int, buffers: list[tuple[torch.Tensor, str, bool]], what: str, site: str) -> None:
        """Watch ``buffers`` (tensor, label, is-output) of a call issued at ``site`` until :meth:`remove`."""
        pending = []
        for tensor, label, output in buffers:
            extent = _extent(tensor)
            if extent is not None:
                pending.append(PendingBuffer(extent[0], extent[1], label, output, what, site))
        if not pending:
            return
        self._by_token[token] = pending
        self.buffers = [b for group in self._by_token.values() for b in group]
        self._arm()

    def remove(self, token: int) -> None:
        """The call of ``token`` was waited: its buffers are the program's again."""
        if self._by_token.pop(token, None) is None:
            return
        self.buffers = [b for group in self._by_token.values() for b in group]
        if not self.buffers:
            self._disarm()

    def warm_up(self) -> None:
        """Run the mode once, before the program does: a first use may import parts of torch.

        With torch's default ``_disable_dynamo`` wrapper the first op imported
        ``torch._dynamo`` (seconds on a busy machine): paid inside a read check,
        that delayed a rank's error past the pool's grace period while its peers,
        which had reported theirs, waited. Whatever a first use still costs is
        paid here, at the start of a strict test, before any collective.
        """
        if self._warm:
            return
        self._warm = True
        with _Mode(self):
            torch.zeros(1).add_(0)

    def clear(self) -> None:
        """End of a test (or script): forget everything and take the mode off."""
        self._by_token.clear()
        self.buffers = []
        self._disarm(force=True)

    # -- checks ----------------------------------------------------------------------

    def check_passed(self, tensors: list[tuple[str, torch.Tensor, bool]], what: str) -> None:
        """A new call ``what`` takes ``tensors`` (label, tensor, is-output): none may be a pending buffer."""
        if not self.buffers:
            return
        for label, tensor, output in tensors:
            self._touch(tensor, output, f"{what} (its {label})", call_site(3))

    def inspect(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """Raise if aten op ``func`` touches a pending output or writes a pending input."""
        reads_nothing, positions, names = _op_info(func)
        if reads_nothing:
            return
        for index, value in enumerate(args):
            for tensor in _tensors(value):
                self._touch(tensor, index in positions, func, None)
        for name, value in kwargs.items():
            for tensor in _tensors(value):
                self._touch(tensor, name in names, func, None)

    def _touch(self, tensor: torch.Tensor, writes: bool, op: Any, site: str | None) -> None:
        extent = _extent(tensor)
        if extent is None:
            return
        start, end = extent
        for buffer in self.buffers:
            if start < buffer.end and buffer.start < end and (buffer.output or writes):
                self._raise(buffer, op, writes, site or call_site(3))

    def _raise(self, buffer: PendingBuffer, op: Any, writes: bool, site: str) -> None:
        if isinstance(op, str):
            shown = op
        else:
            base = op._schema.name.split("::")[-1]
            shown = _FRIENDLY.get(base, f"aten.{base}")
        if buffer.output:
            verb = "wrote to" if writes else "read"
            danger = "On a GPU the collective writes that buffer until wait() returns, so this " + (
                "races with it" if writes else "sees partial data"
            )
        else:
            verb = "wrote to"
            danger = (
                "On a GPU the collective reads that buffer until wait() returns, so the peers may "
                "receive the new values"
            )
        raise AsyncHazardError(
            f"{shown} at {site} {verb} {buffer.label} before its wait(): {buffer.what} was issued at "
            f"{buffer.site} and is still pending. {danger} (gloo usually finishes first, which hides it). "
            "Call wait() on the work handle before touching the buffer, or work on a clone."
        )

    # -- the mode --------------------------------------------------------------------

    def _arm(self) -> None:
        if self._mode is None:
            self._mode = _Mode(self)
            self._mode.__enter__()
            self._patch()

    def _disarm(self, *, force: bool = False) -> None:
        mode = self._mode
        if mode is None:
            return
        if _get_current_dispatch_mode() is mode:
            mode.__exit__(None, None, None)
        elif not force:
            return  # a mode of the program's is above ours: ours stays, inert, until it is on top
        self._mode = None
        self._unpatch()

    def _patch(self) -> None:
        """``print``, ``.tolist()`` and ``.numpy()`` read without dispatching an op: wrap them."""
        for name, label in (("__repr__", "print / repr()"), ("tolist", ".tolist()"), ("numpy", ".numpy()")):
            own = torch.Tensor.__dict__.get(name)
            self._patched[name] = own
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._reader(original, label))

    def _unpatch(self) -> None:
        for name, own in self._patched.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)
        self._patched = {}

    def _reader(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        guard = self

        @functools.wraps(original)
        def reader(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if guard.buffers and not depth():
                guard._touch(tensor, False, label, call_site(2))
            return original(tensor, *args, **kwargs)

        return reader

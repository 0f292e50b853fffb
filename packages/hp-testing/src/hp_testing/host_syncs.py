"""Count the host syncs a block of code would make on a GPU or NPU, while it runs on CPU.

A device->host read (``.item()``, ``bool(t)``, ``nonzero``, ``.tolist()``,
printing a tensor, ``.cpu()``, a stream or event ``synchronize``) stalls the
host until the device has run everything queued before it; inside a training
step that costs every step. On CPU nothing stalls, so these reads go unnoticed
until a GPU profile shows the gaps. ``count_host_syncs()`` records each one,
with the frames that made it ([Note: what counts as a host sync], [Note: seeing
the ops inside a tensor subclass]), so a test can assert that a hot path has
none: ``with count_host_syncs() as s: step(); assert s.count == 0, s.report()``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

__all__ = ["ALLOWED_BY_DEFAULT", "HostSync", "HostSyncLog", "count_host_syncs"]

aten = torch.ops.aten

# [Note: what counts as a host sync]
# Counted are the aten ops that, given a tensor on a device, must wait for the
# device and copy a result to the host before they can return:
#
# - a scalar read: ``_local_scalar_dense`` / ``item`` (``.item()``, ``float(t)``,
#   ``int(t)``), ``is_nonzero`` (``bool(t)``, ``if t:``), ``equal``, ``allclose``;
# - an output whose size depends on the data, which the host must know to
#   allocate it: ``nonzero`` (``argwhere``, ``where(cond)``), ``masked_select``,
#   indexing or index-assigning with a boolean mask (``x[mask]``,
#   ``x[mask] = v``), ``repeat_interleave`` with tensor repeats and no
#   ``output_size``, ``unique`` and its variants, ``bincount``;
#
# and the Python-level reads that dispatch no op on a CPU tensor: ``.tolist()``,
# ``.cpu()``, ``repr`` / ``print`` / ``str`` of a tensor, and hp_core's
# ``synchronize`` of the device handle, a CPU stream or a CPU event (no-ops on
# CPU, a full wait on a device). Ops on meta tensors read no data and are not
# counted. ``.to("cpu")`` is not counted: on CPU it is also how code moves a
# tensor to "its" device. Host->device copies (``torch.tensor(...,
# device=...)``) are not counted either.
#
# A read inside another read (printing calls ``tolist``; hp_dtensor's ``.item()``
# of a DTensor calls ``.item()`` of its local tensor) is one sync, counted once.
# Reads hp_testing makes for its own checks (the emulation layer, strict mode)
# are not the program's and are not counted.
_SCALAR_READS = {
    aten._local_scalar_dense.default: "reads a scalar to the host: .item(), float(), int() or bool()",
    aten.item.default: "reads a scalar to the host: .item(), float(), int() or bool()",
    aten.is_nonzero.default: "reads a truth value to the host",
    aten.equal.default: "reads the comparison to the host",
    aten.allclose.default: "reads the comparison to the host",
}
_DATA_SIZED = {
    aten.nonzero.default,
    aten.nonzero_numpy.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
}
_REPEATS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_MASK_INDEXED = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
}

#: Frames (``path/suffix.py:function``) whose reads are of tensors that live on the host even in
#: a device run, so they are not syncs: torch's non-capturable, non-fused optimizers keep each
#: parameter's ``step`` counter as a CPU tensor and read it with ``_get_value``.
ALLOWED_BY_DEFAULT: tuple[str, ...] = ("torch/optim/optimizer.py:_get_value",)


def _why(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why aten op ``func`` would wait for the device, or None when it would not."""
    why = _SCALAR_READS.get(func)
    if why is not None:
        return why
    if func in _DATA_SIZED:
        return "its output size depends on the data"
    if func in _REPEATS:
        if kwargs.get("output_size") is None:  # keyword-only in both overloads
            return "its output size depends on the repeats (pass output_size)"
        return None
    if func in _MASK_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        for index in indices or ():
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                return "a boolean mask index has a data-dependent size (it runs nonzero)"
    return None


def _reads_data(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether any tensor argument holds data (meta tensors hold none)."""
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor) and item.device.type != "meta":
                return True
    return False


@functools.cache
def _skipped_dirs() -> tuple[str, str]:
    """torch's and hp_testing's own directories: the cause is the first frame outside them."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    return (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, here)


#: Directories of the test runner and of a rank process's start, where the report's stack ends.
_RUNNERS = tuple(f"{os.sep}{name}{os.sep}" for name in ("_pytest", "pluggy", "multiprocessing"))


def _short(filename: str) -> str:
    """``hp_dtensor/ops/dispatch.py`` for a package's file, the last two parts otherwise."""
    parts = filename.replace(os.sep, "/").split("/")
    for marker in ("src", "site-packages"):
        if marker in parts[:-1]:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(marker) + 1 :])
    return "/".join(parts[-2:])


@dataclass(frozen=True)
class HostSync:
    """One host sync: what read the device, why it waits, and the frames that made it.

    ``stack`` lists the frames outside torch and hp_testing, innermost first, as
    ``file:line in function``; ``site`` is the first of them (the line to fix).
    """

    what: str
    why: str
    stack: tuple[str, ...]

    @property
    def site(self) -> str:
        return self.stack[0] if self.stack else "<unknown>"


class HostSyncLog:
    """The host syncs recorded by :func:`count_host_syncs`, in order."""

    def __init__(self, allow: tuple[str, ...]) -> None:
        self.syncs: list[HostSync] = []
        #: Reads from an allowed frame (host-resident tensors), kept apart so a report can show them.
        self.allowed: list[HostSync] = []
        self.allow = allow

    @property
    def count(self) -> int:
        """How many host syncs the block made."""
        return len(self.syncs)

    def counts(self) -> Counter[str]:
        """``what`` -> how many times."""
        return Counter(s.what for s in self.syncs)

    def sites(self) -> Counter[str]:
        """``what at site`` -> how many times: one line per distinct sync, for a report."""
        return Counter(f"{s.what} at {s.site}" for s in self.syncs)

    def report(self, frames: int = 5) -> str:
        """The syncs, each distinct one once: its count, why, and up to ``frames`` callers."""
        if not self.syncs:
            return "no host syncs"
        seen: dict[tuple[str, str], tuple[HostSync, int]] = {}
        for sync in self.syncs:
            key = (sync.what, sync.site)
            first, n = seen.get(key, (sync, 0))
            seen[key] = (first, n + 1)
        lines = [f"{self.count} host sync(s), each of which would stall a GPU/NPU stream:"]
        for sync, n in seen.values():
            lines.append(f"  {n} x {sync.what} ({sync.why}) at {sync.site}")
            outer = list(sync.stack[1:])
            if len(outer) > frames:  # the nearest callers, then the outermost (the program's line)
                outer = [*outer[: frames - 2], "...", *outer[-2:]]
            lines.extend(f"      called from {frame}" if frame != "..." else "      ..." for frame in outer)
        return "\n".join(lines)

    def _add(self, what: str, why: str) -> None:
        caller = sys._getframe(2)  # the frame that called the op or the read
        if _by_the_harness(caller):
            return
        (self.allowed if self._allowed(caller) else self.syncs).append(HostSync(what, why, _stack(caller)))

    def _allowed(self, frame: Any) -> bool:
        if not self.allow:
            return False
        while frame is not None:
            key = f"{frame.f_code.co_filename.replace(os.sep, '/')}:{frame.f_code.co_name}"
            if any(key.endswith(pattern) for pattern in self.allow):
                return True
            frame = frame.f_back
        return False


def _by_the_harness(frame: Any) -> bool:
    """Whether the first frame outside torch is hp_testing's own (the emulation layer's checks).

    Its checks (strict mode compares input snapshots at a work handle's
    ``wait()``, the emulation layer clones and compares) run inside the
    program's calls, from hp_testing's frames. Another hp_testing dispatch mode
    (the strict read guard) passing the program's op down is not such a frame.
    """
    torch_dir, own_dir = _skipped_dirs()
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(own_dir):
            if frame.f_code.co_name != "__torch_dispatch__":
                return True
            # another hp_testing mode (the strict read guard) passing the program's op down
        elif not filename.startswith(torch_dir) and not filename.startswith("<"):
            return False
        frame = frame.f_back
    return False


def _stack(frame: Any, limit: int = 12) -> tuple[str, ...]:
    """The frames from ``frame`` outwards outside torch and hp_testing, up to the test runner's."""
    skip = _skipped_dirs()
    frames: list[str] = []
    while frame is not None and len(frames) < limit:
        filename = frame.f_code.co_filename
        if any(runner in filename for runner in _RUNNERS):
            break  # the test runner's frames say nothing about the program
        if not filename.startswith(skip) and not filename.startswith("<"):
            frames.append(f"{_short(filename)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(frames)


class _Reading(threading.local):
    """Per thread: how many counted reads are open (a read inside a read is not counted again)."""

    depth = 0


_READING = _Reading()


# [Note: seeing the ops inside a tensor subclass]
# A dispatch mode is popped while its ``__torch_dispatch__`` runs, so a mode
# that calls ``func(*args)`` for a DTensor never sees the plain-tensor ops
# DTensor's ``__torch_dispatch__`` runs on the local shards: exactly where a
# sharding rule could read a shard to the host. The mode therefore answers
# ``NotImplemented`` for any op with an argument whose type has its own
# ``__torch_dispatch__``; torch then calls the subclass's ``__torch_dispatch__`` with the mode
# back on the stack, and every op it runs reaches the mode again. Only ops on
# plain tensors are judged: they are what the device would run, and a read of
# a DTensor is counted once, at the local read it turns into. The backward runs
# under the mode too (on CPU the autograd engine runs it on the calling thread,
# with this thread's modes).
_PLAIN = torch._C._disabled_torch_dispatch_impl  # the __torch_dispatch__ of Tensor and Parameter


class _Mode(TorchDispatchMode):
    """Records every aten op of this thread that would wait for the device."""

    def __init__(self, log: HostSyncLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for kind in types:
            if kind.__torch_dispatch__ is not _PLAIN:
                return NotImplemented  # [Note: seeing the ops inside a tensor subclass]
        kwargs = kwargs or {}
        if not _READING.depth:
            why = _why(func, args, kwargs)
            if why is not None and _reads_data(args, kwargs):
                self.log._add(f"aten.{func._schema.name.split('::')[-1]}", why)
        return func(*args, **kwargs)


#: The logs of the open ``count_host_syncs`` blocks, outermost first; a read goes to each.
_OPEN: list[HostSyncLog] = []


def _reader(original: Callable[..., Any], what: str, why: str) -> Callable[..., Any]:
    """``original`` wrapped to record one sync per outermost call ([Note: what counts as a host sync])."""

    @functools.wraps(original)
    def read(*args: Any, **kwargs: Any) -> Any:
        if not _READING.depth:
            for log in _OPEN:
                log._add(what, why)
        _READING.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _READING.depth -= 1

    return read


def _python_reads() -> list[tuple[Any, str, str, str]]:
    """(owner, attribute, shown name, why) of the reads made without an aten op on CPU."""
    from hp_core.device import CpuEvent, CpuStream, DeviceHandle

    copy = "copies the tensor to the host"
    wait = "waits for the device"
    return [
        (torch.Tensor, "tolist", ".tolist()", copy),
        (torch.Tensor, "cpu", ".cpu()", copy),
        (torch.Tensor, "__repr__", "print / repr()", copy),
        (DeviceHandle, "synchronize", "DeviceHandle.synchronize()", wait),
        (CpuStream, "synchronize", "stream.synchronize()", wait),
        (CpuEvent, "synchronize", "event.synchronize()", wait),
    ]


@contextlib.contextmanager
def count_host_syncs(*, allow: Iterable[str] = ()) -> Iterator[HostSyncLog]:
    """Record the host syncs this thread makes in the block ([Note: what counts as a host sync]).

    ``allow`` adds ``path/suffix.py:function`` frames to :data:`ALLOWED_BY_DEFAULT`: a read
    with such a frame on its stack goes to ``log.allowed`` instead of ``log.syncs``. For
    reads that are no device sync (a tensor that stays on the host in a device run too, a
    check that runs only where the data is on the CPU) or that a design accepts, each with
    its reason beside the pattern. Only this thread is seen
    (the backward included); the patched Python reads are process-wide while the block
    runs, so use it from one thread at a time.
    """
    if isinstance(allow, str):
        raise TypeError(
            f"count_host_syncs(allow=...) takes a list of 'path/file.py:function' patterns, got the "
            f"string {allow!r}; pass ({allow!r},)."
        )
    log = HostSyncLog(ALLOWED_BY_DEFAULT + tuple(allow))
    if not _OPEN:
        _patch()
    _OPEN.append(log)
    mode = _Mode(log)
    mode.__enter__()
    try:
        yield log
    finally:
        _leave(mode)
        _OPEN.remove(log)
        if not _OPEN:
            _unpatch()


def _leave(mode: _Mode) -> None:
    """Pop ``mode`` even when a mode pushed inside the block is still above it.

    The strict read guard pushes its mode at the first async call and keeps it
    until the test ends; a plain ``__exit__`` pops whichever mode is on top,
    which would take the guard's off and leave this one counting.
    """
    above = []
    while _get_current_dispatch_mode_stack() and _get_current_dispatch_mode() is not mode:
        above.append(_pop_mode())
    if _get_current_dispatch_mode() is mode:
        mode.__exit__(None, None, None)
    for other in reversed(above):
        _push_mode(other)


#: (owner, attribute, what the owner's own __dict__ held) of each patched read, to undo.
_PATCHED: list[tuple[Any, str, Any]] = []


def _patch() -> None:
    """Wrap the reads that dispatch no aten op on CPU, for as long as a block is open."""
    for owner, name, what, why in _python_reads():
        _PATCHED.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, _reader(getattr(owner, name), what, why))


def _unpatch() -> None:
    while _PATCHED:
        owner, name, own = _PATCHED.pop()
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)

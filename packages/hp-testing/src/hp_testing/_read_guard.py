"""Strict mode: touching a pending async collective's buffers raises at the touch, naming both sites.

While strict mode has async work pending on this rank, a ``TorchDispatchMode``
compares the byte range of every aten op's tensor arguments with the pending
buffers: any touch of a pending output, or a write to a pending input, raises
([Note: catching a read before wait()] on :class:`ReadGuard`). The per-op
check is the whole cost of strict mode ([Note: the read guard's fast path]);
how it keeps out of torch.compile's way is [Note: the guard and torch.compile].
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import DispatchKey
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
)

from hp_testing._calls import call_site
from hp_testing._hazards import AsyncHazardError
from hp_testing._nesting import STATE

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


#: ``id(op)`` -> (op, reads no data, positions written, keyword arguments written); see [Note: the
#: read guard's fast path]. The op itself is kept in the value, so its id is never reused.
_OP_INFO: dict[int, tuple[Any, bool, frozenset[int], frozenset[str]]] = {}


def _op_info(func: Any) -> tuple[Any, bool, frozenset[int], frozenset[str]]:
    """(op, reads no data, positions written, keyword arguments written) of an aten overload."""
    info = _OP_INFO.get(id(func))
    if info is not None:
        return info
    schema = func._schema
    base = schema.name.split("::")[-1]
    positions: set[int] = set()
    names: set[str] = set()
    reads_nothing = bool(getattr(func, "is_view", False)) or base in _METADATA_OPS
    if not reads_nothing:
        for index, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                positions.add(index)
                names.add(argument.name)
    info = (func, reads_nothing, frozenset(positions), frozenset(names))
    _OP_INFO[id(func)] = info
    return info


#: One watched range: (start, end, buffer).
_Range = tuple[int, int, PendingBuffer]


# [Note: the guard and torch.compile]
# Without torch's ``_disable_dynamo`` wrapper, an eager op run while a compiled
# function is on the stack (between two graphs of a graph break) reached
# ``__torch_dispatch__`` with dynamo's frame hook still set, and dynamo compiled
# the guard's own frames (``inspect``, ``_extent``), once per tensor rank, until
# its recompile limit ("torch._dynamo hit config.recompile_limit ... function:
# '_extent'" in hp-pipeline's compiled tests under strict mode): seconds per
# test, spent tracing the harness. Instead of the wrapper (a Python call and two
# eval-frame switches per op), the code objects of ``__torch_dispatch__`` and of
# the print/tolist wrapper are marked once with dynamo's frame strategy "skip
# this frame and every frame it calls", a flag on the code object that the C
# frame hook reads at no cost per op. The flag covers the frames re-entered from
# C++ below it too (a tensor subclass's ``__torch_dispatch__`` reached through
# ``func._op``).
#
# The mode also says ``ignore_compile_internals() -> True``. With the default,
# dynamo declines any frame it meets while a user dispatch mode is pushed
# ("non-infra torch dispatch mode present") and runs it eagerly with its frame
# hook still set, and it remembers that for the code object. Strict mode then
# pushed the mode only while a collective was pending, so a compiled block entered
# then (an FSDP prefetch still in flight) was not compiled; once a hook inside it
# waited the last collective and popped the mode, the next DTensor op entered
# hp-dtensor's ``__torch_dispatch__`` from C++ with the hook set and no mode
# above it, and dynamo compiled that frame on its own. Its resume frame after
# ``_make_wrapper_subclass`` received the half-built wrapper and failed in
# ``__tensor_flatten__`` ("'DTensor' object has no attribute '_layout'"), a
# failure strict mode alone created (fsdp-nested-tp-zbv-fp32-noac-compiled in
# the composition matrix, both emulated backends). Ignoring compile internals is
# what torch's selective-checkpoint modes declare: dynamo traces as if the mode
# were absent (it takes the modes off while compiling), so strict mode compiles
# the same graphs as a plain run, and the compiled code runs under the mode,
# whose checks still see the aten ops a graph runs (the eager and aot_eager
# backends; inductor's generated kernels are not aten ops and go unseen). The
# method is read when the mode is pushed and when dynamo meets a frame, never
# per op.
class _Mode(TorchDispatchMode):
    """The dispatch mode that routes every aten op of this thread through :meth:`ReadGuard.inspect`."""

    def __init__(self, guard: ReadGuard) -> None:
        super().__init__()
        self.guard = guard

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # see the module docstring: no _disable_dynamo wrapper per op

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: strict mode must not change what dynamo compiles ([Note: the guard and torch.compile]).

        With the default (False) dynamo declines every frame it meets while the
        mode is pushed and runs it eagerly with its frame hook still set, so a
        tensor subclass's ``__torch_dispatch__`` reached from such a frame after
        the mode was popped is compiled on its own. True is what torch's own
        selective-checkpoint modes say: dynamo compiles as if the mode were
        absent (it takes the modes off while tracing) and the compiled code
        runs under it. Read when the mode is pushed and when dynamo meets a
        frame, never per op.
        """
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.guard.buffers and not STATE.depth:
            self.guard.inspect(func, args, kwargs)
        if kwargs:
            return func._op(*args, **kwargs)
        return func._op(*args)


# [Note: catching a read before wait()]
# On a GPU an async collective (or ``irecv``) writes its output until
# ``wait()`` returns and reads its input until then. A program that reads the
# output early (``.item()``, ``print``, ``.tolist()``, any op) sees partial
# data, and one that writes the input early corrupts what the peers receive.
# gloo on a CPU usually finishes first, so the race stays invisible there.
#
# While strict mode has async work pending on this rank, a
# ``TorchDispatchMode`` sees every aten op the rank's thread runs and compares
# the byte range of each tensor argument (``data_ptr`` to the end of its
# strided extent) with the ranges of the pending buffers:
#
# - any op that touches a pending *output* (an all-reduce's tensor, an
#   all-gather's output, an ``irecv`` buffer) raises, reading or writing;
# - an op that *writes* (its schema marks the argument mutable) to a pending
#   *input* (a reduce-scatter's input, an ``isend`` buffer) raises.
#
# View and metadata ops (``view``, slicing, ``split``, ``detach``,
# ``empty_like``, ...) read no data and pass. ``print`` and ``.tolist()`` read
# without dispatching an op (torch's printing switches dispatch modes off), so
# ``Tensor.__repr__``, ``tolist`` and ``numpy`` are wrapped for as long as the
# mode is on. The layer's own work (input snapshots, the check at ``wait()``,
# gloo's threads) runs nested or on other threads and is not seen
# ([Note: one call through the layer]).
#
# The cost is paid only in strict mode, from a test's first async call on: the
# mode is pushed when the first async call is issued and stays on, inert while
# nothing is pending (one attribute test per op), until the test or script ends
# ([Note: the mode stays on until the test ends]). A dispatch mode the program
# pushes later sits above ours, which sees the ops that mode passes down.
# Writes that escape the mode (another thread, a buffer protocol) to an input
# are still found at ``wait()`` by the snapshots of :mod:`hp_testing._hazards`;
# reads that escape it are not caught ([Note: why outputs are not shadowed]).
#
# ``__torch_dispatch__`` is not wrapped in ``torch._disable_dynamo`` (as torch
# does by default for a mode): that wrapper costs more per op than the check
# itself, and the mode is never compiled (it is pushed and popped in eager code).
class ReadGuard:
    """This rank's pending buffers and the mode that watches them ([Note: catching a read before wait()])."""

    def __init__(self) -> None:
        self.buffers: list[PendingBuffer] = []
        self._by_token: dict[int, list[PendingBuffer]] = {}
        # [Note: the read guard's fast path]: laid out at add/remove, read per op.
        self._outputs: tuple[_Range, ...] = ()
        self._outputs_end = 0
        self._all: tuple[_Range, ...] = ()
        self._all_end = 0
        self._mode: _Mode | None = None
        self._patched: dict[str, Any] = {}
        self._warm = False
        self._dynamo_told = False

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
        self._lay_out()
        if not self._dynamo_told:
            self._skip_dynamo()
        self._arm()

    def remove(self, token: int) -> None:
        """The call of ``token`` was waited: its buffers are the program's again."""
        if self._by_token.pop(token, None) is None:
            return
        self._lay_out()  # the mode stays on, inert ([Note: the mode stays on until the test ends])

    def _lay_out(self) -> None:
        """Recompute what :meth:`inspect` reads per op from the pending buffers."""
        self.buffers = [b for group in self._by_token.values() for b in group]
        self._all = tuple((b.start, b.end, b) for b in self.buffers)
        self._outputs = tuple(r for r in self._all if r[2].output)
        self._all_end = max((r[1] for r in self._all), default=0)
        self._outputs_end = max((r[1] for r in self._outputs), default=0)

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
        self._skip_dynamo()
        with _Mode(self):
            torch.zeros(1).add_(0)

    def _skip_dynamo(self) -> None:
        """Tell torch.compile never to trace the guard's frames ([Note: the guard and torch.compile]).

        Only once ``torch._dynamo`` is loaded (by the program): importing it
        here would cost seconds, and without it nothing compiles.
        """
        if "torch._dynamo" not in sys.modules:
            return
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # this frame and all it calls
        reader = self._reader(lambda tensor: None, "")
        for code in (_Mode.__torch_dispatch__.__code__, reader.__code__):
            set_code_exec_strategy(code, skip)
        self._dynamo_told = True

    # [Note: the mode stays on until the test ends]
    # torch's compiled-call wrapper restores on exit the dispatch-key include set it
    # saw on entry. When the mode popped as the last pending call was waited, a call
    # entered with work pending and left with none kept the Python keys on with no
    # mode, and the next op failed inside torch ("Hit Python dispatch key but no
    # arguments had PyInterpreter"). So the mode is not popped when nothing is
    # pending: it stays, inert, until :meth:`ReadGuard.clear` at the end of the test
    # or script, which runs outside any compiled call. The other direction (the mode
    # pushed inside a compiled call that was entered without it) leaves the keys off
    # at the call's exit; each later async call turns them back on (``_arm``), so
    # only reads between that exit and the program's next async call go unseen.
    # Both are tested in ``test_read_guard_ranges.py``.
    def clear(self) -> None:
        """End of a test (or script): forget everything and take the mode off."""
        self._by_token.clear()
        self._lay_out()
        self._disarm()

    # -- checks ----------------------------------------------------------------------

    def check_passed(self, tensors: list[tuple[str, torch.Tensor, bool]], what: str) -> None:
        """A new call ``what`` takes ``tensors`` (label, tensor, is-output): none may be a pending buffer."""
        if not self.buffers:
            return
        for label, tensor, output in tensors:
            self._touch(tensor, output, f"{what} (its {label})")

    # [Note: the read guard's fast path]
    # In an FSDP-like step some collective is pending during nearly every op, so
    # the per-op check is the whole cost of strict mode. What it does per op:
    #
    # - the op's facts (reads no data / which arguments it writes) are looked up by
    #   ``id(func)`` in a plain dict: aten overloads live as long as the process,
    #   and hashing an ``OpOverload`` runs a Python ``__hash__``;
    # - the ranges are laid out when work is posted or waited, not per op: the
    #   outputs' ranges (any touch counts) and all ranges (for arguments the op
    #   writes), each with the highest end address among them;
    # - an argument costs one ``data_ptr()`` call in the common case: torch strides
    #   are never negative, so a tensor covers bytes from ``data_ptr()`` upwards, and
    #   one that starts at or above a buffer's end cannot touch it. Only a tensor
    #   that starts below a buffer needs its extent (size, strides), and only one
    #   that overlaps needs the call site (a stack walk, made when raising);
    # - the nesting depth is one attribute load (:data:`hp_testing._nesting.STATE`),
    #   and the op itself is called through ``func._op``, skipping a Python frame.
    def inspect(self, func: Any, args: Any, kwargs: dict[str, Any] | None) -> None:
        """Raise if aten op ``func`` touches a pending output or writes a pending input.

        The hot path of strict mode: see [Note: the read guard's fast path].
        """
        info = _OP_INFO.get(id(func)) or _op_info(func)
        if info[1]:
            return  # views and metadata read no data
        positions = info[2]
        if not positions and not self._outputs:
            return  # a pure read, and only inputs are pending: reading those is fine
        tensor_type = torch.Tensor
        for index, value in enumerate(args):
            if isinstance(value, tensor_type):
                self._touch(value, index in positions, func)
            elif isinstance(value, (list, tuple)):
                writes = index in positions
                for item in value:
                    if isinstance(item, tensor_type):
                        self._touch(item, writes, func)
        if kwargs:
            names = info[3]
            for name, value in kwargs.items():
                if isinstance(value, tensor_type):
                    self._touch(value, name in names, func)
                elif isinstance(value, (list, tuple)):
                    for item in value:
                        if isinstance(item, tensor_type):
                            self._touch(item, name in names, func)

    def _touch(self, tensor: torch.Tensor, writes: bool, op: Any) -> None:
        """Raise if ``tensor`` overlaps a pending output (or, when ``writes``, any pending buffer)."""
        if writes:
            ranges, top = self._all, self._all_end
        else:
            ranges, top = self._outputs, self._outputs_end
        try:
            start = tensor.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # no plain storage (fake, meta, wrapper subclasses)
        if start >= top or start == 0:
            return  # starts above every buffer: torch strides are never negative
        end = -1
        for low, high, buffer in ranges:
            if start >= high:
                continue
            if start < low:  # starts below this buffer: does it reach into it?
                if end < 0:
                    if tensor.is_contiguous():
                        end = start + tensor.nbytes  # two calls; _extent makes a device object too
                    else:
                        extent = _extent(tensor)
                        if extent is None:
                            return
                        end = extent[1]
                if end <= low:
                    continue
            elif tensor.numel() == 0:
                return  # an empty tensor at the buffer's address touches nothing
            self._raise(buffer, op, writes)

    def _raise(self, buffer: PendingBuffer, op: Any, writes: bool) -> None:
        site = call_site(2)  # walks out of torch and hp_testing to the program's line
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
        elif self._mode in _get_current_dispatch_mode_stack():
            # A compiled call entered before the mode was pushed restored, on exit, the keys
            # it saw then: with the mode still on the stack, turn them back on.
            for key in (DispatchKey.Python, DispatchKey.PythonTLSSnapshot):
                torch._C._dispatch_tls_set_dispatch_key_included(key, True)

    def _disarm(self) -> None:
        mode = self._mode
        if mode is None:
            return
        if _get_current_dispatch_mode() is mode:
            mode.__exit__(None, None, None)
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
            if guard.buffers and not STATE.depth:
                guard._touch(tensor, False, label)
            return original(tensor, *args, **kwargs)

        return reader

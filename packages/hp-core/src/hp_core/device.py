"""The device handle: one object that answers every per-device question.

Library code never calls ``torch.cuda`` (or ``torch.npu``) directly. It asks the
handle that the platform seam (:mod:`hp_core.platform`) hands out, so the same
code runs on CUDA, Ascend NPUs, Intel XPUs and plain CPUs, and so tests can swap
in a CPU handle while the platform *reports* an accelerator (NCCL/HCCL
emulation).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CpuEvent",
    "CpuStream",
    "DeviceHandle",
    "EventLike",
    "StreamLike",
    "local_rank_from_env",
]


def local_rank_from_env(default: int = 0) -> int:
    """Return ``LOCAL_RANK`` as set by torchrun (or ``default`` when unset).

    The local rank picks the accelerator a process drives; reading it in one
    place keeps the parsing (and its error message) consistent.
    """
    raw = os.environ.get("LOCAL_RANK")
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"LOCAL_RANK={raw!r} is not an integer; torchrun sets it to the process's "
            "index on its node. Unset it or set it to a non-negative integer."
        ) from None
    if value < 0:
        raise ValueError(f"LOCAL_RANK={value} is negative; set it to a non-negative integer.")
    return value


@runtime_checkable
class EventLike(Protocol):
    """What library code may call on an event (``torch.cuda.Event`` or :class:`CpuEvent`)."""

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


@runtime_checkable
class StreamLike(Protocol):
    """What library code may call on a stream (``torch.cuda.Stream`` or :class:`CpuStream`)."""

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> Any: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


# [Note: CPU streams and events]
# CPU kernels run synchronously on the calling thread, so a stream has nothing
# to order and an event has nothing to wait for. The CPU classes below keep the
# CUDA interface (``wait_stream``, ``record_event``, ``query``, ``synchronize``,
# ``elapsed_time``, use as a context manager) so overlap code written for GPUs
# runs unchanged; every wait returns at once and every query answers ``True``.
# Events created with ``enable_timing=True`` record the host clock, so
# ``elapsed_time`` reports the real wall time between two records.
class CpuEvent:
    """An event with the CUDA event interface for CPU work (see [Note: CPU streams and events]).

    ``elapsed_time`` needs both events created with ``enable_timing=True`` and
    recorded, like its CUDA counterpart, so code that forgets either fails here
    too instead of only on a GPU.
    """

    __slots__ = ("_enable_timing", "_recorded_ns")

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        # ``blocking`` and ``interprocess`` are accepted for signature parity and
        # mean nothing on a CPU, where everything already blocks.
        del blocking, interprocess
        self._enable_timing = bool(enable_timing)
        self._recorded_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        """Mark this point of the (synchronous) host timeline."""
        del stream
        self._recorded_ns = time.perf_counter_ns()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for: the recorded work has already run."""
        del stream

    def query(self) -> bool:
        """Always ``True``: CPU work is complete when the call returns."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for; kept for interface parity."""

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds between this event's record and ``end_event``'s."""
        if not isinstance(end_event, CpuEvent):
            raise TypeError(
                f"elapsed_time expects another CpuEvent, got {type(end_event).__name__}; "
                "create both events with the same device handle."
            )
        if not (self._enable_timing and end_event._enable_timing):
            raise ValueError(
                "elapsed_time needs both events created with enable_timing=True "
                f"(start: {self._enable_timing}, end: {end_event._enable_timing}); "
                "pass enable_timing=True to new_event()."
            )
        if self._recorded_ns is None or end_event._recorded_ns is None:
            raise ValueError(
                "elapsed_time needs both events recorded "
                f"(start recorded: {self._recorded_ns is not None}, "
                f"end recorded: {end_event._recorded_ns is not None}); call record() on each first."
            )
        return (end_event._recorded_ns - self._recorded_ns) / 1e6

    def __repr__(self) -> str:
        return f"CpuEvent(enable_timing={self._enable_timing}, recorded={self._recorded_ns is not None})"


class CpuStream:
    """A stream with the CUDA stream interface for CPU work (see [Note: CPU streams and events]).

    It is also a context manager, like ``torch.cuda.Stream``, so
    ``with stream:`` blocks written for GPUs keep working.
    """

    __slots__ = ("priority",)

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    @property
    def device(self) -> torch.device:
        """The device this stream orders work on: always the CPU."""
        return torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        """No-op: the other stream's work has already run."""
        del stream

    def wait_event(self, event: Any) -> None:
        """No-op: the event's work has already run."""
        del event

    def record_event(self, event: Any = None) -> CpuEvent:
        """Record ``event`` (or a new one) now and return it, as CUDA streams do."""
        if event is None:
            event = CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        """Always ``True``: nothing is ever pending on a CPU stream."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for; kept for interface parity."""

    def __enter__(self) -> CpuStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def __repr__(self) -> str:
        return f"CpuStream(priority={self.priority})"


# One default stream per process, so ``current_stream() is default_stream()``
# holds on CPU as it does on CUDA before any stream switch.
_CPU_DEFAULT_STREAM = CpuStream()


# [Note: two device types]
# A handle carries two device types. ``device_type`` is what library code
# branches on ("cuda" means "expect NCCL semantics"); ``tensor_device_type`` is
# the torch device that tensors actually live on. They are equal on real
# hardware. Under emulation they differ ("cuda" vs "cpu"), and every method here
# acts on ``tensor_device_type`` because that is where the memory and the
# streams really are.
@dataclass(frozen=True)
class DeviceHandle:
    """Current device, streams, events, synchronisation and memory statistics.

    Obtain it from ``get_platform().handle``; construct it directly only in
    tests. See [Note: two device types] for the two fields.
    """

    device_type: str
    tensor_device_type: str

    @property
    def is_accelerator(self) -> bool:
        """Whether tensors live on an accelerator (so streams and memory stats are real)."""
        return self.tensor_device_type != "cpu"

    def _module(self) -> ModuleType:
        # torch.get_device_module finds torch.cuda, torch.xpu, and torch.npu once
        # torch_npu has registered it; asking lazily keeps imports free of work.
        return torch.get_device_module(self.tensor_device_type)

    # -- devices -----------------------------------------------------------

    def device_count(self) -> int:
        """How many devices of ``tensor_device_type`` this process can see (1 for the CPU)."""
        if not self.is_accelerator:
            return 1
        return int(self._module().device_count())

    def current_device(self) -> torch.device:
        """The device new tensors of this platform should be created on."""
        if not self.is_accelerator:
            return torch.device("cpu")
        return torch.device(self.tensor_device_type, int(self._module().current_device()))

    def local_device(self, local_rank: int | None = None) -> torch.device:
        """The device a process with ``local_rank`` (default: ``LOCAL_RANK``) should drive.

        torchrun starts one process per device and numbers them on each node
        with ``LOCAL_RANK``; that index is the device index.
        """
        if not self.is_accelerator:
            return torch.device("cpu")
        index = local_rank_from_env() if local_rank is None else local_rank
        count = self.device_count()
        if not 0 <= index < count:
            raise ValueError(
                f"local rank {index} has no {self.tensor_device_type} device: this process sees "
                f"{count} device(s). Start at most {count} processes per node, or set "
                "CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES to expose more."
            )
        return torch.device(self.tensor_device_type, index)

    def set_device(self, device: int | str | torch.device | None = None) -> torch.device:
        """Make ``device`` (default: the ``LOCAL_RANK`` device) current; a no-op on CPU.

        Returns the device now current, so callers can create tensors on it.
        """
        if not self.is_accelerator:
            return torch.device("cpu")
        if device is None:
            target = self.local_device()
        elif isinstance(device, int):
            target = self.local_device(device)
        else:
            target = torch.device(device)
            if target.type != self.tensor_device_type:
                raise ValueError(
                    f"set_device got {target}, but this handle drives {self.tensor_device_type!r} "
                    f"devices; pass an index or a '{self.tensor_device_type}:N' device."
                )
        self._module().set_device(target)
        return target

    def synchronize(self, device: int | torch.device | None = None) -> None:
        """Wait for all queued work on ``device`` (default: current); a no-op on CPU."""
        if self.is_accelerator:
            self._module().synchronize(device)

    # -- streams and events ------------------------------------------------

    def new_stream(self, priority: int = 0, *, device: torch.device | int | None = None) -> StreamLike:
        """A new stream (``torch.<device>.Stream`` or a :class:`CpuStream`).

        ``device``: the accelerator the stream belongs to (default: the current
        one). A stream must live on the device of the tensors whose work it
        orders, e.g. a side stream for a collective on a device that is not the
        current one; passing it avoids switching the current device to create it.
        """
        if not self.is_accelerator:
            return CpuStream(priority)
        if device is None:
            stream: StreamLike = self._module().Stream(priority=priority)
        else:
            stream = self._module().Stream(device=device, priority=priority)
        return stream

    def current_stream(self) -> StreamLike:
        """The stream work is queued on now."""
        if not self.is_accelerator:
            return _CPU_DEFAULT_STREAM
        stream: StreamLike = self._module().current_stream()
        return stream

    def default_stream(self) -> StreamLike:
        """The device's default stream."""
        if not self.is_accelerator:
            return _CPU_DEFAULT_STREAM
        stream: StreamLike = self._module().default_stream()
        return stream

    @contextmanager
    def stream(self, stream: StreamLike | None) -> Iterator[StreamLike | None]:
        """Queue the enclosed work on ``stream`` (``None`` leaves the current one)."""
        if not self.is_accelerator or stream is None:
            yield stream
            return
        with self._module().stream(stream):
            yield stream

    def new_event(self, enable_timing: bool = False) -> EventLike:
        """A new event (``torch.<device>.Event`` or a :class:`CpuEvent`)."""
        if not self.is_accelerator:
            return CpuEvent(enable_timing=enable_timing)
        event: EventLike = self._module().Event(enable_timing=enable_timing)
        return event

    # -- memory ------------------------------------------------------------
    # [Note: CPU memory statistics]
    # PyTorch's CPU allocator keeps no per-process counters, so on CPU these
    # return 0 rather than a process-wide RSS figure that would mix in Python
    # objects and other libraries. Tests that compare memory use must run on an
    # accelerator, or measure tensor sizes themselves.

    def memory_allocated(self, device: int | torch.device | None = None) -> int:
        """Bytes currently held by tensors on ``device``; 0 on CPU (see [Note: CPU memory statistics])."""
        if not self.is_accelerator:
            return 0
        return int(self._module().memory_allocated(device))

    def max_memory_allocated(self, device: int | torch.device | None = None) -> int:
        """Peak bytes held by tensors since the last reset; 0 on CPU."""
        if not self.is_accelerator:
            return 0
        return int(self._module().max_memory_allocated(device))

    def memory_reserved(self, device: int | torch.device | None = None) -> int:
        """Bytes the caching allocator holds (allocated plus cached); 0 on CPU."""
        if not self.is_accelerator:
            return 0
        return int(self._module().memory_reserved(device))

    def reset_peak_memory_stats(self, device: int | torch.device | None = None) -> None:
        """Restart the peak that :meth:`max_memory_allocated` reports; a no-op on CPU."""
        if self.is_accelerator:
            self._module().reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the device; a no-op on CPU."""
        if self.is_accelerator:
            self._module().empty_cache()

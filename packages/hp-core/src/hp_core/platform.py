"""The platform seam: which device we run on and which backend talks between ranks.

Every package asks :func:`get_platform` instead of writing ``"cuda"`` or
``"nccl"``. Resolution happens on each call, never at import, so importing
hp_core on a login node, inside a test or under emulation costs nothing and
sees the environment of the moment.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hp_core.device import DeviceHandle

__all__ = [
    "DEFAULT_BACKENDS",
    "ENV_BACKEND",
    "ENV_DEVICE_TYPE",
    "Platform",
    "PlatformError",
    "backend_for",
    "detect_device_type",
    "get_platform",
    "is_device_available",
    "set_platform",
    "use_platform",
]

ENV_DEVICE_TYPE = "HP_DEVICE_TYPE"
ENV_BACKEND = "HP_BACKEND"

#: The communication backend each device type uses unless overridden.
DEFAULT_BACKENDS: dict[str, str] = {
    "cuda": "nccl",
    "npu": "hccl",
    "xpu": "xccl",
    "cpu": "gloo",
}

# Auto-detection tries accelerators in this order; cpu always succeeds.
_DETECTION_ORDER = ("cuda", "npu", "xpu")


class PlatformError(RuntimeError):
    """A device type or backend that cannot be used here; the message says why and what to do."""


@dataclass(frozen=True)
class Platform:
    """Where this process computes and how it communicates.

    ``device_type`` is what library code branches on; ``tensor_device_type``
    is the torch device tensors live on (they differ only under emulation, see
    [Note: two device types] in :mod:`hp_core.device`). ``handle`` answers
    per-device questions (current device, streams, events, memory).
    """

    device_type: str
    backend: str
    tensor_device_type: str = ""
    handle: DeviceHandle = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("device_type", "backend", "tensor_device_type"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Platform.{name} must be a str, got {type(value).__name__} ({value!r}).")
        if not self.device_type or ":" in self.device_type:
            raise PlatformError(
                f"Platform.device_type={self.device_type!r} must be a bare device type such as "
                "'cuda' or 'cpu' (no index); device indices come from LOCAL_RANK."
            )
        if not self.backend:
            raise PlatformError(
                "Platform.backend is empty; name a torch.distributed backend such as "
                f"{sorted(set(DEFAULT_BACKENDS.values()))}."
            )
        if not self.tensor_device_type:
            object.__setattr__(self, "tensor_device_type", self.device_type)
        object.__setattr__(self, "handle", DeviceHandle(self.device_type, self.tensor_device_type))

    @property
    def emulated(self) -> bool:
        """Whether the platform reports a device type its tensors do not live on."""
        return self.device_type != self.tensor_device_type

    def device(self) -> torch.device:
        """The device tensors of this process should be created on (current device)."""
        return self.handle.current_device()


def backend_for(device_type: str) -> str:
    """The default communication backend of ``device_type`` (no availability check).

    Useful to describe a configuration without being on that hardware.
    """
    try:
        return DEFAULT_BACKENDS[device_type]
    except KeyError:
        raise PlatformError(
            f"unknown device type {device_type!r}; known device types are {sorted(DEFAULT_BACKENDS)}. "
            "For another accelerator, build Platform(device_type, backend) and pass it to set_platform()."
        ) from None


@functools.cache
def _torch_npu_imports() -> bool:
    """Whether ``torch_npu`` is installed and imports; asked once per process.

    torch_npu is imported only when it is installed and only when asked for:
    importing it is slow and patches torch, which must not happen at import.
    The answer is kept because ``find_spec`` walks ``sys.path`` and auto-detection
    runs on every :func:`get_platform` call (FSDP's stream checks, pipeline stage
    devices), while a package does not appear or vanish in a running process.
    """
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except Exception:  # a broken CANN install must read as "no NPU", not crash detection
        return False
    return True


def _npu_available() -> bool:
    if not _torch_npu_imports():
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def is_device_available(device_type: str) -> bool:
    """Whether this process can put tensors on ``device_type`` right now."""
    if device_type == "cpu":
        return True
    if device_type == "cuda":
        return bool(torch.cuda.is_available())
    if device_type == "npu":
        return _npu_available()
    if device_type == "xpu":
        xpu = getattr(torch, "xpu", None)
        return bool(xpu is not None and xpu.is_available())
    return False


def detect_device_type() -> str:
    """The first available accelerator type (cuda, npu, xpu), else ``"cpu"``."""
    for device_type in _DETECTION_ORDER:
        if is_device_available(device_type):
            return device_type
    return "cpu"


_injected: Platform | None = None


# [Note: why injection]
# The NCCL/HCCL emulation in hp-testing needs library code to take its NCCL
# branches while tensors stay on the CPU and traffic goes over gloo. Rather than
# patching module globals, it injects a :class:`Platform` whose ``device_type``
# is ``"cuda"`` and whose ``tensor_device_type`` is ``"cpu"``.
def set_platform(platform: Platform | None) -> Platform | None:
    """Make ``platform`` the answer of :func:`get_platform` (``None`` restores resolution).

    Returns the previously injected platform so callers can restore it.
    Prefer :func:`use_platform`, which restores for you.
    """
    global _injected
    if platform is not None and not isinstance(platform, Platform):
        raise TypeError(f"set_platform expects a Platform or None, got {type(platform).__name__}.")
    previous = _injected
    _injected = platform
    return previous


@contextmanager
def use_platform(platform: Platform) -> Iterator[Platform]:
    """Inject ``platform`` for the duration of a ``with`` block (tests, emulation)."""
    previous = set_platform(platform)
    try:
        yield platform
    finally:
        set_platform(previous)


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


# [Note: resolution order]
# ``get_platform(device_type)`` decides in this order, first match wins:
#
# 1. an explicit ``device_type`` argument (a platform injected with
#    :func:`set_platform` is returned when it has that device type);
# 2. the platform injected with :func:`set_platform` / :func:`use_platform`;
# 3. the ``HP_DEVICE_TYPE`` environment variable;
# 4. auto-detection: cuda, then npu (only if ``torch_npu`` imports), then xpu,
#    then cpu.
#
# The backend is the device type's default (cuda->nccl, npu->hccl, xpu->xccl,
# cpu->gloo) unless ``HP_BACKEND`` (or the ``backend`` argument) names another.
# An injected platform keeps its own backend: it was built on purpose.
def get_platform(device_type: str | None = None, *, backend: str | None = None) -> Platform:
    """Resolve the platform (see [Note: resolution order]).

    Raises :class:`PlatformError` naming the device type and the fix when the
    requested device type is unknown or not available in this process.
    """
    if device_type is not None and not isinstance(device_type, str):
        raise TypeError(
            f"device_type must be a str or None, got {type(device_type).__name__} ({device_type!r})."
        )
    injected = _injected
    if injected is not None and (device_type is None or device_type == injected.device_type):
        if backend is None or backend == injected.backend:
            return injected
        return Platform(injected.device_type, backend, injected.tensor_device_type)

    source = "argument"
    if device_type is None:
        device_type = _env(ENV_DEVICE_TYPE)
        source = f"${ENV_DEVICE_TYPE}"
    if device_type is None:
        device_type = detect_device_type()
        source = "auto-detection"
    device_type = device_type.lower()
    if ":" in device_type:
        raise PlatformError(
            f"device type {device_type!r} (from {source}) carries an index; pass the bare type "
            f"({device_type.split(':')[0]!r}): the index comes from LOCAL_RANK."
        )
    default_backend = backend_for(device_type)
    if not is_device_available(device_type):
        hint = " (torch_npu is not importable)" if device_type == "npu" else ""
        raise PlatformError(
            f"device type {device_type!r} (from {source}) is not available in this process{hint}. "
            f"Use 'cpu' (or set {ENV_DEVICE_TYPE}=cpu), or, in tests, inject an emulated platform "
            f"with set_platform(Platform({device_type!r}, 'gloo', 'cpu'))."
        )
    chosen_backend = backend or _env(ENV_BACKEND) or default_backend
    return Platform(device_type, chosen_backend, device_type)

"""What each communication backend can do natively, as one small table.

The collectives in :mod:`hp_core.collectives` look the group's backend up here
once per call and choose the native path or an emulation. Deciding from a
table, instead of trying the native call and catching its error, matters
because a failed collective is not always a clean Python exception: gloo
reports ``PREMUL_SUM`` asynchronously and a failed integer ``AVG`` leaves the
peers' connections broken, so the next collective of every rank fails too.
The table and the emulations: [Note: capability table].
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from hp_core._checks import group_facts

__all__ = [
    "REDUCE_OPS",
    "BackendCapabilities",
    "capabilities_for",
    "get_capabilities",
    "register_capabilities",
    "set_backend_semantics",
    "use_capabilities",
]

#: Reduce operations the collectives accept, by name.
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product", "premul_sum")


# [Note: capability table]
# ========  ===========================  ===========  ==================  =============
# backend   native reduce ops            AG tensor    RS tensor           all_to_all
# ========  ===========================  ===========  ==================  =============
# gloo      sum avg max min product      yes          yes                 yes
# nccl      sum avg max min product      yes          yes                 yes
#           premul_sum
# hccl      sum max min product          yes          yes                 yes
# xccl      sum avg max min product      yes          yes                 yes
# other     sum max min product          no           no                  no
# ========  ===========================  ===========  ==================  =============
#
# Emulations (see :mod:`hp_core.collectives`): ``avg`` = sum, then divide by the
# group size on ``wait()``; ``premul_sum`` = multiply by the factor, then sum;
# a missing ``all_gather_into_tensor`` = list all-gather into views of the
# output; a missing ``reduce_scatter_tensor`` = all-reduce a copy, keep this
# rank's chunk; a missing ``all_to_all_single`` = one batch of isend/irecv.
# Uneven all-gathers are padded to the largest size on every backend (gloo
# rejects uneven lists; one padded collective beats ``world_size`` broadcasts).
# ``avg`` needs a floating-point dtype on every backend (gloo fails on integer
# ``AVG`` and leaves the group unusable).
@dataclass(frozen=True)
class BackendCapabilities:
    """The native abilities of one backend; anything missing is emulated."""

    backend: str
    reduce_ops: frozenset[str] = field(default_factory=lambda: frozenset({"sum", "max", "min", "product"}))
    all_gather_into_tensor: bool = False
    reduce_scatter_tensor: bool = False
    all_to_all_single: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.reduce_ops) - set(REDUCE_OPS)
        if unknown:
            raise ValueError(
                f"BackendCapabilities({self.backend!r}) lists unknown reduce ops {sorted(unknown)}; "
                f"choose from {list(REDUCE_OPS)}."
            )
        if "sum" not in self.reduce_ops:
            raise ValueError(
                f"BackendCapabilities({self.backend!r}) lacks 'sum', which every emulation builds on; "
                "a backend without a native sum cannot be used."
            )
        object.__setattr__(self, "reduce_ops", frozenset(self.reduce_ops))


_ALL_FUSED = {"all_gather_into_tensor": True, "reduce_scatter_tensor": True, "all_to_all_single": True}

_TABLE: dict[str, BackendCapabilities] = {
    "gloo": BackendCapabilities("gloo", frozenset({"sum", "avg", "max", "min", "product"}), **_ALL_FUSED),
    "nccl": BackendCapabilities(
        "nccl", frozenset({"sum", "avg", "max", "min", "product", "premul_sum"}), **_ALL_FUSED
    ),
    "hccl": BackendCapabilities("hccl", frozenset({"sum", "max", "min", "product"}), **_ALL_FUSED),
    "xccl": BackendCapabilities("xccl", frozenset({"sum", "avg", "max", "min", "product"}), **_ALL_FUSED),
}


def get_capabilities(backend: str) -> BackendCapabilities:
    """The capabilities registered for ``backend``; conservative ones for unknown backends."""
    key = backend.lower()
    found = _TABLE.get(key)
    return found if found is not None else BackendCapabilities(key)


def register_capabilities(capabilities: BackendCapabilities) -> BackendCapabilities | None:
    """Add or replace a backend's entry (for out-of-tree backends); returns the old entry."""
    if not isinstance(capabilities, BackendCapabilities):
        raise TypeError(
            f"register_capabilities expects BackendCapabilities, got {type(capabilities).__name__}."
        )
    key = capabilities.backend.lower()
    previous = _TABLE.get(key)
    _TABLE[key] = capabilities
    return previous


@contextmanager
def use_capabilities(capabilities: BackendCapabilities) -> Iterator[BackendCapabilities]:
    """Temporarily replace a backend's entry, e.g. to exercise an emulated path in tests."""
    key = capabilities.backend.lower()
    previous = register_capabilities(capabilities)
    try:
        yield capabilities
    finally:
        if previous is None:
            _TABLE.pop(key, None)
        else:
            _TABLE[key] = previous


# [Note: backend semantics seam]
# The NCCL/HCCL emulation in hp-testing runs real traffic over gloo while
# library code must take its NCCL (or HCCL) decisions. It maps the real
# backend's name to the emulated one here, in the ranks it controls; hp_core
# never imports the harness. Empty (the production case) costs one truth test.
_semantics: dict[str, str] = {}


def set_backend_semantics(real: str, emulated: str | None) -> str | None:
    """Make groups that run on ``real`` report ``emulated``'s capabilities; ``None`` undoes it.

    For test harnesses that emulate one backend over another (hp-testing's
    ``nccl-emu`` runs gloo as ``nccl``). Returns the previous mapping of ``real``.
    """
    key = real.lower()
    previous = _semantics.pop(key, None)
    if emulated is not None:
        _semantics[key] = emulated.lower()
    return previous


def _backend_name(group: dist.ProcessGroup | None, tensor_device_type: str) -> str:
    # A group may be built over several backends ("cpu:gloo,cuda:nccl"); the
    # one that runs a collective is the one for the tensor's device.
    name = str(dist.get_backend(group)) if group is None else group_facts(group).backend
    if ":" in name:
        pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = pairs.get(tensor_device_type, next(iter(pairs.values())))
    if _semantics:
        return _semantics.get(name, name)
    return name


def capabilities_for(group: dist.ProcessGroup | None, tensor_device_type: str = "cpu") -> BackendCapabilities:
    """The capabilities of the backend that runs ``group``'s collectives on ``tensor_device_type``."""
    return get_capabilities(_backend_name(group, tensor_device_type))

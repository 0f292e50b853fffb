"""The replicated fallback: what runs when no rule covers an op, and how loudly it says so.

What it does, and why it warns or raises: [Note: fallback] (above :func:`run_fallback`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hp_core import get_logger
from torch.utils import _pytree as pytree

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout
from hp_dtensor.ops.random_agreement import ensure_rng_agreement
from hp_dtensor.placements import Partial, Replicate
from hp_dtensor.redistribute import redistribute_local, slice_for_layout

__all__ = [
    "FallbackStat",
    "fallback_policy",
    "fallback_stats",
    "get_fallback_policy",
    "reset_fallback_stats",
    "run_fallback",
    "set_fallback_policy",
]

_POLICIES = ("warn", "error", "allow")
_log = get_logger("hp_dtensor")  # a line per fallback taken ([Note: debug levels] in hp_core.debug)


def _initial_policy() -> str:
    value = os.environ.get("HP_DTENSOR_FALLBACK", "warn").strip().lower() or "warn"
    if value not in _POLICIES:
        raise ValueError(
            f"HP_DTENSOR_FALLBACK={value!r} is not a fallback policy; use one of {list(_POLICIES)} "
            "(warn: say so once per op; error: raise instead of gathering; allow: say nothing)."
        )
    return value


_policy = _initial_policy()


@dataclass
class FallbackStat:
    """How often one op took the replicated fallback, and the bytes this rank received for it."""

    calls: int = 0
    bytes_gathered: int = 0


_stats: dict[str, FallbackStat] = {}
_warned: set[str] = set()


def set_fallback_policy(policy: str) -> str:
    """Choose what an op without a sharding rule does; returns the previous policy.

    ``"warn"`` (the default): run replicated and warn once per op with the
    bytes gathered; ``"error"``: raise ``NotImplementedError`` naming the op
    on every rank (for tests and for users who care about memory);
    ``"allow"``: run replicated silently. The environment variable
    ``HP_DTENSOR_FALLBACK`` sets the policy at import.
    """
    global _policy
    if policy not in _POLICIES:
        raise ValueError(f"set_fallback_policy: {policy!r} is not one of {list(_POLICIES)}.")
    previous, _policy = _policy, policy
    return previous


def get_fallback_policy() -> str:
    """The current fallback policy (see :func:`set_fallback_policy`)."""
    return _policy


@contextlib.contextmanager
def fallback_policy(policy: str) -> Iterator[None]:
    """``with fallback_policy("error"): ...``: the policy inside the block, the old one after."""
    previous = set_fallback_policy(policy)
    try:
        yield
    finally:
        set_fallback_policy(previous)


def fallback_stats() -> dict[str, FallbackStat]:
    """Per op name: calls that took the fallback and bytes this rank received for them (a copy)."""
    return {name: FallbackStat(s.calls, s.bytes_gathered) for name, s in _stats.items()}


def reset_fallback_stats() -> None:
    """Forget the counts of :func:`fallback_stats` and which ops were already warned about."""
    _stats.clear()
    _warned.clear()


def _gathered_bytes(flat: Sequence[Any], positions: Sequence[int]) -> int:
    """Bytes this rank receives to make every DTensor input whole (partial terms: the whole tensor)."""
    total = 0
    for p in positions:
        layout: Layout = flat[p]._layout
        if layout.is_replicated():
            continue
        itemsize = flat[p].element_size()
        full = 1
        for size in layout.shape:
            full *= size
        local = 0 if layout.has_partial() else flat[p]._local.numel()
        total += (full - local) * itemsize
    return total


def _describe(flat: Sequence[Any], positions: Sequence[int]) -> str:
    parts = []
    for p in positions:
        layout: Layout = flat[p]._layout
        placements = ", ".join(str(x) for x in layout.placements)
        parts.append(f"{tuple(layout.shape)} [{placements}]")
    return "; ".join(parts) if parts else "no DTensor inputs"


def _announce(func: Any, flat: Sequence[Any], positions: Sequence[int], reason: str | None) -> None:
    name = str(func)
    nbytes = _gathered_bytes(flat, positions)
    stat = _stats.setdefault(name, FallbackStat())
    why = f" ({reason})" if reason else ""
    how = (
        f"Add a rule with @hp_dtensor.register_sharding({name}) (hp_dtensor's README, 'Adding a rule'), "
        "or redistribute the inputs yourself."
    )
    if _policy == "error":
        raise NotImplementedError(
            f"hp_dtensor: no sharding rule for {name}{why} on inputs {_describe(flat, positions)}, and the "
            f"fallback policy is 'error' (it would gather {nbytes} bytes on this rank). {how} "
            "set_fallback_policy('warn') runs it replicated instead."
        )
    stat.calls += 1
    stat.bytes_gathered += nbytes
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "fallback: %s%s runs replicated, gathering %s (%d bytes)",
            name,
            why,
            _describe(flat, positions),
            nbytes,
        )
    if _policy == "warn" and name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"hp_dtensor: no sharding rule for {name}{why}; it runs replicated: inputs "
            f"{_describe(flat, positions)} gathered whole ({nbytes} bytes received on this rank for this "
            f"call), computed on full tensors on every rank, outputs cut back. Right, but it costs memory "
            f"and bandwidth. {how} hp_dtensor.set_fallback_policy('error') turns every fallback into an "
            "error; fallback_stats() counts them.",
            stacklevel=4,
        )


def _written_positions(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """Flat positions (of ``(args, kwargs)``) of the tensors the op writes into, from its schema."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return set()
    written: set[int] = set()
    start = 0
    by_name = {a.name: a for a in schema.arguments}
    for index, value in enumerate(args):
        count = len(pytree.tree_leaves(value))
        argument = schema.arguments[index] if index < len(schema.arguments) else None
        if argument is not None and argument.alias_info is not None and argument.alias_info.is_write:
            written.update(range(start, start + count))
        start += count
    for name, value in kwargs.items():
        count = len(pytree.tree_leaves(value))
        argument = by_name.get(name)
        if argument is not None and argument.alias_info is not None and argument.alias_info.is_write:
            written.update(range(start, start + count))
        start += count
    return written


def _write_back(target: DTensor, full: torch.Tensor) -> None:
    """Give ``target`` the op's new full value in its own cut (a partial mesh dim becomes replicated)."""
    layout = target._layout
    if layout.has_partial():
        placements = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
        layout = Layout(layout.mesh, placements, layout.shape, layout.stride, ragged=layout.ragged)
        target._local = slice_for_layout(full, layout).clone()
        target._layout = layout
        return
    piece = slice_for_layout(full, layout)
    if piece.data_ptr() != target._local.data_ptr():
        target._local.copy_(piece)


# [Note: fallback]
# An op without a rule (or whose rule declines, or whose decision would not
# hold on every rank: see :mod:`hp_dtensor.ops.everywhere`) runs replicated:
# every DTensor input is gathered to ``Replicate``, the op runs on full tensors
# on every rank, each argument the op writes into gets its new value back in
# its own layout, and each output with the shape of the first DTensor input is
# cut back to that input's placements (other outputs stay replicated). The
# decision to fall back depends only on layouts and argument values, which
# every rank shares, so every rank takes it (or raises) together.
#
# It is always right and can be very expensive: ``clip_grad_norm_`` over
# sharded gradients would hold the whole model's gradients on every rank. So
# the first fallback of each op says which op, on which placements, how many
# bytes this rank received for it, and how to add a rule; with the ``"error"``
# policy (:func:`set_fallback_policy`, or ``HP_DTENSOR_FALLBACK=error``) it
# raises a ``NotImplementedError`` instead, on every rank, before any
# communication. :func:`fallback_stats` counts calls and bytes per op.
def run_fallback(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    flat: list[Any],
    spec: Any,
    positions: list[int],
    mesh: Any,
    reason: str | None = None,
) -> Any:
    """Replicate, compute, write back, reshard (see [Note: fallback])."""
    _announce(func, flat, positions, reason)
    full_flat = list(flat)
    for p in positions:
        dt = flat[p]
        local, _ = redistribute_local(dt._local, dt._layout, (Replicate(),) * dt._layout.mesh.ndim)
        full_flat[p] = local
    full_args, full_kwargs = pytree.tree_unflatten(full_flat, spec)
    if torch.Tag.nondeterministic_seeded in func.tags and positions:  # rand_like, native_dropout, ...
        ensure_rng_agreement(mesh, flat[positions[0]]._local.device, kwargs.get("generator"))
    result = func(*full_args, **full_kwargs)
    written = {p: flat[p] for p in _written_positions(func, args, kwargs) if isinstance(flat[p], DTensor)}
    by_full = {id(full_flat[p]): dt for p, dt in written.items()}
    for p, dt in written.items():
        _write_back(dt, full_flat[p])
    first = flat[positions[0]]._layout if positions else None
    replicate = (Replicate(),) * mesh.ndim

    def wrap(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        mutated = by_full.get(id(value))
        if mutated is not None:  # an in-place op returns the argument it wrote into
            return mutated
        layout = Layout(mesh, replicate, tuple(value.shape), tuple(value.stride()))
        if first is not None and tuple(value.shape) == first.shape and not first.has_partial():
            local, new_layout = redistribute_local(value, layout, first.placements)
            return DTensor(local, new_layout)
        return DTensor(value, layout)

    return pytree.tree_map(wrap, result)

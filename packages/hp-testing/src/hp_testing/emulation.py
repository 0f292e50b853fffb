"""The emulation layer: torch.distributed, wrapped inside the ranks, between the library and gloo.

:func:`install` replaces the public communication functions of
``torch.distributed`` (``all_reduce``, ``all_gather_single``, ``send``,
``batch_isend_irecv``, the object collectives, ...) with wrappers, injects the
profile's platform into hp_core (``cuda``/``nccl`` semantics with CPU tensors
under ``nccl-emu``, ``npu``/``hccl`` under ``hccl-emu``) and tells hp_core's
capability table which backend's semantics to assume. Only the harness ranks
(and ``hp-run --emulate``) call :func:`install`: production never pays for it.

This module is the patching only: the package README's "Layout" says which
module holds each concern (per-process state, routes, rules, checks, faults,
strict mode).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hp_testing import _p2p_notes, _routes
from hp_testing._funcol import install_functional, uninstall_functional
from hp_testing._funcol_ops import install_functional_ops, uninstall_functional_ops
from hp_testing._layer import Layer
from hp_testing._nesting import Nested as _Nested
from hp_testing._nesting import depth as _depth
from hp_testing.profiles import Profile, get_profile

__all__ = ["Layer", "active_layer", "install", "original", "reinject", "uninstall"]

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
P2P = ("send", "recv", "isend", "irecv")
OBJECT_P2P = ("send_object_list", "recv_object_list")
_ROUTES: dict[str, Callable[..., Any]] = {
    **dict.fromkeys(COLLECTIVES, _routes.run_collective),
    **dict.fromkeys(P2P, _routes.run_p2p),
    **dict.fromkeys(OBJECT_P2P, _routes.run_object_p2p),
}

_LAYER: Layer | None = None
_ORIGINALS: dict[str, Any] = {}


def active_layer() -> Layer | None:
    """The installed layer of this process, if any."""
    return _LAYER


def original(name: str) -> Any:
    """torch's own ``torch.distributed.<name>``, as it was before :func:`install`."""
    return _ORIGINALS[name]


# -- installation -----------------------------------------------------------------------


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def binder(orig: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    """``orig``'s arguments by name, defaults filled in, as ``signature.bind`` + ``apply_defaults`` give.

    The layer names every argument of every collective it routes; binding
    through :mod:`inspect` on each call costs more than many small collectives,
    so the parameters' positions and defaults are read once here. A call the
    plain path cannot take (too many positionals, an unknown or repeated
    keyword, a missing argument, ``*args`` in the signature) goes through
    ``inspect``, which raises the same ``TypeError`` as calling ``orig`` would.
    """
    signature = inspect.signature(orig)
    params = list(signature.parameters.values())
    names = [p.name for p in params]
    positional = [p.name for p in params if p.kind in _POSITIONAL]
    by_keyword = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    plain = all(p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY) for p in params)

    def slow(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(positional):
            return slow(args, kwargs)
        given = dict(zip(positional, args, strict=False))
        for key, value in kwargs.items():
            if key in given or key not in by_keyword:
                return slow(args, kwargs)
            given[key] = value
        try:
            return {name: given[name] if name in given else defaults[name] for name in names}
        except KeyError:  # a required argument is missing
            return slow(args, kwargs)

    return bind if plain else slow


def _wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    bind = binder(orig)
    route = _ROUTES[name]
    p2p = name in P2P

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        layer = _LAYER
        if layer is None or _depth():
            return orig(*args, **kwargs)
        arguments = bind(args, kwargs)
        if p2p:  # [Note: p2p notes for the local backend] in hp_testing._p2p_notes
            with _Nested(), _p2p_notes.issuing(name, arguments):
                return route(layer, name, orig, arguments)
        with _Nested():  # [Note: one call through the layer]
            return route(layer, name, orig, arguments)

    wrapper.__hp_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _wrap_batch(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
        layer = _LAYER
        if layer is None or _depth():
            return orig([_routes.torch_op(op) for op in p2p_op_list])
        c10d._check_p2p_op_list(p2p_op_list)
        ops = list(p2p_op_list)
        with _Nested(), _p2p_notes.issuing("batch_isend_irecv", ops, _ORIGINALS["isend"]):
            return _routes.run_batch(layer, orig, ops, _ORIGINALS["isend"])

    return batch_isend_irecv


def _emulated_backend(backend: Any) -> Any:
    """Map nccl/hccl (what library code asks for under emulation) back to gloo."""
    if isinstance(backend, str) and backend.lower() in ("nccl", "hccl"):
        return "gloo"
    return backend


def _wrap_group_factory(orig: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _LAYER is not None and _LAYER.profile.emulated:
            bound = signature.bind(*args, **kwargs)
            if "backend" in bound.arguments:
                bound.arguments["backend"] = _emulated_backend(bound.arguments["backend"])
            return orig(*bound.args, **bound.kwargs)
        return orig(*args, **kwargs)

    return factory


def install(profile_name: str, *, checks: bool = True, strict: bool = False) -> Layer:
    """Install the layer for ``profile_name`` in this process (idempotent); returns it."""
    global _LAYER
    profile = get_profile(profile_name)
    if _LAYER is not None:
        _LAYER.profile, _LAYER.checks, _LAYER.strict = profile, checks, strict
        _inject(profile)
        return _LAYER
    for name in (*COLLECTIVES, *P2P, *OBJECT_P2P):
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        _ORIGINALS[name] = orig
        setattr(dist, name, _wrap(name, orig))
    _ORIGINALS["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _wrap_batch(dist.batch_isend_irecv)
    for name in ("new_group", "init_process_group", "new_subgroups"):
        orig = getattr(dist, name, None)
        if orig is not None:
            _ORIGINALS[name] = orig
            setattr(dist, name, _wrap_group_factory(orig))
    _patch_p2pop()
    _LAYER = Layer(profile, checks=checks, strict=strict)
    if strict:
        _LAYER.hazards.guard.warm_up()
    install_functional(_LAYER.check_collective)
    # a compiled graph's collectives, at every run ([Note: compiled graphs under the emulation])
    install_functional_ops()
    _inject(profile)
    return _LAYER


# [Note: P2POp keeps the wrapper]
# ``dist.P2POp(dist.isend, ...)`` keeps our wrapper as its ``op``, as torch keeps
# its own function: torch code tells the kinds of op apart by identity with
# ``dist.isend``/``dist.irecv`` (pipelining's ``_batch_p2p`` issues an all-send or
# all-receive list as single ops, not as one ``batch_isend_irecv``), so an ``op``
# swapped for torch's original took another path under the layer than without
# it. Only ``c10d``'s own checks (``_check_op``) and ``batch_isend_irecv`` compare
# with torch's original functions: the first is taught the wrappers here, the
# second is handed ops rebuilt with the originals (:func:`_routes.torch_op`).
def _patch_p2pop() -> None:
    """``c10d._check_op`` accepts our isend/irecv wrappers ([Note: P2POp keeps the wrapper])."""
    check = c10d._check_op
    _ORIGINALS["_check_op"] = check

    def _check_op(op: Any) -> None:
        check(getattr(op, "__hp_original__", op))

    c10d._check_op = _check_op


def _inject(profile: Profile) -> None:
    """Platform and capability semantics of the profile (nothing for plain gloo)."""
    import hp_core
    from hp_core.capabilities import set_backend_semantics

    if profile.emulated:
        hp_core.set_platform(hp_core.Platform(profile.device_type, profile.backend, "cpu"))
        set_backend_semantics("gloo", profile.backend)
    else:
        hp_core.set_platform(None)
        set_backend_semantics("gloo", None)


def reinject() -> None:
    """Restore the profile's platform after a test (a test may have called set_platform)."""
    if _LAYER is not None and _LAYER.profile.emulated:
        _inject(_LAYER.profile)


def uninstall() -> None:
    """Undo :func:`install` (used by tests of the layer itself)."""
    global _LAYER
    if _LAYER is None:
        return
    _LAYER.hazards.clear()
    for name, orig in _ORIGINALS.items():
        if name == "_check_op":
            c10d._check_op = orig
        else:
            setattr(dist, name, orig)
    _ORIGINALS.clear()
    uninstall_functional()
    uninstall_functional_ops()
    _LAYER = None
    import hp_core
    from hp_core.capabilities import set_backend_semantics

    hp_core.set_platform(None)
    set_backend_semantics("gloo", None)

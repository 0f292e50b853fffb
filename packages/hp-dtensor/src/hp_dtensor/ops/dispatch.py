"""The dispatcher: sharding rule -> redistribute inputs -> local op (or kernel) -> wrap outputs.

A rule looks at the op and its DTensor arguments' layouts and returns a
:class:`Decision`: the placements each DTensor argument must have, and the
placements of each output tensor. The dispatcher redistributes, runs the op
on the local tensors, and builds each output's layout from its global shape
and stride, which it gets by running the op on meta tensors (cached). Ops
that are not "the same op on every piece" (a vocab-parallel ``log_softmax``
needs a max and a sum across ranks, a row-wise embedding lookup masks ids it
does not own) add a ``kernel`` that runs instead and may communicate
(:class:`LocalCall`).

Notes beside their code: [Note: dispatch fast path], [Note: scalar-blind ops],
[Note: one object in two argument slots], [Note: plain tensors],
[Note: ragged inputs]; [Note: fallback] is in :mod:`hp_dtensor.ops.fallback`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hp_core import DeviceMesh, get_logger, share_across_ranks
from torch.utils import _pytree as pytree

from hp_dtensor import dtensor as _dtensor_module
from hp_dtensor.dtensor import DTensor, carry_lazy_bits, new_dtensor
from hp_dtensor.layout import Layout, mesh_key
from hp_dtensor.ops.calls import Decision, Kernel, LocalCall, OpCall, Rule
from hp_dtensor.ops.everywhere import decision_problem, to_meta
from hp_dtensor.ops.fallback import run_fallback
from hp_dtensor.ops.meshes import common_mesh as _mesh_of
from hp_dtensor.ops.strided import decide
from hp_dtensor.ops.view_writes import (
    after_view,
    is_view_op,
    refresh_views,
    view_aliases,
    write_back,
    writes_first,
)
from hp_dtensor.out_variants import is_out_variant, run_builtin_out
from hp_dtensor.placements import Placement, Replicate, Shard
from hp_dtensor.redistribute import keep_destination_layout, redistribute_local

__all__ = [
    "RULES",
    "SCALAR_BLIND",
    "UNCACHED",
    "Decision",
    "LocalCall",
    "OpCall",
    "clear_caches",
    "dispatch",
    "register",
]

_log = get_logger("hp_dtensor")


def _name(rule: Any) -> str:
    return getattr(rule, "__qualname__", None) or repr(rule)


def _dropped(problem: str | None) -> str:
    return "" if problem is None else f", dropped: {problem}; the replicated fallback runs"


aten = torch.ops.aten

RULES: dict[Any, Rule] = {}

# [Note: ragged inputs]
# Rules assume ``torch.chunk`` sizes. Ops that keep the layout (pointwise,
# in-place, foreach) carry a ragged layout through; every other op first
# gathers the ragged dims, so rules never see one.
LAYOUT_PRESERVING: set[Any] = set()  # ops that may carry ragged layouts
UNCACHED: set[Any] = set()  # ops whose rule looks past the layouts: never cached, never fast

# [Note: scalar-blind ops]
# For a pointwise op (found by tag, ruled by ``pointwise_rule``) the value of
# a float or complex scalar operand changes neither the sharding decision
# (the rule looks at layouts and at which arguments are tensors) nor the
# output's shape, stride or dtype (type promotion looks at a scalar's type,
# never its value), and remembered entries pass the call's own scalars to the
# local op. Such ops are in :data:`SCALAR_BLIND`, and their float and complex
# scalars enter the fast-path signature and the decision/meta cache key by
# type alone: AdamW's ``div`` by a bias correction that changes every step
# hits instead of re-running the rule and the meta op. Ints, bools and every
# argument of other ops keep their value in the key (a size, a dim, a
# reduction's ``keepdim`` change the answer). Registering a rule by name
# (:func:`register`) takes the op out of the set; a rule put into
# :data:`RULES` by hand must do the same if it reads scalar values.
SCALAR_BLIND: set[Any] = set()  # float/complex scalars keyed by type only (see [Note: scalar-blind ops])
_resolved: set[Any] = set()
_meta_cache: dict[Any, Any] = {}  # (op, argument keys) -> the op's output on global meta tensors
share_across_ranks(__name__, "_meta_cache")  # no rank, mesh or group in a key or a value
_decision_cache: dict[Any, Decision | None] = {}
_problems: dict[Any, str] = {}  # why a rule's cached decision was dropped
_MAX_ENTRIES = 8192


def register(*ops: Any, keeps_layout: bool = False, cached: bool = True) -> Callable[[Rule], Rule]:
    """Register ``rule`` for every op (an OpOverload or an OpOverloadPacket for all overloads).

    ``cached=False`` is for rules whose decision depends on more than the
    arguments' layouts and values (the row-wise embedding backward asks which
    table its ids were looked up in): their decisions are never cached and
    their calls never take the fast path.
    """

    def wrap(rule: Rule) -> Rule:
        for op in ops:
            overloads = [getattr(op, name) for name in op.overloads()] if hasattr(op, "overloads") else [op]
            for overload in overloads:
                RULES[overload] = rule
                if keeps_layout:
                    LAYOUT_PRESERVING.add(overload)
                else:
                    LAYOUT_PRESERVING.discard(overload)
                if not cached:
                    UNCACHED.add(overload)
                else:
                    UNCACHED.discard(overload)
                SCALAR_BLIND.discard(overload)  # a named rule may look at scalar values
        clear_caches()  # a new rule replaces the decisions remembered for the old one
        return rule

    return wrap


def clear_caches() -> None:
    """Forget every remembered decision, meta result and fast-path entry (tests, rule changes)."""
    _FAST.clear()
    _meta_cache.clear()
    _decision_cache.clear()
    _problems.clear()


# -- the fast path ---------------------------------------------------------------------------


# [Note: dispatch fast path]
# Most calls repeat: the same op on tensors with the same layouts, step after
# step. The first call of each (op, argument signature) runs the whole path
# (:func:`dispatch`); when it needed no redistribution, the dispatcher remembers
# the output layouts (and the local size argument of view ops) under that
# signature. Later calls with the same signature only swap DTensors for their
# local tensors, run the op and wrap the results in the remembered layouts: no
# rule, no meta run, no new Layout objects. The signature holds the op's id,
# each DTensor's layout token (:meth:`Layout.token`: equal for equal layouts on
# the same mesh object) and local dtype, each plain tensor's metadata and each
# other argument's type and value (only the type of a float or complex scalar
# given to a scalar-blind op, see [Note: scalar-blind ops]), so a hit is exactly
# a call the slow path would have treated the same way; a layout on another
# (equal) mesh object has another token, so a mesh rebuilt after its groups were
# released is never swapped for a stale one.
#
# The signature of a call with positional DTensors and scalars only (nearly
# every call) is built inline in :func:`_torch_dispatch`, which *is*
# ``DTensor.__torch_dispatch__`` (one Python frame per op), and its remembered
# entry is a closure specialised to the call's shape: which arguments to
# unwrap (generated once per pattern, see :func:`_unwrapped_call`) and the one
# output layout to wrap in. Everything else (kwargs, kernels, view sizes,
# in-place and multi-output ops) hits through the general :func:`_run_entry`.
class _Entry:
    """A remembered call signature: how to run and wrap it without rules."""

    __slots__ = (
        "dtensor_args",
        "inplace",
        "kernel",
        "kwarg_layouts",
        "layouts",
        "local_size",
        "mesh",
        "outputs",
        "size_arg",
    )

    def __init__(
        self,
        mesh: DeviceMesh,
        outputs: list[Layout | None] | Layout,
        inplace: bool,
        size_arg: int | None,
        local_size: list[int] | None,
        kernel: Kernel | None,
        layouts: tuple[Any, ...],
        kwarg_layouts: dict[str, Any],
        dtensor_args: tuple[int, ...],
    ) -> None:
        self.dtensor_args = dtensor_args
        self.mesh = mesh
        self.outputs = outputs  # one Layout for a single tensor result, else one entry per element
        self.inplace = inplace
        self.size_arg = size_arg
        self.local_size = local_size
        self.kernel = kernel
        self.layouts = layouts
        self.kwarg_layouts = kwarg_layouts


# signature -> (func, runner, layout, target). With a layout (a plain single-output op),
# ``runner(args)`` is the op on the unwrapped arguments, ``target`` the op's callable (which
# _torch_dispatch calls on the local tensors itself for the shapes it keys inline), and the result
# is wrapped in ``layout``; without, ``runner(args, kwargs)`` does everything.
_FAST: dict[tuple[Any, ...], tuple[Any, Callable[..., Any], Layout | None, Any]] = {}
_UNCACHEABLE = object()
_PLAIN_TYPES = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format})
_make_wrapper = torch.Tensor._make_wrapper_subclass


def _signature_leaf(value: Any, blind: bool = False) -> Any:
    """Two items per argument, so the flat signature is unambiguous (see [Note: dispatch fast path]).

    With ``blind`` (the op is in :data:`SCALAR_BLIND`) a float or complex
    scalar gives its type and None (see [Note: scalar-blind ops]).
    """
    if blind and (value.__class__ is float or value.__class__ is complex):
        return (value.__class__, None)
    if isinstance(value, DTensor):
        return (value._layout.token(), value._local.dtype)
    if isinstance(value, torch.Tensor):
        return ("T", (value.shape, value.stride(), value.dtype, value.device))
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (torch.Tensor, list, tuple)):
                return _UNCACHEABLE
        return (type(value), tuple(value))
    return (type(value), value)


def _signature(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The call's fast-path signature, or None when an argument cannot be part of one.

    For positional DTensors and plain scalars it equals the key
    :func:`_torch_dispatch` builds inline (the two must stay in step).
    """
    key: list[Any] = [id(func)]
    blind = func in SCALAR_BLIND
    for value in args:
        leaf = _signature_leaf(value, blind)
        if leaf is _UNCACHEABLE:
            return None
        key.extend(leaf)
    for name, value in kwargs.items():
        leaf = _signature_leaf(value, blind)
        if leaf is _UNCACHEABLE:
            return None
        key.append(name)
        key.extend(leaf)
    signature = tuple(key)
    try:
        hash(signature)
    except TypeError:  # an unhashable argument value
        return None
    return signature


_UNWRAPPERS: dict[tuple[bool, ...], Callable[[Any], Callable[[tuple[Any, ...]], Any]]] = {}


def _unwrapped_call(func: Any, mask: tuple[bool, ...]) -> Callable[[tuple[Any, ...]], Any]:
    """``call(args)``: ``func`` on ``args[i]._local`` where ``mask[i]``, on ``args[i]`` elsewhere.

    The body is generated once per pattern: a straight call like
    ``f(a[0]._local, a[1])`` costs a fraction of a loop that swaps arguments
    in a list (see [Note: dispatch fast path]); its source is built from
    indices only. An OpOverload is called through its C++ callable
    (``_op``, what ``OpOverload.__call__`` forwards to), saving a Python frame.
    """
    factory = _UNWRAPPERS.get(mask)
    if factory is None:
        items = ", ".join(f"a[{i}]._local" if is_dt else f"a[{i}]" for i, is_dt in enumerate(mask))
        factory = eval(f"lambda f: lambda a: f({items})")  # only integers are interpolated
        _UNWRAPPERS[mask] = factory
    return factory(_op_callable(func))


def _op_callable(func: Any) -> Any:
    """What calling ``func`` runs: an OpOverload's C++ callable (``OpOverload.__call__`` forwards to it)."""
    return func._op if isinstance(func, torch._ops.OpOverload) else func


def _torch_dispatch(
    cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
) -> Any:
    """``DTensor.__torch_dispatch__``: the fast path inline, everything else in :func:`dispatch`.

    The key is :func:`_signature`'s, built by hand for the shapes of nearly
    every call (one to three DTensors, a DTensor and a scalar). For those
    shapes the key fixes which arguments are DTensors, so a hit on a plain
    single-output op calls the op's C++ callable on the local tensors and
    wraps the result right here: one Python frame per op (see [Note:
    dispatch fast path]). An untokened layout puts None in the key: a miss,
    and the slow path tokens it.
    """
    if kwargs or (
        args and args[0].__class__ is DTensor and (args[0]._copy_of is not None or args[0]._moved_views)
    ):
        return dispatch(func, args, kwargs or {})  # a moved view: see [Note: writes through moved views]
    hit: Any = None
    local: Any = None
    n = len(args)
    if n == 2:
        a, b = args
        if a.__class__ is DTensor:
            if b.__class__ is DTensor:
                hit = _FAST.get(
                    (id(func), a._layout._token, a._local.dtype, b._layout._token, b._local.dtype)
                )
                if hit is not None and hit[0] is func and hit[2] is not None:
                    local = hit[3](a._local, b._local)
            elif b.__class__ in _PLAIN_TYPES:
                value = None if b.__class__ is float and func in SCALAR_BLIND else b
                hit = _FAST.get((id(func), a._layout._token, a._local.dtype, b.__class__, value))
                if hit is not None and hit[0] is func and hit[2] is not None:
                    local = hit[3](a._local, b)
    elif n == 1:
        a = args[0]
        if a.__class__ is DTensor:
            hit = _FAST.get((id(func), a._layout._token, a._local.dtype))
            if hit is not None and hit[0] is func and hit[2] is not None:
                local = hit[3](a._local)
    elif n == 3 and args[0].__class__ is args[1].__class__ is args[2].__class__ is DTensor:
        a, b, c = args  # addmm, addcmul, where, ...
        la, lb, lc = a._layout, b._layout, c._layout
        hit = _FAST.get(
            (id(func), la._token, a._local.dtype, lb._token, b._local.dtype, lc._token, c._local.dtype)
        )
        if hit is not None and hit[0] is func and hit[2] is not None:
            local = hit[3](a._local, b._local, c._local)
    else:
        key: tuple[Any, ...] = (id(func),)
        for value in args:
            kind = value.__class__
            if kind is DTensor:
                key += (value._layout._token, value._local.dtype)
            elif kind in _PLAIN_TYPES:
                key += (kind, None if kind is float and func in SCALAR_BLIND else value)
            else:
                break  # not keyed inline: dispatch() builds the full signature
        else:
            hit = _FAST.get(key)
            if hit is not None and hit[0] is func and hit[2] is not None:
                local = hit[1](args)
    if local is not None:  # a plain single-output op ran on the local tensors: wrap it
        layout = hit[2]
        out = _make_wrapper(
            DTensor, layout.shape, strides=layout.stride, dtype=local.dtype, device=local.device
        )
        out._local = local
        out._layout = layout
        if local.is_conj() or local.is_neg():
            carry_lazy_bits(out, local)
        return out
    if hit is not None and hit[0] is func:  # remembered, but not a plain single-output op
        return hit[1](args, {})
    return dispatch(func, args, {})


def _run_entry(entry: _Entry, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The general remembered call: any arguments, kernels, view sizes, in-place and multi-output ops."""
    local_args = list(args)
    for index in entry.dtensor_args:  # the signature fixes which arguments are DTensors
        local_args[index] = args[index]._local
    if kwargs:
        local_kwargs = {k: (v._local if isinstance(v, DTensor) else v) for k, v in kwargs.items()}
    else:
        local_kwargs = kwargs
    if entry.size_arg is not None:
        local_args[entry.size_arg] = entry.local_size
    if entry.kernel is not None:
        call = LocalCall(
            func, tuple(local_args), local_kwargs, entry.layouts, entry.kwarg_layouts, entry.mesh
        )
        result = entry.kernel(call)
    else:
        result = func(*local_args, **local_kwargs)
    if entry.inplace:
        return args[0]
    outputs = entry.outputs
    if isinstance(outputs, Layout):
        return new_dtensor(result, outputs)
    wrapped = [
        value if layout is None else new_dtensor(value, layout)
        for value, layout in zip(result, outputs, strict=True)
    ]
    return tuple(wrapped) if isinstance(result, tuple) else wrapped


def _remember(
    func: Any,
    signature: tuple[Any, ...] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: DeviceMesh,
    result: Any,
    wrapped: Any,
    decision: Decision,
    local_size: list[int] | None,
    layouts: tuple[Any, ...],
    kwarg_layouts: dict[str, Any],
) -> None:
    """Store how to repeat this call without rules (see [Note: dispatch fast path])."""
    if signature is None:
        return
    outputs: list[Layout | None] | Layout
    if decision.inplace:
        outputs = []
    elif isinstance(wrapped, DTensor) and isinstance(result, torch.Tensor):
        outputs = wrapped._layout
    elif isinstance(wrapped, (tuple, list)) and isinstance(result, (tuple, list)):
        outputs = []
        for value in wrapped:
            if isinstance(value, DTensor):
                outputs.append(value._layout)
            elif isinstance(value, (torch.Tensor, list, tuple, dict)):
                return  # nested or unwrapped tensor results: keep the general path
            else:
                outputs.append(None)
    else:
        return
    # Token the output layouts now, so the outputs' next use already hits.
    for layout in [outputs] if isinstance(outputs, Layout) else outputs:
        if layout is not None:
            layout.token()
    mask = tuple(isinstance(value, DTensor) for value in args)
    runner: Callable[..., Any]
    single: Layout | None = None
    target: Any = None
    if (
        isinstance(outputs, Layout)
        and not kwargs
        and decision.kernel is None
        and decision.size_arg is None
        and not decision.inplace
    ):
        runner, single = _unwrapped_call(func, mask), outputs
        target = _op_callable(func)
    else:
        entry = _Entry(
            mesh,
            outputs,
            decision.inplace,
            decision.size_arg,
            local_size,
            decision.kernel,
            layouts,
            kwarg_layouts,
            tuple(i for i, is_dt in enumerate(mask) if is_dt),
        )
        runner = functools.partial(_run_entry, entry, func)
    if len(_FAST) >= _MAX_ENTRIES:
        _FAST.clear()
    _FAST[signature] = (func, runner, single, target)


# -- helpers ----------------------------------------------------------------------------------


def _leaf_key(value: Any, blind: bool = False) -> Any:
    if blind and (value.__class__ is float or value.__class__ is complex):
        return (value.__class__, None)  # see [Note: scalar-blind ops]
    if isinstance(value, DTensor):
        layout = value._layout
        return ("D", layout.shape, layout.stride, value.dtype, layout.placements, layout.ragged is not None)
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value), value)


def _output_meta(func: Any, key: Any, flat: list[Any], spec: Any) -> Any:
    """The op's output on meta tensors at the arguments' global shapes, remembered.

    Keyed by the op and its arguments' keys without the mesh (the meta run
    never sees one), so the entry serves every mesh of a shape and, in a
    simulator of many ranks (hp-testing's local mode), every rank: the cache
    is declared rank-independent (:func:`hp_core.share_across_ranks`).
    """
    meta_key = None if key is None else key[:2]
    if meta_key is not None:
        found = _meta_cache.get(meta_key)
        if found is not None:
            return found
    meta_args, meta_kwargs = pytree.tree_unflatten([to_meta(v) for v in flat], spec)
    result = func(*meta_args, **meta_kwargs)
    if meta_key is not None:
        _meta_cache[meta_key] = result
    return result


def _decided_meta(decision: Decision, func: Any, key: Any, flat: list[Any], spec: Any) -> Any:
    """The op's global result on meta tensors: the rule's own if given ([Note: rule-supplied metas])."""
    if decision.output_metas is not None:
        return decision.output_metas
    return _output_meta(func, key, flat, spec)


def _refuse_collective(func: Any) -> None:
    """A ``torch.distributed`` call on a DTensor: refused, as torch's DTensor does.

    The replicated fallback would gather inside the call, a collective the
    peers join only if they passed DTensors too (a rank broadcasting a
    DTensor to ranks receiving plain tensors would hang), and the meaning of
    "broadcast a sharded tensor" is the caller's to choose.
    """
    raise TypeError(
        f"{func} was called on an hp_dtensor.DTensor; torch.distributed's collectives take plain "
        "tensors: pass dtensor.to_local() (this rank's piece) or dtensor.full_tensor() (the whole "
        "tensor), or use dtensor.redistribute(...) to change how it is split"
    )


# [Note: plain tensors]
# Plain tensors mixed with DTensors are taken as replicated: every rank holds
# the same full value (scalars, masks, the optimizer's step counters).
def _lift_plain(flat: list[Any], positions: list[int], mesh: Any) -> tuple[list[Any], list[int]]:
    """Plain tensors with dims become replicated DTensors (see [Note: plain tensors]); scalars stay."""
    out = list(flat)
    for i, value in enumerate(flat):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
            replicate = (Replicate(),) * mesh.ndim
            out[i] = DTensor(value, Layout(mesh, replicate, tuple(value.shape), tuple(value.stride())))
    return out, [i for i, v in enumerate(out) if isinstance(v, DTensor)]


# [Note: one object in two argument slots]
# Rules find an argument's flat position by identity (:meth:`OpCall.position_of`)
# and decide per position. A DTensor passed twice (``x @ x``, ``torch.cat([x,
# x])``, ``sdpa(q, q, q)``) would give both slots the first one's position:
# one target would be lost and the other slot used unmoved, a wrong result
# without an error; and since decisions are cached by layouts, not identity,
# the wrong decision would then serve calls with two distinct tensors too.
# So before a rule sees a call, every repeat of an object is replaced by a new
# DTensor over the same local tensor and layout: each slot has its own
# object, and the cached decision holds for every call with those layouts.
def _distinct(flat: list[Any], positions: Sequence[int]) -> list[Any]:
    """``flat`` with each repeat of a DTensor object replaced by a new one over the same local tensor.

    See [Note: one object in two argument slots]; the first occurrence stays
    itself (an in-place op writes into it).
    """
    if len(positions) < 2:
        return flat
    seen: set[int] = set()
    out = flat
    for p in positions:
        dt = flat[p]
        if id(dt) in seen:
            if out is flat:
                out = list(flat)
            out[p] = DTensor(dt._local, dt._layout)
        seen.add(id(dt))
    return out


# -- the dispatcher ----------------------------------------------------------------------------


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on DTensor arguments; views that are copies and writes into them are tracked.

    A view op's output that does not alias its input is marked, and an in-place
    op on a marked DTensor is written back to where the view came from
    ([Note: writes through moved views] in :mod:`hp_dtensor.ops.view_writes`).
    """
    out = _dispatch(func, args, kwargs)
    if is_view_op(func):
        after_view(func, args, kwargs, out)
    elif args and isinstance(args[0], DTensor) and writes_first(func):
        target = args[0]
        if target._copy_of is not None:
            write_back(target._copy_of)
        if target._moved_views:
            refresh_views(target)
    return out


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The general path behind :func:`_torch_dispatch`.

    Also the entry for calls :func:`_torch_dispatch` does not key inline
    (kwargs, lists, plain tensors): it builds the full signature and still
    takes the fast path on a hit.
    """
    special = SPECIAL.get(func)
    if special is not None:
        return special(args, kwargs)
    signature = _signature(func, args, kwargs)
    if signature is not None:
        hit = _FAST.get(signature)
        if hit is not None and hit[0] is func:
            if hit[2] is None:
                return hit[1](args, kwargs)
            return new_dtensor(hit[1](args), hit[2])
    rule = RULES.get(func)
    if special is None and rule is None and func not in _resolved:
        _resolved.add(func)
        from hp_dtensor.ops.pointwise import resolve_by_tag

        resolve_by_tag(func)
        special = SPECIAL.get(func)
        rule = RULES.get(func)
        if func in SCALAR_BLIND and signature is not None:
            signature = _signature(func, args, kwargs)  # now keyed by scalar type (the inline key's)
    if special is not None:
        return special(args, kwargs)
    if is_out_variant(func):  # see [Note: built-in out= overloads] in hp_dtensor.out_variants
        return run_builtin_out(func, args, kwargs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, v in enumerate(flat) if isinstance(v, DTensor)]
    mesh, flat = _mesh_of(flat, positions, func)
    if len(positions) != sum(1 for v in flat if isinstance(v, torch.Tensor)):
        flat, positions = _lift_plain(flat, positions, mesh)
    flat = _distinct(flat, positions)
    if func not in LAYOUT_PRESERVING and any(flat[p]._layout.ragged is not None for p in positions):
        signature = None
        flat = list(flat)
        for p in positions:  # see [Note: ragged inputs]
            dt = flat[p]
            if dt._layout.ragged is not None:
                local, layout = redistribute_local(dt._local, dt._layout, dt._layout.placements)
                flat[p] = DTensor(local, layout)
    if any(flat[p]._layout.ragged is not None for p in positions):
        signature = None
    uncached = func in UNCACHED
    if uncached:
        signature = None
    key: Any = None
    blind = func in SCALAR_BLIND
    leaf_keys = [_leaf_key(v, blind) for v in flat]
    if all(k is not None for k in leaf_keys):
        key = (func, tuple(leaf_keys), mesh_key(mesh))
    decision: Decision | None = None
    problem: str | None = None
    if rule is not None:
        if key is not None and not uncached and key in _decision_cache:
            decision = _decision_cache[key]
            problem = _problems.get(key)
        else:
            a, k = pytree.tree_unflatten(flat, spec)
            # Through strided.decide: rules see StridedShard only if they read it (see
            # [Note: rules and strided shards] in ops.strided); a miss only, hits never pay.
            decision = decide(rule, OpCall(func, a, k, flat, positions))
            if decision is not None and not uncached:
                # see [Note: decisions that hold on every rank]
                meta = None if decision.inplace else _decided_meta(decision, func, key, flat, spec)
                problem = decision_problem(func, flat, spec, positions, decision, mesh, meta)
                if problem is not None:
                    decision = None
            if key is not None and not uncached:
                _decision_cache[key] = decision
                if problem is not None:
                    _problems[key] = problem
            if _log.isEnabledFor(logging.DEBUG):  # once per layouts (decisions are cached)
                _log.debug("%s: rule %s chose %s%s", func, _name(rule), decision, _dropped(problem))
    if decision is None:
        if func.namespace == "c10d":
            _refuse_collective(func)
        reason = None if problem is None else f"its rule's decision does not hold on every rank: {problem}"
        return run_fallback(func, args, kwargs, flat, spec, positions, mesh, reason)
    return _run(func, args, kwargs, flat, spec, positions, decision, key, mesh, signature)


def _run(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    flat: list[Any],
    spec: Any,
    positions: list[int],
    decision: Decision,
    key: Any,
    mesh: Any,
    signature: tuple[Any, ...] | None,
) -> Any:
    local_flat = list(flat)
    layout_flat: list[Any] = [None] * len(flat)
    moved = False
    written: tuple[torch.Tensor, Layout] | None = None
    for p in positions:
        dt = flat[p]
        target = decision.inputs.get(p)
        if target is not None and target != dt._layout.placements:
            moved = True
            local, layout = redistribute_local(dt._local, dt._layout, target)
            if decision.inplace and p == positions[0]:
                # The op writes into its first argument: move that DTensor itself first
                # (and back afterwards: see [Note: an in-place op keeps its destination's layout]).
                written = (dt._local, dt._layout)
                dt._local, dt._layout = local, layout
            local_flat[p] = local
            layout_flat[p] = layout
        else:
            local_flat[p] = dt._local
            layout_flat[p] = dt._layout
    local_args, local_kwargs = pytree.tree_unflatten(local_flat, spec)
    meta = None
    local_size = None
    if decision.size_arg is not None:
        # The op takes the global output size; the local op needs this rank's piece of it.
        meta = _decided_meta(decision, func, key, flat, spec)
        placements = decision.outputs[0]
        assert placements is not None
        out_layout = Layout(mesh, placements, tuple(meta.shape), tuple(meta.stride()))
        local_args = list(local_args)
        local_size = list(out_layout.local_shape())
        local_args[decision.size_arg] = local_size
    layouts: tuple[Any, ...] = ()
    kwarg_layouts: dict[str, Any] = {}
    if decision.kernel is not None:
        arg_layouts, kwarg_layouts = pytree.tree_unflatten(layout_flat, spec)
        layouts = tuple(arg_layouts)
        result = decision.kernel(
            LocalCall(func, tuple(local_args), local_kwargs, layouts, kwarg_layouts, mesh)
        )
    else:
        result = func(*local_args, **local_kwargs)
    wrapped: Any = None
    if decision.inplace:
        value = flat[positions[0]]
        if written is not None:
            keep_destination_layout(value, *written)
    else:
        if meta is None:
            meta = _decided_meta(decision, func, key, flat, spec)
        wrapped = value = _wrap(func, result, meta, decision.outputs, mesh, flat, positions)
    if not moved and not (is_view_op(func) and not view_aliases(result, local_flat[positions[0]])):
        _remember(
            func, signature, args, kwargs, mesh, result, wrapped, decision, local_size, layouts, kwarg_layouts
        )
    return value


def _wrap(
    func: Any,
    result: Any,
    meta: Any,
    placements: list[tuple[Placement, ...] | None],
    mesh: Any,
    flat: list[Any],
    positions: list[int],
) -> Any:
    """Wrap each output in its layout: ``placements[i]`` belongs to the op's i-th output.

    Optional outputs that the op skipped (None, as in the norms' backward) keep
    their slot, so a rule's placements line up with the op's schema.
    """

    def one(value: Any, m: Any, target: tuple[Placement, ...] | None) -> Any:
        if not isinstance(value, torch.Tensor) or target is None:
            return value
        if any(isinstance(p, Shard) and p.dim >= m.dim() for p in target):
            raise AssertionError(
                f"hp_dtensor internal error: the rule for {func} placed a {m.dim()}-D output as "
                f"{list(target)}; please report this."
            )
        layout = Layout(mesh, target, tuple(m.shape), tuple(m.stride()))
        for p in positions:  # carry a ragged table through shape-preserving ops
            source = flat[p]._layout
            if source.ragged is not None and source.shape == layout.shape and source.placements == target:
                layout = Layout(mesh, target, layout.shape, layout.stride, ragged=source.ragged)
                break
        if tuple(value.shape) != layout.local_shape():
            raise AssertionError(
                f"hp_dtensor internal error: {func} local result shape {tuple(value.shape)} does not "
                f"match the layout {layout} (expected local shape {layout.local_shape()}); "
                "please report this."
            )
        return DTensor(value, layout)

    def target_of(index: int) -> tuple[Placement, ...] | None:
        return placements[index] if index < len(placements) else None

    if isinstance(result, torch.Tensor):
        return one(result, meta, target_of(0))
    if isinstance(result, (tuple, list)) and not any(isinstance(v, (tuple, list, dict)) for v in result):
        items = [one(v, m, target_of(i)) for i, (v, m) in enumerate(zip(result, meta, strict=True))]
        return tuple(items) if isinstance(result, tuple) else items
    out_flat, out_spec = pytree.tree_flatten(result)
    meta_flat, _ = pytree.tree_flatten(meta)
    tensors = iter(range(len(out_flat)))
    wrapped = [
        one(v, m, target_of(next(tensors))) if isinstance(v, torch.Tensor) else v
        for v, m in zip(out_flat, meta_flat, strict=True)
    ]
    return pytree.tree_unflatten(wrapped, out_spec)


# -- ops handled directly ----------------------------------------------------------------------


def _detach(args: tuple[Any, ...], kwargs: dict[str, Any]) -> DTensor:
    dt = args[0]
    return DTensor(dt._local.detach(), dt._layout)


def _alias(args: tuple[Any, ...], kwargs: dict[str, Any]) -> DTensor:
    dt = args[0]
    return DTensor(torch.ops.aten.alias.default(dt._local), dt._layout)


def _item(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dt = args[0]
    local, _ = redistribute_local(dt._local, dt._layout, (Replicate(),) * dt._layout.mesh.ndim)
    return local.item()


def _equal(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    full = []
    for x in args[:2]:
        if isinstance(x, DTensor):
            x, _ = redistribute_local(x._local, x._layout, (Replicate(),) * x._layout.mesh.ndim)
        full.append(x)
    return bool(torch.equal(full[0], full[1]))


SPECIAL: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {
    aten.detach.default: _detach,
    aten.alias.default: _alias,
    aten._local_scalar_dense.default: _item,
    aten.equal.default: _equal,
}

_dtensor_module._DISPATCH = dispatch
# One Python frame per op instead of two (see [Note: dispatch fast path]).
DTensor.__torch_dispatch__ = classmethod(_torch_dispatch)  # type: ignore[assignment,method-assign]

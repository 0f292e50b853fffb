"""Running a registered rule for an ``out=`` op: the result lands in the caller's ``out`` DTensors.

The dispatcher wraps an op's results in new DTensors; an ``out=`` overload
must instead leave them in the DTensors the caller passed, placed as the rule
says ([Note: out= variants]). :func:`registration.register_sharding` and
``register_rule`` route such ops here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout
from hp_dtensor.ops.calls import Decision, OpCall
from hp_dtensor.ops.meshes import common_mesh
from hp_dtensor.ops.random_agreement import ensure_rng_agreement
from hp_dtensor.placements import Replicate
from hp_dtensor.redistribute import redistribute_local

__all__ = [
    "functional_overload",
    "is_out_variant",
    "meta_result",
    "out_names",
    "out_positions",
    "run_builtin_out",
    "run_out_variant",
]


def out_names(func: Any) -> list[str]:
    """The names of ``func``'s out arguments, in schema order (empty for other ops)."""
    return [a.name for a in func._schema.arguments if a.is_out]


def is_out_variant(func: Any) -> bool:
    """Whether ``func`` writes its results into ``out`` arguments (``add.out``, ``foo.out``).

    Remembered per op: the dispatcher asks on every call it does not serve from its fast path.
    """
    known = _IS_OUT.get(func)
    if known is None:
        known = _IS_OUT[func] = bool(out_names(func))
    return known


_IS_OUT: dict[Any, bool] = {}


def out_positions(call: OpCall) -> list[int]:
    """The flat positions of the call's out DTensors, in schema order."""
    return [call.position_of(value) for value in _out_values(call.func, call.args, call.kwargs)]


def _out_values(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    values = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.is_out:
            values.append(kwargs[argument.name] if argument.name in kwargs else args[index])
    return values


# [Note: out= variants]
# ``torch.add(a, b, out=c)`` returns ``c`` itself, so the result must end up in
# the caller's DTensor ``c``, placed as the rule says (torch's DTensor sets the
# out tensor's spec to the strategy's output spec; its ``register_sharding``
# leaves out variants as a TODO). The rule sees the out arguments as inputs
# too, but their data is never moved: it is overwritten. The other inputs are
# moved to the rule's placements, and each out DTensor whose layout already is
# the output's gets the op's writes in its own local tensor; one placed
# otherwise gets a fresh local tensor and the new layout. An out tensor's
# global shape and dtype must be the result's (a DTensor's shape is fixed when
# it is made, and resizing it is refused with the shape to allocate). Out
# variants take no autograd (torch refuses ``out=`` with inputs that need
# gradients before dispatch), and a declining rule raises: there is no
# replicated fallback that would write into ``out``.
def run_out_variant(rule: Callable[[OpCall], Decision | None], func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` (an out variant) on DTensors under ``rule``; returns the out DTensor(s), updated."""
    outs = _out_values(func, args, kwargs)
    _check_outs(func, out_names(func), outs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, v in enumerate(flat) if isinstance(v, DTensor)]
    mesh, flat = common_mesh(flat, positions, func)
    flat = _distinct_and_lifted(flat, positions, mesh)
    positions = [i for i, v in enumerate(flat) if isinstance(v, DTensor)]
    call_args, call_kwargs = pytree.tree_unflatten(flat, spec)
    call = OpCall(func, call_args, call_kwargs, flat, positions)
    decision = rule(call)
    if decision is None:
        raise NotImplementedError(
            f"{func}: the registered rule declined this call (placements "
            f"{[list(flat[p].placements) for p in positions]}); an out= variant has no replicated "
            "fallback: return a Decision for it, or call the op without out=."
        )
    if decision.kernel is not None:
        raise NotImplementedError(
            f"{func}: the rule's Decision has a kernel; out= variants run the op itself, so give "
            "placements only (or register the functional overload with the kernel)."
        )
    targets = out_positions(call)
    result_metas = pytree.tree_leaves(meta_result(func, call_args, call_kwargs))
    local_flat = list(flat)
    for p in positions:
        if p in targets:
            continue
        dt = flat[p]
        wanted = decision.inputs.get(p)
        local_flat[p] = dt._local
        if wanted is not None and wanted != dt._layout.placements:
            local_flat[p], _ = redistribute_local(dt._local, dt._layout, wanted)
    layouts = []
    for index, (p, meta) in enumerate(zip(targets, result_metas, strict=True)):
        out = flat[p]
        placements = decision.outputs[index] if index < len(decision.outputs) else None
        if placements is None:
            raise ValueError(f"{func}: the rule gave no placements for out argument {index}; give them.")
        if tuple(meta.shape) != tuple(out.shape) or meta.dtype != out.dtype:
            raise ValueError(
                f"{func}: out argument {index} is a DTensor of shape {tuple(out.shape)} and dtype "
                f"{out.dtype} but the result has shape {tuple(meta.shape)} and dtype {meta.dtype}; a DTensor "
                "is not resized: allocate out with the result's shape and dtype."
            )
        layout = Layout(mesh, placements, tuple(meta.shape), tuple(meta.stride()))
        layouts.append(layout)
        if layout == out._layout:
            local_flat[p] = out._local  # the op writes into the caller's own local tensor
        else:
            local_flat[p] = torch.empty(layout.local_shape(), dtype=out.dtype, device=out._local.device)
    local_args, local_kwargs = pytree.tree_unflatten(local_flat, spec)
    func(*local_args, **local_kwargs)
    for p, layout in zip(targets, layouts, strict=True):
        out = outs[targets.index(p)]
        out._local, out._layout = local_flat[p], layout
    return outs[0] if len(outs) == 1 else tuple(outs)


def _distinct_and_lifted(flat: list[Any], positions: list[int], mesh: Any) -> list[Any]:
    """Repeats of one DTensor as distinct objects, ragged ones re-cut, plain tensors replicated.

    A rule finds arguments by identity, so ``torch.mul(a, a, out=c)`` needs
    two objects (as the dispatcher's [Note: one object in two argument
    slots]); plain tensors count as replicated there too ([Note: plain tensors]),
    and rules assume ``torch.chunk`` sizes ([Note: ragged inputs]).
    """
    out = list(flat)
    seen: set[int] = set()
    for i, value in enumerate(flat):
        if isinstance(value, DTensor):
            if value._layout.ragged is not None:
                out[i] = DTensor(*redistribute_local(value._local, value._layout, value._layout.placements))
            elif id(value) in seen:
                out[i] = DTensor(value._local, value._layout)
            seen.add(id(value))
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            replicate = (Replicate(),) * mesh.ndim
            out[i] = DTensor(value, Layout(mesh, replicate, tuple(value.shape), tuple(value.stride())))
    return out


def meta_result(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` on meta tensors of the arguments' global shapes (out tensors: their global shapes)."""

    def meta(value: Any) -> Any:
        if isinstance(value, DTensor):
            layout = value._layout
            return torch.empty_strided(layout.shape, layout.stride, dtype=value.dtype, device="meta")
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return value

    meta_args, meta_kwargs = pytree.tree_map(meta, (args, kwargs))
    return func(*meta_args, **meta_kwargs)


# [Note: built-in out= overloads]
# ``torch.mul(a, b, out=c)`` reaches the dispatcher as ``aten.mul.out`` with
# ``c`` among the arguments, and Python hands the caller ``c`` back whatever the
# dispatcher returns. Running the op's rule on the local tensors would write
# this rank's piece into ``c``'s local tensor while ``c`` keeps its own layout:
# a ``Replicate()`` ``c`` would silently hold one shard per rank. So a built-in
# out= overload (one without a registered rule: see [Note: out= variants]) runs
# its functional overload (same arguments, no ``out``) on the DTensors, which
# takes the ordinary rules, and then ``out.copy_(result)``: ``copy_``'s rule
# moves the result into ``out``'s own placements and writes ``out``'s local
# tensor in place, so a ``c`` that is a view of another DTensor is written
# through as well. ``c`` keeps its placements (torch's DTensor gives it the
# strategy's instead); an extra copy is the price, and out= is rare in a
# training step. A DTensor is never resized: an ``out`` of another shape is
# refused, as is a dtype torch would refuse to cast to. Factories (``zeros``,
# ``arange``, ``full``: no functional overload, the out tensor is the only
# DTensor) fill a plain tensor of ``out``'s global shape and copy it in (each
# rank keeps its piece, no communication); random ones (``rand``, ``randint``)
# draw the whole tensor as the in-place fills do (``normal_``: every rank the
# same draw, the values a single process would get). The out= forms of ops
# without a functional twin (the batch-norm kernels, ``_to_copy``) are refused.
def functional_overload(func: Any) -> Any | None:
    """The overload of ``func``'s packet taking its arguments without ``out`` (None if there is none)."""
    if func in _FUNCTIONAL:
        return _FUNCTIONAL[func]
    wanted = [(a.name, str(a.type)) for a in func._schema.arguments if not a.is_out]
    found = None
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        if any(a.is_out or (a.alias_info is not None and a.alias_info.is_write) for a in arguments):
            continue
        if [(a.name, str(a.type)) for a in arguments] == wanted:
            found = candidate
            break
    _FUNCTIONAL[func] = found
    return found


_FUNCTIONAL: dict[Any, Any] = {}


def run_builtin_out(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` (an out= overload, no registered rule) on DTensors: [Note: built-in out= overloads]."""
    names = out_names(func)
    outs = _out_values(func, args, kwargs)
    _check_outs(func, names, outs)
    positions = [i for i, a in enumerate(func._schema.arguments) if not a.is_out]
    call_args = tuple(args[i] for i in positions if i < len(args))
    call_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    functional = functional_overload(func)
    if functional is not None:  # the shapes the out tensors must have (no meta out tensor to resize)
        metas = pytree.tree_leaves(meta_result(functional, call_args, call_kwargs))
    else:
        metas = pytree.tree_leaves(meta_result(func, args, kwargs))
    for name, out, meta in zip(names, outs, metas, strict=True):
        if tuple(meta.shape) != tuple(out.shape):
            raise ValueError(
                f"{func}: {name}= is a DTensor of shape {tuple(out.shape)} but the result has shape "
                f"{tuple(meta.shape)}; a DTensor is not resized: allocate {name} with the result's shape."
            )
    if functional is not None:
        results = functional(*call_args, **call_kwargs)
    elif not any(isinstance(v, DTensor) for v in pytree.tree_leaves((call_args, call_kwargs))):
        # A factory: fill a plain tensor of out's global shape; copy_ keeps each rank's piece.
        plain = [torch.empty(o.shape, dtype=o.dtype, device=o._local.device) for o in outs]
        if torch.Tag.nondeterministic_seeded in func.tags:  # one generator state on the mesh
            ensure_rng_agreement(outs[0]._layout.mesh, outs[0]._local.device, kwargs.get("generator"))
        plain_args, plain_kwargs = _outs_replaced(func, args, kwargs, plain)
        func(*plain_args, **plain_kwargs)
        results = plain
    else:
        raise NotImplementedError(
            f"{func}: this out= overload has no functional twin that hp_dtensor can run on DTensors; call "
            "the op without out= and copy_ the result into the out DTensor."
        )
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    for name, out, result in zip(names, outs, results, strict=True):
        if isinstance(result, torch.Tensor) and not torch.can_cast(result.dtype, out.dtype):
            raise RuntimeError(
                f"{func}: result type {result.dtype} can't be cast to the desired output type {out.dtype} "
                f"of {name}=; allocate {name} with dtype {result.dtype}."
            )
    for out, result in zip(outs, results, strict=True):
        out.copy_(result)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _outs_replaced(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with ``func``'s out arguments, in schema order, replaced by ``outs``."""
    new_args, new_kwargs = list(args), dict(kwargs)
    replacements = iter(outs)
    for index, argument in enumerate(func._schema.arguments):
        if argument.is_out:
            if argument.name in new_kwargs:
                new_kwargs[argument.name] = next(replacements)
            else:
                new_args[index] = next(replacements)
    return tuple(new_args), new_kwargs


def _check_outs(func: Any, names: list[str], outs: list[Any]) -> None:
    """Every out argument must be one DTensor (not a plain tensor, not a list)."""
    for name, value in zip(names, outs, strict=True):
        if isinstance(value, (list, tuple)):
            raise NotImplementedError(
                f"{func}: {name}= is a list of tensors; out= variants writing into tensor lists (the foreach "
                "ops' .out overloads) are not supported: call the functional overload and copy_ the results."
            )
        if not isinstance(value, DTensor):
            raise TypeError(
                f"{func}: {name}= is a {type(value).__name__}, not a DTensor, while the inputs are DTensors; "
                "pass a DTensor (e.g. torch.empty_like(expected_result)) to receive the sharded result."
            )

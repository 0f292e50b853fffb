"""Vector norms as partial values: ``linalg_vector_norm``, ``norm``, ``_foreach_norm`` and its kin.

A p-norm over a sharded dim is computed on each rank's piece and stays
``Partial("norm", p)`` (see [Note: norm partials] in
:mod:`hp_dtensor.placements`): nothing is gathered, and reading the value is
one all-reduce of a scalar per mesh dim. The 0-"norm" counts non-zeros, a
``Partial("sum")``. Dims that are not reduced keep their shards; a partial
input is reduced first, except a norm partial of the same ``p`` (the norm of
partial norms is the partial of the local norms). ``frobenius_norm`` and
``linalg_matrix_norm('fro')`` decompose into ``linalg_vector_norm``; the
matrix norms that need singular values (``'nuc'``, 2) gather.

Notes beside their code: [Note: clip_grad_norm_ as one partial],
[Note: whole-tensor foreach reductions], [Note: empty pieces].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import SPECIAL, Decision, LocalCall, OpCall, register
from hp_dtensor.ops.foreach import dispatch_foreach, element_positions
from hp_dtensor.ops.reductions import reduce_decision
from hp_dtensor.ops.strided import WholeDecision, reads_strided, reduces_whole
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["norm_partial", "vector_norm_decision"]

aten = torch.ops.aten
_INF = math.inf


def norm_partial(ord: float) -> Partial:
    """Where a p-norm's per-rank values sit: ``Partial("norm", p)``, or ``Partial("sum")`` for p = 0."""
    return Partial("sum") if ord == 0 else Partial("norm", float(ord))


def vector_norm_decision(
    layout: Layout, dims: list[int], keepdim: bool, ord: float
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(input, output) placements of a p-norm over ``dims`` of a tensor held under ``layout``."""
    kind = norm_partial(ord)
    # The cut of a sum (a reduced shard gives a partial, the others follow their dim), with a
    # partial input kept only when it is this norm's own (see [Note: norm partials]).
    inputs, out = reduce_decision(layout, dims, keepdim, "sum")
    for m, placement in enumerate(layout.placements):
        if isinstance(placement, Partial):
            keep = ord != 0 and placement == kind
            inputs[m] = out[m] = placement if keep else Replicate()
        elif isinstance(placement, Shard) and placement.dim in dims:
            out[m] = kind
    return tuple(inputs), tuple(out)


def _ord(value: Any) -> float:
    if value is None:
        return 2.0
    if isinstance(value, str):  # torch accepts 'inf' / '-inf' in a few places
        return float(value)
    return float(value)


def _dims(value: Any, ndim: int) -> list[int]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0) or ndim == 0:
        return list(range(ndim))
    if isinstance(value, int):
        value = [value]
    return sorted({int(d) % ndim for d in value})


def _identity(ord: float) -> float | None:
    """What an empty piece contributes (see [Note: empty pieces]); None when the op gives it already."""
    if ord == _INF:
        return 0.0
    if ord == -_INF or ord < 0:
        return _INF
    return None


def _parse(call: OpCall) -> tuple[float, Any, bool]:
    """(ord, dim, keepdim) of ``linalg_vector_norm`` and the ``norm`` overloads."""
    args, kwargs = call.args, call.kwargs
    if call.func is aten.linalg_vector_norm.default:
        ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    else:
        ord = args[1] if len(args) > 1 else kwargs.get("p", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = bool(args[3]) if len(args) > 3 else bool(kwargs.get("keepdim", False))
    return _ord(ord), dim, keepdim


# [Note: empty pieces]
# An uneven cut may leave a rank with no rows. The inf, -inf and negative-p
# norms of an empty tensor are undefined in torch (it raises), but as a term of
# a partial the empty piece contributes the reduction's identity: 0 for ``inf``
# (a max of norms), ``inf`` for ``-inf`` and for ``p < 0`` (whose ``inf**p`` is
# 0 in the sum). Other ``p`` give 0 on an empty tensor already.
def _empty_safe_kernel(ord: float, dims: list[int], keepdim: bool) -> Any:
    """The norm on this rank's piece, or the identity when a reduced dim is empty here."""
    fill = _identity(ord)

    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        if fill is None or all(x.shape[d] > 0 for d in dims):
            return call.func(*call.args, **call.kwargs)
        shape = (
            [1 if d in dims else s for d, s in enumerate(x.shape)]
            if keepdim
            else [s for d, s in enumerate(x.shape) if d not in dims]
        )
        dtype = call.kwargs.get("dtype") or torch.empty((), dtype=x.dtype).abs().dtype
        return torch.full(shape, fill, dtype=dtype, device=x.device)

    return run


def _check_defined(layout: Layout, dims: list[int], ord: float, func: Any) -> None:
    if _identity(ord) is not None and any(layout.shape[d] == 0 for d in dims):
        raise RuntimeError(
            f"{func}: the {ord} norm of a tensor of global shape {tuple(layout.shape)} reduces the empty "
            f"dim(s) {[d for d in dims if layout.shape[d] == 0]}, which is undefined (torch raises too); "
            "use a positive finite ord or a non-empty tensor."
        )


@register(
    aten.linalg_vector_norm.default,
    aten.norm.Scalar,
    aten.norm.ScalarOpt_dim,
    aten.norm.ScalarOpt_dim_dtype,
    aten.norm.ScalarOpt_dtype,
)
def vector_norm_rule(call: OpCall) -> Decision:
    """p-norms: sharded reduced dims give ``Partial("norm", p)``; other shards pass through."""
    position = call.positions[0]
    layout = call.layout(position)
    ord, dim, keepdim = _parse(call)
    if call.func in (aten.norm.Scalar, aten.norm.ScalarOpt_dtype):
        dim = None
    dims = _dims(dim, layout.ndim)
    _check_defined(layout, dims, ord, call.func)
    inputs, out = vector_norm_decision(layout, dims, keepdim, ord)
    kernel = None
    if _identity(ord) is not None and any(isinstance(p, Shard) and p.dim in dims for p in inputs):
        kernel = _empty_safe_kernel(ord, dims, keepdim)
    return Decision(inputs={position: inputs}, outputs=[out], kernel=kernel)


# [Note: whole-tensor foreach reductions]
# ``_foreach_max`` (the inf-norm building block of torch's foreach norm paths)
# and ``_foreach_powsum`` (``sum(|x|**p)``, the p-norm before its root) are
# whole-tensor reductions too: ``Partial("max")`` and ``Partial("sum")``, one
# all-reduce when read, never a gather. A ``StridedShard`` element is reduced
# as it is cut (``strided.reduces_whole``), so the rules read the placement.
def _foreach_whole_rule(decider: Callable[[OpCall], WholeDecision]) -> Callable[[OpCall], Decision]:
    """A foreach rule reducing each element to a scalar: ``decider(call)`` cuts every DTensor element.

    Built once per op at import: the mark of :func:`reads_strided` is kept on the rule object.
    """

    @reads_strided
    def rule(call: OpCall) -> Decision:
        decide = reduces_whole(decider(call))
        decision = Decision()
        elements, _ = element_positions(call.args)
        for element in elements:
            position = element[0]
            if not hasattr(call.flat[position], "_layout"):
                decision.outputs.append(None)
                continue
            inputs, out = decide(call.layout(position))
            decision.inputs[position] = tuple(inputs)
            decision.outputs.append(tuple(out))
        return decision

    return rule


def _foreach_norm_decision(call: OpCall) -> WholeDecision:
    ord = _ord(call.args[1] if len(call.args) > 1 else call.kwargs.get("ord", 2))

    def decide(layout: Layout) -> tuple[Sequence[Placement], Sequence[Placement]]:
        dims = list(range(layout.ndim))
        _check_defined(layout, dims, ord, call.func)
        return vector_norm_decision(layout, dims, False, ord)

    return decide


def _fill_empty(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fill: Callable[[torch.Tensor], Any] | None
) -> Any:
    """One local foreach call over the non-empty pieces; an empty piece gives ``fill(piece)``.

    See [Note: empty pieces]: an uneven cut may leave a rank an empty piece of
    an element whose reduction is undefined on empty tensors; as a term of a
    partial it contributes the reduction's identity.
    """
    tensors = list(args[0])
    empty = {i for i, t in enumerate(tensors) if t.numel() == 0}
    if fill is None or not empty:
        return func(*args, **kwargs)
    full = [tensors[i] for i in range(len(tensors)) if i not in empty]
    computed = iter(func(full, *args[1:], **kwargs) if full else [])
    return [fill(t) if i in empty else next(computed) for i, t in enumerate(tensors)]


def _foreach_norm_local(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One local ``_foreach_norm``; empty pieces give the identity (see [Note: empty pieces])."""
    value = _identity(_ord(args[1] if len(args) > 1 else kwargs.get("ord", 2)))
    if value is None:
        return func(*args, **kwargs)

    def fill(t: torch.Tensor) -> torch.Tensor:
        dtype = kwargs.get("dtype") or torch.empty((), dtype=t.dtype).abs().dtype
        return torch.full((), value, dtype=dtype, device=t.device)

    return _fill_empty(func, args, kwargs, fill)


_foreach_norm_rule = _foreach_whole_rule(_foreach_norm_decision)


# [Note: clip_grad_norm_ as one partial]
# ``clip_grad_norm_`` computes ``_foreach_norm(grads)``, stacks the norms and
# takes the norm of the stack, so ``stack`` keeps a partial shared by its
# inputs (a replicated input joins it locally) instead of reducing every norm
# on its own: the clip then costs one scalar all-reduce per mesh dim, the first
# time the total norm is used (``total_norm + 1e-6``), as in torch.
def _foreach_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return dispatch_foreach(
        aten._foreach_norm.Scalar,
        args,
        kwargs,
        _foreach_norm_rule,
        output_shape=lambda layout: ((), ()),
        local_run=_foreach_norm_local,
    )


def _max_decision(layout: Layout) -> tuple[Sequence[Placement], Sequence[Placement]]:
    if 0 in layout.shape:
        raise RuntimeError(
            f"_foreach_max: an element has global shape {tuple(layout.shape)} (no elements), whose maximum "
            "is undefined (torch raises too); leave empty tensors out of the list."
        )
    return reduce_decision(layout, list(range(layout.ndim)), False, "max", empty_ok=True)


def _lowest(t: torch.Tensor) -> torch.Tensor:
    """The identity of a max over ``t``'s dtype: what an empty piece contributes."""
    if t.dtype == torch.bool:
        value: Any = False
    elif t.dtype.is_floating_point:
        value = -_INF
    else:
        value = torch.iinfo(t.dtype).min
    return torch.full((), value, dtype=t.dtype, device=t.device)


_foreach_max_rule = _foreach_whole_rule(lambda call: _max_decision)


def _foreach_max(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_foreach_max(tensors)``: each element's maximum stays ``Partial("max")`` over its shards.

    Nothing is gathered; the per-rank maxima are combined by one all-reduce
    when the value is read (``clip_grad_norm_``-style inf norms reduce the
    stack of them together). An empty piece contributes the dtype's lowest value.
    """
    return dispatch_foreach(
        aten._foreach_max.default,
        args,
        kwargs,
        _foreach_max_rule,
        output_shape=lambda layout: ((), ()),
        local_run=lambda func, a, k: _fill_empty(func, a, k, _lowest),
    )


def _powsum_decision(layout: Layout) -> tuple[Sequence[Placement], Sequence[Placement]]:
    return reduce_decision(layout, list(range(layout.ndim)), False, "sum")


_foreach_powsum_rule = _foreach_whole_rule(lambda call: _powsum_decision)


def _foreach_powsum(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_foreach_powsum(tensors, ord)``: ``sum(|x|**ord)`` is a sum over pieces, so ``Partial("sum")``.

    It is linear in the pieces for every ``ord`` (0 and inf included, as
    torch computes them elementwise), and an empty piece sums to 0.
    """
    return dispatch_foreach(
        aten._foreach_powsum.Scalar,
        args,
        kwargs,
        _foreach_powsum_rule,
        output_shape=lambda layout: ((), ()),
    )


SPECIAL[aten._foreach_max.default] = _foreach_max
SPECIAL[aten._foreach_powsum.Scalar] = _foreach_powsum
SPECIAL[aten._foreach_norm.Scalar] = _foreach_norm

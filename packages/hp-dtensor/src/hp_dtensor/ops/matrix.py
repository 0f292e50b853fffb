"""Matrix products as contractions: mm, bmm, mv, dot, vdot and their ``add*`` forms.

Every op here is an einsum with one letter per dim: ``mm`` is ``mk,kn->mn``,
``bmm`` ``bmk,bkn->bmn``, ``mv`` ``mk,k->m``, ``dot`` ``k,k->``, ``addr``'s
outer product ``m,n->mn``, ``addbmm``'s ``bmk,bkn->mn`` (the batch is summed
too). ``torch.matmul`` in every shape torch accepts, ``einsum``,
``tensordot``, ``linalg.vecdot`` and ``outer`` decompose into these, views
and pointwise ops. Per mesh dim, one shard decides the others ([Note: one
shard decides the others], [Note: contraction placements]); partial
operands and the ``add*`` bias need no communication ([Note: partial
operands and the bias term]).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["contraction_placements", "inplace_add_product_rule"]

aten = torch.ops.aten
R = Replicate()
SUM = Partial("sum")
_LINEAR = ("sum", "avg")


def _move_cost(src: Placement, dst: Placement, numel: int, ranks: int) -> float:
    """Elements received per rank to move a tensor of ``numel`` elements from ``src`` to ``dst``."""
    if src == dst or isinstance(src, Replicate):
        return 0.0  # a replicated value is cut, or made partial, locally
    if isinstance(src, Shard):
        return numel / ranks if isinstance(dst, Shard) else float(numel)
    return float(numel) if isinstance(dst, Shard) else 2.0 * numel


# [Note: one shard decides the others]
# =======================  ==========================  ==============
# a shard of letter L      the other operand           output
# =======================  ==========================  ==============
# L in both and the out    the same letter cut         ``Shard(L)``
# L in one operand + out   replicated                  ``Shard(L)``
# L in both, not the out   the same letter cut         ``Partial``
# =======================  ==========================  ==============
def _follow(
    letters: tuple[str, str, str], side: int, placement: Placement
) -> tuple[Placement, Placement, Placement] | None:
    """(a, b, out) when operand ``side`` keeps ``placement``; None when no row of the table fits."""
    own, other, out = letters[side], letters[1 - side], letters[2]
    if isinstance(placement, Shard):
        letter = own[placement.dim]
        partner: Placement = Shard(other.index(letter)) if letter in other else R
        if letter in out:
            result: Placement = Shard(out.index(letter))
        elif letter in other:
            result = SUM
        else:
            return None  # summed within one operand: not an op of this module
    elif isinstance(placement, Partial) and placement.reduce_op in _LINEAR:
        partner, result = R, placement
    else:
        return None
    return (placement, partner, result) if side == 0 else (partner, placement, result)


def _from_out(letters: tuple[str, str, str], placement: Placement) -> tuple[Placement, Placement, Placement]:
    """(a, b, out) when the output takes ``placement``: each operand cut on the output's letter."""
    if isinstance(placement, Shard):
        letter = letters[2][placement.dim]
        a: Placement = Shard(letters[0].index(letter)) if letter in letters[0] else R
        b: Placement = Shard(letters[1].index(letter)) if letter in letters[1] else R
        return a, b, placement
    return placement, R, placement  # a linear partial: one operand carries the terms


# [Note: partial operands and the bias term]
# A ``Partial("sum")`` / ``Partial("avg")`` operand times a replicated one
# stays partial (the product is linear in each operand). The ``add*`` forms
# cut their ``self`` term (the bias) like the product, or make it partial to
# match a partial product (one rank keeps it: see
# :func:`hp_dtensor.redistribute._to_partial`), so ``beta * self + alpha *
# product`` is formed term by term with no communication.
def _bias_target(out: Placement, bias_shape: tuple[int, ...], out_ndim: int) -> Placement:
    """The ``self`` term of an ``add*`` op, broadcast to the product: cut or partial like it."""
    if isinstance(out, Shard):
        dim = out.dim - (out_ndim - len(bias_shape))
        return Shard(dim) if dim >= 0 and bias_shape[dim] != 1 else R
    return out


def _bias_proposal(bias: Placement, bias_shape: tuple[int, ...], out_ndim: int) -> Placement | None:
    """The output placement that lets the ``self`` term stay where it is, or None."""
    if isinstance(bias, Shard):
        if bias_shape[bias.dim] == 1:
            return None  # a broadcast dim: the output is not cut like it
        return Shard(bias.dim + out_ndim - len(bias_shape))
    if isinstance(bias, Partial) and bias.reduce_op in _LINEAR:
        return bias
    return None


# [Note: contraction placements]
# Each mesh dim is decided on its own. The candidates are: keep ``a``'s
# placement (and derive ``b``'s and the output's from the table of
# [Note: one shard decides the others]), keep
# ``b``'s, keep the ``self`` term's of an ``add*`` op (the output is cut like
# it, or partial like it, and the operands follow the output's letter: so
# ``addmm(bias S(0), mat1 R, mat2 R)`` cuts ``mat1`` by rows locally), or
# replicate everything. The one whose input moves (the ``self`` term's included) cost fewest
# elements received wins (a replicated input is cut for free; a shard gathered costs
# its size; an all-to-all its size over the mesh dim; a partial reduced twice
# its size, as an all-reduce does), so ``S(1) @ S(0)`` is a partial sum with
# no communication and, when both operands must move, the smaller one does.
# Ties go to a sharded output over a partial one over a replicated one, then
# to ``a``'s shard.
def contraction_placements(
    letters: tuple[str, str, str],
    a: Placement,
    b: Placement,
    sizes: tuple[int, int],
    ranks: int,
    bias: tuple[Placement, tuple[int, ...]] | None = None,
) -> tuple[Placement, Placement, Placement, Placement | None]:
    """Target (a, b, out, self) placements on one mesh dim for the contraction ``letters`` (``a,b->out``).

    ``sizes`` are the operands' element counts and ``ranks`` the mesh dim's
    size, for the cost of moving them (see [Note: contraction placements]).
    ``bias`` is the ``self`` term of an ``add*`` op (its placement and global
    shape), whose move counts too and which may propose the output's cut; the
    last entry is its target (None without one).
    """
    candidates = [c for c in (_follow(letters, 0, a), _follow(letters, 1, b)) if c is not None]
    if bias is not None:
        proposal = _bias_proposal(bias[0], bias[1], len(letters[2]))
        if proposal is not None:
            candidates.append(_from_out(letters, proposal))
    candidates.append((R, R, R))

    def bias_of(out: Placement) -> Placement | None:
        return None if bias is None else _bias_target(out, bias[1], len(letters[2]))

    def key(item: tuple[int, tuple[Placement, Placement, Placement]]) -> tuple[float, int, int]:
        index, (ta, tb, out) = item
        cost = _move_cost(a, ta, sizes[0], ranks) + _move_cost(b, tb, sizes[1], ranks)
        target = bias_of(out)
        if bias is not None and target is not None:
            cost += _move_cost(bias[0], target, math.prod(bias[1]), ranks)
        rank = 0 if isinstance(out, Shard) else 1 if isinstance(out, Partial) else 2
        return cost, rank, index

    ta, tb, out = min(enumerate(candidates), key=key)[1]
    return ta, tb, out, bias_of(out)


def _contract(
    call: OpCall, a_arg: Any, b_arg: Any, letters: tuple[str, str, str], bias_arg: Any = None
) -> tuple[dict[int, tuple[Placement, ...]], tuple[Placement, ...]]:
    """Input targets and output placements of ``a_arg`` x ``b_arg`` (+ ``bias_arg``) over every mesh dim."""
    pa, pb = call.position_of(a_arg), call.position_of(b_arg)
    la, lb = call.layout(pa), call.layout(pb)
    lbias = call.layout(call.position_of(bias_arg)) if bias_arg is not None else None
    sizes = (a_arg.numel(), b_arg.numel())
    ta: list[Placement] = []
    tb: list[Placement] = []
    tbias: list[Placement] = []
    out: list[Placement] = []
    for m in range(la.mesh.ndim):
        bias = (lbias.placements[m], tuple(lbias.shape)) if lbias is not None else None
        x, y, z, w = contraction_placements(
            letters, la.placements[m], lb.placements[m], sizes, la.mesh.shape[m], bias
        )
        ta.append(x)
        tb.append(y)
        out.append(z)
        if w is not None:
            tbias.append(w)
    inputs = {pa: tuple(ta), pb: tuple(tb)}
    if bias_arg is not None:
        inputs[call.position_of(bias_arg)] = tuple(tbias)
    return inputs, tuple(out)


def _all_dtensors(call: OpCall, *indices: int) -> bool:
    from hp_dtensor.dtensor import DTensor

    return all(isinstance(call.args[i], DTensor) for i in indices)


_PRODUCTS: dict[Any, tuple[str, str, str]] = {
    aten.mm.default: ("mk", "kn", "mn"),
    aten.bmm.default: ("bmk", "bkn", "bmn"),
    aten.mv.default: ("mk", "k", "m"),
    aten.dot.default: ("k", "k", ""),
    aten.vdot.default: ("k", "k", ""),
}

_ADD_PRODUCTS: dict[Any, tuple[str, str, str]] = {
    aten.addmm.default: ("mk", "kn", "mn"),
    aten.baddbmm.default: ("bmk", "bkn", "bmn"),
    aten.addbmm.default: ("bmk", "bkn", "mn"),
    aten.addmv.default: ("mk", "k", "m"),
    aten.addr.default: ("m", "n", "mn"),
}


@register(*_PRODUCTS)
def product_rule(call: OpCall) -> Decision | None:
    """``a @ b`` for mm, bmm, mv, dot and vdot: the table in the module docstring."""
    if not _all_dtensors(call, 0, 1):
        return None
    inputs, out = _contract(call, call.args[0], call.args[1], _PRODUCTS[call.func])
    return Decision(inputs=inputs, outputs=[out])


@register(*_ADD_PRODUCTS)
def add_product_rule(call: OpCall) -> Decision | None:
    """``beta * self + alpha * (a @ b)``: the product's placement; ``self`` cut or made partial to match."""
    if not _all_dtensors(call, 1, 2):
        return None
    bias = call.args[0] if _all_dtensors(call, 0) else None
    inputs, out = _contract(call, call.args[1], call.args[2], _ADD_PRODUCTS[call.func], bias)
    return Decision(inputs=inputs, outputs=[out])


# [Note: in-place add products]
# ``addmm_`` and its kin write ``beta * self + alpha * (a @ b)`` into ``self``,
# so the product must come out placed as ``self`` already is: an in-place op
# that changed its argument's placement would change a tensor the caller
# holds (a parameter, a buffer) behind their back, which torch's DTensor
# refuses too. Per mesh dim the out-of-place plan is kept when its output is
# ``self``'s placement (``self`` stays put, as the bias term's target is then
# its own placement); otherwise the operands are placed for that output (cut
# on the output's letter, or a linear partial carried by ``a``), which never
# moves ``self``. A ``self`` that is a max / min / product partial cannot be
# written term by term: refused, naming the fix.
_INPLACE_ADD_PRODUCTS: dict[Any, Any] = {
    aten.addmm_.default: aten.addmm.default,
    aten.baddbmm_.default: aten.baddbmm.default,
    aten.addbmm_.default: aten.addbmm.default,
    aten.addmv_.default: aten.addmv.default,
    aten.addr_.default: aten.addr.default,
}


def _inplace_targets(
    letters: tuple[str, str, str],
    own: Placement,
    chosen: tuple[Placement, Placement, Placement, Placement | None],
) -> tuple[Placement, Placement]:
    """Operand targets on one mesh dim that make the product land on ``self``'s placement ``own``."""
    ta, tb, out, _ = chosen
    if out == own:
        return ta, tb
    ta, tb, _ = _from_out(letters, own)
    return ta, tb


@register(*_INPLACE_ADD_PRODUCTS)
def inplace_add_product_rule(call: OpCall) -> Decision | None:
    """``self.addmm_(a, b)`` and kin: the out-of-place plan with the output on ``self``'s placement.

    See [Note: in-place add products].
    """
    if not _all_dtensors(call, 0, 1, 2):
        return None
    letters = _ADD_PRODUCTS[_INPLACE_ADD_PRODUCTS[call.func]]
    own = call.layout(call.position_of(call.args[0]))
    for placement in own.placements:
        if isinstance(placement, Partial) and placement.reduce_op not in _LINEAR:
            raise ValueError(
                f"{call.func}: self has placements {list(own.placements)}; a {placement} value cannot take "
                "beta * self + alpha * product term by term. Redistribute self to Shard/Replicate (or a "
                "sum partial) first, or use the out-of-place op."
            )
    pa, pb = call.position_of(call.args[1]), call.position_of(call.args[2])
    la, lb = call.layout(pa), call.layout(pb)
    sizes = (call.args[1].numel(), call.args[2].numel())
    ta: list[Placement] = []
    tb: list[Placement] = []
    for m, placement in enumerate(own.placements):
        bias = (placement, tuple(own.shape))
        a, b = la.placements[m], lb.placements[m]
        chosen = contraction_placements(letters, a, b, sizes, la.mesh.shape[m], bias)
        x, y = _inplace_targets(letters, placement, chosen)
        ta.append(x)
        tb.append(y)
    inputs = {pa: tuple(ta), pb: tuple(tb), call.position_of(call.args[0]): own.placements}
    return Decision(inputs=inputs, outputs=[own.placements], inplace=True)

"""What op rules see of ``StridedShard`` inputs ([Note: rules and strided shards]).

The dispatcher asks a rule through :func:`decide`. Rules marked with
:func:`reads_strided` (the shape ops of :mod:`hp_dtensor.ops.views`) see
``StridedShard`` as it is and may produce it. Elementwise ops and the plain
reductions see it as the ``Shard`` of the same dim and their answer is
mapped back. Every other rule sees a replicated input there, and the input is
moved to whatever that rule asked for a replicated input: such a rule never
has to know the placement, and cannot misread it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from torch.utils import _pytree as pytree

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout, chunk_sizes, strided_sizes
from hp_dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard

if TYPE_CHECKING:
    from hp_dtensor.ops.calls import Decision, OpCall

__all__ = [
    "ELEMENTWISE_RULES",
    "STRIDED_RULES",
    "decide",
    "elementwise",
    "reads_strided",
    "reduces_whole",
]

Rule = Callable[["OpCall"], "Decision | None"]
# A rule keeps its own signature (extra keywords such as ``inplace=``) through the marking decorators.
AnyRule = TypeVar("AnyRule", bound=Callable[..., Any])

STRIDED_RULES: set[Any] = set()  # rules that read (and may produce) StridedShard themselves
ELEMENTWISE_RULES: set[Any] = set()  # rules that see StridedShard as the Shard of the same dim


def reads_strided(rule: AnyRule) -> AnyRule:
    """Mark ``rule`` as one that handles ``StridedShard`` inputs and may produce the placement."""
    STRIDED_RULES.add(rule)
    return rule


def elementwise(rule: AnyRule) -> AnyRule:
    """Mark ``rule`` elementwise: it sees ``StridedShard(d, k)`` as ``Shard(d)``, its answer mapped back.

    A mark on the rule object rather than a name, so that every wrapper
    (``lambda call: pointwise_rule(call, inplace=True)``) declares it too:
    an unmarked wrapper would take the replicated road and gather.
    """
    ELEMENTWISE_RULES.add(rule)
    return rule


# [Note: rules and strided shards]
# ``StridedShard`` is produced by views that merge a cut inner dim (see [Note:
# strided shards] in :mod:`hp_dtensor.placements`). Most rules test
# ``isinstance(p, Shard)`` and ``Partial`` and pass anything else through as
# it is, which for a strided cut would be wrong (a transpose must move its dim,
# a full reduction must not keep it). So :func:`decide` stands between the
# dispatcher and every rule:
#
# * a rule marked :func:`reads_strided` gets the call as it is;
# * an elementwise rule (marked :func:`elementwise`: ``pointwise_rule`` and
#   every wrapper of it), or a sum / mean / amax / amin / any / all /
#   vector norm, sees ``Shard(d)`` for ``StridedShard(d, k)``, and every
#   ``Shard`` it then names on that mesh dim is read back as
#   ``StridedShard(_, k)``: such ops treat every element (or every row of the
#   cut dim) alike, so any one assignment of rows to ranks, the same for every
#   operand and the result, is as good as another. Operands may broadcast:
#   the elementwise rule cuts an operand only on a dim of the output's size
#   (one of size 1, or a missing one, stays whole), so every cut it names on
#   that mesh dim splits a dim of one size with one factor, the same rows.
#   Dims are compared as broadcasting aligns them (from the right); two
#   strided cuts of different output dims or factors on one mesh dim take
#   the replicated road below, and so does a second cut of the strided
#   output dim on another mesh dim, except, for an elementwise rule, a plain
#   ``Shard`` on a higher mesh dim (torch's FSDP2 + TP layout
#   ``[StridedShard(0, k), Shard(0)]``): the rule cuts every operand of that
#   dim alike on each mesh dim, so all of them read back to that same valid
#   layout and hold the same elements; a reduction would read the nested
#   pieces' sizes wrongly. A reduction of every element (the foreach norms)
#   reads a strided cut through :func:`reduces_whole`.
#   A mean, max or min over the strided dim itself also reads the pieces'
#   sizes (a mean keeps ``Partial("avg")`` on equal pieces only), so it takes
#   this road only when the strided pieces have ``torch.chunk``'s sizes.
# * any other rule sees ``Replicate()`` on that mesh dim, and the input is
#   redistributed to the placements the rule asked for a replicated input
#   (kept replicated when it named none): an all-gather plus a reorder, which
#   is what the view that made the placement used to cost, now paid only by
#   the consumer that needs it.
#
# Decisions are cached by layouts, and the answer depends on the layouts
# alone, so caching holds.
def decide(rule: Rule, call: OpCall) -> Decision | None:
    """``rule``'s decision for ``call``, with ``StridedShard`` inputs shown as the rule can read them."""
    if rule in STRIDED_RULES:
        return rule(call)
    strided = [p for p in call.positions if _strided_dims(call.layout(p))]
    if not strided:
        return rule(call)
    if _reads_as_shard(rule, call):
        decision = _as_shard(rule, call, strided)
        if decision is None or _sizes_hold(rule, call, decision):
            return decision
    return _as_replicated(rule, call, strided)


# How a reduction of every element of one tensor is cut: (input, output) placements from its layout.
WholeDecision = Callable[[Layout], tuple[Sequence[Placement], Sequence[Placement]]]


def reduces_whole(decide: WholeDecision) -> WholeDecision:
    """``decide`` for a reduction over every element, reading ``StridedShard(d, k)`` as ``Shard(d)``.

    A reduction over all elements (``_foreach_norm``, ``_foreach_max``,
    ``_foreach_powsum``) does not care which rank holds which rows, only that
    the pieces split the tensor, as a strided cut's pieces do (its rows are a
    permutation of a plain cut's): so the rule reasons about the plain cut, and
    an input it keeps cut keeps its strided cut, nothing moved. Its output is
    a 0-d value, which no cut can name.
    """

    def run(layout: Layout) -> tuple[Sequence[Placement], Sequence[Placement]]:
        if not _strided_dims(layout):
            return decide(layout)
        shown = tuple(Shard(p.dim) if isinstance(p, StridedShard) else p for p in layout.placements)
        inputs, out = decide(Layout(layout.mesh, shown, layout.shape, layout.stride))
        pairs = zip(layout.placements, shown, inputs, strict=True)
        return [real if asked == seen else asked for real, seen, asked in pairs], out

    return run


def _strided_dims(layout: Layout) -> dict[int, StridedShard]:
    return {m: p for m, p in enumerate(layout.placements) if isinstance(p, StridedShard)}


def _shard_like_rules() -> tuple[set[Any], set[Any]]:
    """(elementwise rules, reduction rules) that may see a ``StridedShard`` as a ``Shard``."""
    from hp_dtensor.ops.reductions import amax_rule, amin_rule, any_all_rule, mean_rule, sum_rule
    from hp_dtensor.ops.vector_norms import vector_norm_rule

    return ELEMENTWISE_RULES, {sum_rule, mean_rule, amax_rule, amin_rule, any_all_rule, vector_norm_rule}


def _reads_as_shard(rule: Rule, call: OpCall) -> bool:
    elementwise, reductions = _shard_like_rules()
    if rule not in elementwise and rule not in reductions:
        return False
    layouts = [call.layout(p) for p in call.positions]
    # Dims counted from the right, as broadcasting aligns them: -1 is every operand's last dim.
    rank = max(layout.ndim for layout in layouts)
    for m in range(layouts[0].mesh.ndim):
        strided = {
            (_out_dim(layout, p, rank), p.split_factor)
            for layout in layouts
            if isinstance(p := layout.placements[m], StridedShard)
        }
        if len(strided) > 1:
            return False  # two strided cuts on one mesh dim: no one Shard view fits both
        if not strided:
            continue
        ((dim, _),) = strided
        for layout in layouts:
            for i, p in enumerate(layout.placements):
                if i == m or not isinstance(p, Shard | StridedShard) or _out_dim(layout, p, rank) != dim:
                    continue
                if rule in elementwise and i > m and isinstance(p, Shard):
                    continue  # a plain cut above the strided one (FSDP2 + TP): see the note
                return False  # nested cuts of one dim: the shard view would change the rows
    return True


def _out_dim(layout: Layout, cut: Shard | StridedShard, rank: int) -> int:
    """The dim ``cut`` cuts, numbered in a broadcast output of ``rank`` dims (aligned from the right)."""
    return cut.dim + rank - layout.ndim


def _sizes_hold(rule: Rule, call: OpCall, decision: Decision) -> bool:
    """Whether a reduction that made a strided dim partial saw the pieces' true sizes.

    The reduction rules read the sizes of a reduced cut (a mean stays
    ``Partial("avg")`` only on equal pieces, a max needs no empty one); under
    the ``Shard`` view they read ``torch.chunk``'s, so those must be the
    strided pieces' sizes. A dim that is not reduced keeps its cut and its
    sizes do not matter.
    """
    if rule not in _shard_like_rules()[1]:
        return True
    layout = call.layout(call.positions[0])
    out = decision.outputs[0] or ()
    for m, cut in _strided_dims(layout).items():
        if m < len(out) and (isinstance(out[m], StridedShard) or _size_blind(out[m])):
            continue  # a kept cut, or a sum or norm of the pieces, whatever their sizes
        size, n = layout.shape[cut.dim], layout.mesh.size(m)
        if strided_sizes(size, cut.split_factor, n) != chunk_sizes(size, n):
            return False
    return True


def _size_blind(placement: Placement) -> bool:
    """A partial that reads no piece's size: a sum, or a p-norm (whose kernel fills empty pieces itself)."""
    return isinstance(placement, Partial) and placement.reduce_op in ("sum", "norm")


def _as_shard(rule: Rule, call: OpCall, strided: list[int]) -> Decision | None:
    factors: dict[int, int] = {}
    shown: dict[int, tuple[Placement, ...]] = {}
    for p in strided:
        layout = call.layout(p)
        for m, cut in _strided_dims(layout).items():
            factors[m] = cut.split_factor
        shown[p] = tuple(Shard(x.dim) if isinstance(x, StridedShard) else x for x in layout.placements)
    decision = rule(_with_placements(call, shown))
    if decision is None:
        return None

    def back(placements: tuple[Placement, ...] | None) -> tuple[Placement, ...] | None:
        if placements is None:
            return None
        return tuple(
            StridedShard(x.dim, factors[m]) if factors.get(m, 1) > 1 and isinstance(x, Shard) else x
            for m, x in enumerate(placements)
        )

    inputs = {p: back(t) for p, t in decision.inputs.items()}
    return dataclasses.replace(
        decision,
        inputs={p: t for p, t in inputs.items() if t is not None},
        outputs=[back(t) for t in decision.outputs],
    )


def _as_replicated(rule: Rule, call: OpCall, strided: list[int]) -> Decision | None:
    shown = {
        p: tuple(Replicate() if isinstance(x, StridedShard) else x for x in call.layout(p).placements)
        for p in strided
    }
    decision = rule(_with_placements(call, shown))
    if decision is None:
        return None
    inputs = dict(decision.inputs)
    for p, placements in shown.items():
        inputs.setdefault(p, placements)  # "stays as it is" meant replicated: move it there
    return dataclasses.replace(decision, inputs=inputs)


def _with_placements(call: OpCall, shown: dict[int, tuple[Placement, ...]]) -> OpCall:
    """``call`` with the DTensors at ``shown``'s positions relabelled (same local tensor, other placements).

    Only the rule sees these stand-ins; the dispatcher moves the real inputs.
    """
    flat = list(call.flat)
    swap: dict[int, DTensor] = {}
    for p, placements in shown.items():
        real = flat[p]
        layout = real._layout
        stand_in = DTensor(real._local, Layout(layout.mesh, placements, layout.shape, layout.stride))
        flat[p] = stand_in
        swap[id(real)] = stand_in
    args, kwargs = pytree.tree_map(lambda v: swap.get(id(v), v), (call.args, call.kwargs))
    return dataclasses.replace(call, args=args, kwargs=kwargs, flat=flat)

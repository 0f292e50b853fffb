"""Ops that move elements only along the dims they name: flip, roll, pad, scatters, cross, glu.

Each of these reads and writes along a few named dims and treats every
other index independently, so a shard of any other dim is the answer for
its own rows: the op runs on each piece with no communication. Only a
named dim that is cut is gathered first (a flip of a cut dim would need
the other rank's rows). torch's DTensor sends nothing in the same cases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hp_dtensor.dtensor import DTensor
from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.ops.pad_halo import pad_kernel, plan_pads
from hp_dtensor.ops.pointwise import pointwise_rule
from hp_dtensor.ops.views import covers, map_dims
from hp_dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["linear_placements"]

aten = torch.ops.aten


def _keep_all_but(call: OpCall, named: set[int]) -> Decision:
    """The first tensor's shards survive except on ``named`` dims, which are gathered."""
    ndim = call.layout(call.positions[0]).ndim
    return map_dims(call, [None if d in named else d for d in range(ndim)], ndim)


def _arg(call: OpCall, index: int, name: str, default: object) -> object:
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


@register(aten.flip.default)
def flip_rule(call: OpCall) -> Decision:
    """``flip(dims)``: only the flipped dims must be whole."""
    ndim = call.layout(call.positions[0]).ndim
    dims = _arg(call, 1, "dims", ())
    assert isinstance(dims, (list, tuple))
    return _keep_all_but(call, {int(d) % max(ndim, 1) for d in dims})


@register(aten.roll.default)
def roll_rule(call: OpCall) -> Decision:
    """``roll(shifts, dims)``: a dim rolled by a nonzero amount must be whole (no dims: the flat tensor)."""
    layout = call.layout(call.positions[0])
    ndim = layout.ndim
    shifts = _arg(call, 1, "shifts", ())
    dims = _arg(call, 2, "dims", ())
    assert isinstance(shifts, (list, tuple)) and isinstance(dims, (list, tuple))
    if not dims:
        return _keep_all_but(call, set(range(ndim)))
    named = set()
    for shift, dim in zip(shifts, dims, strict=True):
        d = int(dim) % max(ndim, 1)
        if layout.shape[d] and int(shift) % layout.shape[d]:
            named.add(d)
    return _keep_all_but(call, named)


@register(aten.rot90.default)
def rot90_rule(call: OpCall) -> Decision:
    """``rot90(k, dims=[a, b])``: a flip of one or both dims plus a swap of ``a`` and ``b``.

    ``k = 1`` is ``flip(b)`` then ``transpose(a, b)``, so a shard of ``a``
    moves to ``b`` untouched; ``k = 3`` is ``flip(a)`` then the transpose, so
    a shard of ``b`` moves to ``a``; ``k = 2`` flips both; ``k = 0`` is a copy.
    """
    ndim = call.layout(call.positions[0]).ndim
    k = int(_arg(call, 1, "k", 1)) % 4  # type: ignore[call-overload]
    dims = _arg(call, 2, "dims", (0, 1))
    assert isinstance(dims, (list, tuple))
    a, b = (int(d) % max(ndim, 1) for d in dims)
    mapping: list[int | None] = list(range(ndim))
    if k == 1:
        mapping[a], mapping[b] = b, None
    elif k == 2:
        mapping[a] = mapping[b] = None
    elif k == 3:
        mapping[a], mapping[b] = None, a
    return map_dims(call, mapping, ndim)


@register(aten.constant_pad_nd.default)
def constant_pad_rule(call: OpCall) -> Decision:
    """``constant_pad_nd(pad)``: pads pair up from the last dim back; a padded (cropped) dim that is cut
    takes its neighbours' few border rows and stays cut (:mod:`hp_dtensor.ops.pad_halo`), or is gathered
    where the pad reaches past a neighbour's piece."""
    position = call.positions[0]
    layout = call.layout(position)
    pad = _arg(call, 1, "pad", ())
    assert isinstance(pad, (list, tuple))
    named = {layout.ndim - 1 - i // 2 for i, amount in enumerate(pad) if int(amount)}
    decision = _keep_all_but(call, named)
    value = _arg(call, 2, "value", 0)
    if value:  # a fill value counts once per rank in a sum (or norm) partial: reduce those first
        kept_partials = tuple(
            Replicate() if isinstance(p, Partial) and p.reduce_op not in ("avg", "max", "min") else p
            for p in decision.inputs[position]
        )
        decision = Decision(inputs={position: kept_partials}, outputs=[kept_partials])
    plans = plan_pads(layout, pad) if 0 < len(pad) <= 2 * layout.ndim and len(pad) % 2 == 0 else {}
    if not plans:
        return decision
    kept = list(decision.inputs[position])
    for m, (plan, _) in plans.items():
        kept[m] = Shard(plan.dim)
    placements = tuple(kept)
    return Decision(
        inputs={position: placements},
        outputs=[placements],
        kernel=pad_kernel([plans[m] for m in sorted(plans)]),
    )


@register(aten.select_scatter.default, aten.slice_scatter.default)
def scatter_rule(call: OpCall) -> Decision:
    """Write ``src`` into one index (select) or a slice of one dim of ``self``.

    ``src`` is ``self``'s selection, so each rank writes its own rows of it
    into its own rows of ``self``: a shard of another dim is kept on both
    (``src`` lacks the selected dim for ``select_scatter``). The written dim
    must be whole, unless a slice covers all of it (then ``src`` is cut the
    same way). A plain ``src`` is whole, so ``self`` is gathered to meet it;
    a partial is summed first (``src`` would be counted once per rank).
    """
    self_pos = call.positions[0]
    layout = call.layout(self_pos)
    ndim = layout.ndim
    select = call.func is aten.select_scatter.default
    dim = int(_arg(call, 2, "dim", 0)) % max(ndim, 1)  # type: ignore[call-overload]
    src = _arg(call, 1, "src", None)
    whole = not select and covers(
        _arg(call, 3, "start", None),  # type: ignore[arg-type]
        _arg(call, 4, "end", None),  # type: ignore[arg-type]
        _arg(call, 5, "step", 1),  # type: ignore[arg-type]
        layout.shape[dim] if ndim else 1,
    )
    src_layout = src._layout if isinstance(src, DTensor) else None
    targets: list[Placement] = []
    src_targets: list[Placement] = []
    for m, placement in enumerate(layout.placements):
        keep = isinstance(placement, Shard) and (placement.dim != dim or whole) and src_layout is not None
        if keep and src_layout is not None and isinstance(src_layout.placements[m], Partial):
            keep = False
        if keep:
            assert isinstance(placement, Shard)
            targets.append(placement)
            src_targets.append(Shard(placement.dim - (select and placement.dim > dim)))
        else:
            targets.append(Replicate())
            src_targets.append(Replicate())
    inputs = {self_pos: tuple(targets)}
    if src_layout is not None:
        inputs[call.position_of(src)] = tuple(src_targets)
    return Decision(inputs=inputs, outputs=[tuple(targets)])


@register(aten.slice_backward.default, aten.select_backward.default)
def slice_backward_rule(call: OpCall) -> Decision:
    """``slice_backward(grad, input_sizes, dim, ...)`` / ``select_backward``: zeros with ``grad`` written in.

    Only ``dim`` changes size, so every other dim keeps ``grad``'s shard and
    ``input_sizes`` is made local (``size_arg``); a shard of ``dim`` is
    gathered. The op is linear: a partial sum stays partial. (A ``select``
    removed ``dim`` from ``grad``: its cuts of later dims move up by one.)
    """
    layout = call.layout(call.positions[0])
    ndim = len(call.args[1])
    dim = int(call.args[2]) % max(ndim, 1)
    selected = call.func is aten.select_backward.default

    def moved(p: Shard) -> int | None:
        out_dim = p.dim + 1 if selected and p.dim >= dim else p.dim
        return None if out_dim == dim else out_dim

    inputs, outputs = linear_placements(layout.placements, moved)
    return Decision(inputs={call.positions[0]: inputs}, outputs=[outputs], size_arg=1)


def linear_placements(
    placements: Sequence[Placement], moved: Callable[[Shard], int | None]
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(inputs, outputs) per mesh dim for a linear op that moves tensor dims.

    A cut stays a cut of dim ``moved(cut)`` (None: the op reads across it, so
    it is gathered); sum / avg partials pass (the op is linear); anything else
    is gathered.
    """
    inputs: list[Placement] = []
    outputs: list[Placement] = []
    for p in placements:
        out_dim = moved(p) if isinstance(p, Shard) else None
        if out_dim is not None:
            inputs.append(p)
            outputs.append(Shard(out_dim))
        elif isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            inputs.append(p)
            outputs.append(p)
        else:
            inputs.append(Replicate())
            outputs.append(Replicate())
    return tuple(inputs), tuple(outputs)


@register(aten.linalg_cross.default)
def cross_rule(call: OpCall) -> Decision:
    """``linalg_cross(a, b, dim)``: pointwise (broadcast) but along ``dim``, which must be whole.

    Each output vector reads the two input vectors at its own index of the
    other dims, so their shards pass as for a pointwise op; a mesh dim that
    would cut the 3-vectors themselves is gathered.
    """
    ndim = max(call.layout(p).ndim for p in call.positions)
    dim = int(_arg(call, 2, "dim", -1)) % max(ndim, 1)  # type: ignore[call-overload]

    def cuts_vectors(position: int) -> int:
        layout = call.layout(position)
        return sum(isinstance(p, Shard) and p.dim + ndim - layout.ndim == dim for p in layout.placements)

    # pointwise_rule follows the first operand with a shard: let one that keeps the vectors whole lead
    decision = pointwise_rule(call, sorted(call.positions, key=cuts_vectors), inplace=False)
    out = decision.outputs[0]
    assert out is not None
    gathered = {m for m, p in enumerate(out) if isinstance(p, Shard) and p.dim == dim}
    if not gathered:
        return decision

    def replicate(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        return tuple(Replicate() if m in gathered else p for m, p in enumerate(placements))

    return Decision(
        inputs={p: replicate(t) for p, t in decision.inputs.items()},
        outputs=[replicate(out)],
    )


@register(aten.glu.default, aten.glu_backward.default)
def glu_rule(call: OpCall) -> Decision:
    """``glu(x, dim)`` pairs the two halves of ``dim``: only ``dim`` must be whole.

    ``glu_backward(grad_output, self, dim)`` takes the gradient of the halved
    output and the input: both keep a shard of any other dim, cut alike.
    """
    backward = call.func is aten.glu_backward.default
    layouts = [call.layout(p) for p in call.positions]
    ndim = layouts[-1].ndim
    dim = int(_arg(call, 2 if backward else 1, "dim", -1)) % max(ndim, 1)  # type: ignore[call-overload]
    targets: list[Placement] = []
    for m in range(layouts[0].mesh.ndim):
        cut = next((lay.placements[m] for lay in layouts if _cuts_other(lay.placements[m], dim)), None)
        targets.append(cut if cut is not None else Replicate())
    placements = tuple(targets)
    return Decision(inputs={p: placements for p in call.positions}, outputs=[placements])


def _cuts_other(placement: Placement, dim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim != dim

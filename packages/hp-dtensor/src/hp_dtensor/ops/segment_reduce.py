"""``segment_reduce`` (and its backward) keeps cuts of every dim but the segmented one.

``segment_reduce(data, reduce, lengths=..., axis=a)`` reduces runs of
``data`` along dim ``a`` (their lengths or offsets given per leading index:
``lengths`` has shape ``data.shape[:a] + (segments,)``). Every other dim is
carried through: a cut dim after ``a`` stays cut with the segment tensors
whole, and a cut dim before ``a`` stays cut with the segment tensors cut on
the same dim (each rank's rows come with their own lengths); the output, and
in the backward the data's gradient, keep the cut, with no communication. A
cut of dim ``a`` itself would split runs across ranks at places only the
lengths' values tell, so that mesh dim is gathered. torch's DTensor has no
rule for this op.
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["segment_reduce_rule"]

aten = torch.ops.aten
R = Replicate()
_SEGMENT_ARGS = ("lengths", "offsets", "indices")


@register(aten.segment_reduce.default, aten._segment_reduce_backward.default)
def segment_reduce_rule(call: OpCall) -> Decision:
    """Cuts of dims other than ``axis`` stay; the segment tensors follow a cut before ``axis``."""
    from hp_dtensor.dtensor import DTensor

    backward = call.func is aten._segment_reduce_backward.default
    data_like = [a for a in (call.args[:3] if backward else call.args[:1]) if isinstance(a, DTensor)]
    segments = [call.kwargs[k] for k in _SEGMENT_ARGS if isinstance(call.kwargs.get(k), DTensor)]
    data_positions = [call.position_of(a) for a in data_like]
    layouts = [call.layout(p) for p in data_positions]
    ndim = layouts[0].ndim
    axis = int(call.kwargs.get("axis", 0)) % ndim
    cuts: list[Placement] = []
    for m in range(layouts[0].mesh.ndim):
        found = [p.dim for p in (lay.placements[m] for lay in layouts) if isinstance(p, Shard)]
        cuts.append(Shard(found[0]) if found and found[0] != axis else R)
    placements = tuple(cuts)
    inputs = {p: placements for p in data_positions}
    follow = tuple(p if isinstance(p, Shard) and p.dim < axis else R for p in placements)
    for segment in segments:
        inputs[call.position_of(segment)] = follow
    return Decision(inputs=inputs, outputs=[placements])

"""Complex numbers from and to real pairs: ``view_as_complex``, ``view_as_real``, ``complex``, ``polar``.

Rotary position embeddings turn a sharded activation into complex pairs,
multiply and turn it back; each of these ops keeps the cut, so the rotation
runs on every rank's own rows. ``view_as_complex`` merges the last dim (of
size 2, the real and imaginary parts) into the dtype: that dim must be whole,
every other keeps its shard; ``view_as_real`` adds it back, uncut.
``complex(real, imag)`` and ``polar(abs, angle)`` are elementwise in their
two inputs, so they follow the pointwise rule (a partial is summed first:
``polar`` is not linear, and ``complex`` mixes two inputs into one value).
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.ops.pointwise import pointwise_rule
from hp_dtensor.ops.strided import elementwise
from hp_dtensor.ops.views import map_dims

__all__: list[str] = []

aten = torch.ops.aten


@register(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall) -> Decision:
    """The last dim (real, imaginary) must be whole; the others keep their shard (and partials: linear)."""
    ndim = call.layout(call.positions[0]).ndim
    return map_dims(call, [d if d < ndim - 1 else None for d in range(ndim)], ndim - 1)


@register(aten.view_as_real.default)
def view_as_real_rule(call: OpCall) -> Decision:
    """Every dim keeps its shard; the new last dim holds a number's two parts, never cut."""
    ndim = call.layout(call.positions[0]).ndim
    return map_dims(call, list(range(ndim)), ndim + 1)


register(aten.complex.default, aten.polar.default, keeps_layout=True)(
    elementwise(lambda call: pointwise_rule(call, inplace=False))
)

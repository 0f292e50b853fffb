"""FFTs: ``_fft_c2c``, ``_fft_r2c`` and ``_fft_c2r``, which every ``torch.fft`` function calls.

A transform over some dims treats every other dim as a batch: shards of those
dims pass through and each rank transforms its piece with no communication.
A transformed dim that is sharded is gathered along that mesh dim only (the
transform needs the whole line; torch does the same). The transforms are
linear over the reals, so a ``Partial("sum")`` / ``Partial("avg")`` input
stays partial; other partials are reduced first. ``_conj`` (the lazy
conjugate ``hfft`` / ``ihfft`` take around the transform) keeps every
placement: it is elementwise and linear over the reals.
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.ops.scans import along_dims_placements

__all__ = ["fft_rule"]

aten = torch.ops.aten


@register(aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default)
def fft_rule(call: OpCall) -> Decision:
    """Batch dims keep their shards; transformed dims are gathered; linear partials pass."""
    position = call.position_of(call.args[0])
    layout = call.layout(position)
    dims = [int(d) % max(layout.ndim, 1) for d in call.args[1]]
    target = along_dims_placements(layout, dims, linear=True)
    return Decision(inputs={position: target}, outputs=[target])


@register(aten._conj.default)
def conj_rule(call: OpCall) -> Decision:
    """The lazy conjugate view: elementwise, real-linear, so every placement (partials too) passes."""
    position = call.position_of(call.args[0])
    placements = call.layout(position).placements
    return Decision(inputs={position: placements}, outputs=[placements])

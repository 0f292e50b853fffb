"""Index-driven ops along one dim: gather, scatter, scatter_add.

``gather(x, dim, index)`` and ``scatter(x, dim, index, src)`` move elements
along ``dim`` only, so a cut of any other dim is independent rows as long as
every tensor is cut the same way there (equal sizes on that dim). ``dim``
itself must be whole: indices are global positions. (The backward of
``max(x, dim)`` scatters the gradient back this way.)
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["along_dim_rule"]

aten = torch.ops.aten


def along_dim_rule(call: OpCall) -> Decision:
    """Keep a shard of a dim other than ``dim`` that every tensor argument has whole-sized; else gather."""
    layouts = [call.layout(p) for p in call.positions]
    ref = layouts[0]
    dim = int(call.args[1]) % max(ref.ndim, 1)
    target: list[Placement] = []
    for m in range(ref.mesh.ndim):
        chosen: Placement = Replicate()
        for layout in layouts:
            placement = layout.placements[m]
            if isinstance(placement, Shard) and placement.dim != dim:
                d = placement.dim
                if all(other.ndim == ref.ndim and other.shape[d] == ref.shape[d] for other in layouts):
                    chosen = placement
                    break
        target.append(chosen)
    placements = tuple(target)
    return Decision(inputs={p: placements for p in call.positions}, outputs=[placements])


register(
    aten.gather.default,
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter_add.default,
)(along_dim_rule)

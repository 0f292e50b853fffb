"""Matrix functions applied to each matrix of a batch: ``matrix_exp``, ``ldl_factor_ex``.

They read a ``(*, n, n)`` tensor as a batch of ``n x n`` matrices and work
on each one alone, so a shard of a batch dim is the answer for its own
matrices: every rank runs the op on its piece, with no communication.
Every output keeps the batch dims in front (``ldl_factor_ex`` returns
``LD`` ``(*, n, n)``, ``pivots`` ``(*, n)`` and ``info`` ``(*)``), so each
takes the input's batch cut. A cut matrix dim is gathered (the factorisation
of a matrix needs all of it), and so is a partial (neither op is linear).
torch's DTensor sends nothing in the batch cases either.
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["batched_matrix_rule"]

aten = torch.ops.aten


@register(aten.linalg_matrix_exp.default, aten.linalg_ldl_factor_ex.default)
def batched_matrix_rule(call: OpCall) -> Decision:
    """Batch-dim shards pass to every output; the matrix dims and partials are gathered."""
    position = call.positions[0]
    layout = call.layout(position)
    batch = layout.ndim - 2
    placements: tuple[Placement, ...] = tuple(
        p if isinstance(p, Shard) and p.dim < batch else Replicate() for p in layout.placements
    )
    returns = len(call.func._schema.returns)
    return Decision(inputs={position: placements}, outputs=[placements] * returns)

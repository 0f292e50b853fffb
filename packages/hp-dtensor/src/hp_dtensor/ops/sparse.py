"""Sparse layouts: refused with a clear error on every rank.

hp_dtensor's pieces are strided tensors; a sparse (COO, CSR, CSC, BSR, BSC)
result would need its own layout rules, and the replicated fallback cannot
wrap one (its ``view`` / ``as_strided`` have no sparse kernels), which used to
fail deep inside torch with a message naming neither the op nor the cause.
The rule raises before anything runs, from the layouts alone, so every rank
raises the same error and none waits in a collective.
"""

from __future__ import annotations

import torch

from hp_dtensor.ops.dispatch import Decision, OpCall, register

__all__ = ["refuse_sparse"]

aten = torch.ops.aten

_SPARSE_OPS = [
    getattr(aten, name)
    for name in (
        "to_sparse",
        "_to_sparse",
        "to_sparse_csr",
        "_to_sparse_csr",
        "to_sparse_csc",
        "_to_sparse_csc",
        "to_sparse_bsr",
        "_to_sparse_bsr",
        "to_sparse_bsc",
        "_to_sparse_bsc",
        "_to_sparse_semi_structured",
    )
    if hasattr(aten, name)
]


@register(*_SPARSE_OPS)
def refuse_sparse(call: OpCall) -> Decision:
    """Raise ``NotImplementedError`` naming the op: sparse results are not DTensors here."""
    raise NotImplementedError(
        f"{call.func}: sparse layouts are not supported by hp_dtensor (the op would return a sparse "
        "tensor). Convert the full value instead: dtensor.full_tensor().to_sparse(), or keep the "
        "DTensor strided."
    )

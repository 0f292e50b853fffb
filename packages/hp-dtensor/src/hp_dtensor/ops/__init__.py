"""Op sharding rules, one module per op family, and the dispatcher that applies them.

Importing this package registers every rule (each family module registers its
ops in :data:`hp_dtensor.ops.dispatch.RULES` at import).
"""

from hp_dtensor.ops import (  # noqa: F401  (registration)  # noqa: F401  (registration; after views)
    advanced_indexing,
    along_dims,
    attention,
    batch_norm,
    batched_linalg,
    chunk_cat,
    complex_views,
    conv,
    ctc_loss,
    diagonals,
    distances,
    embedding,
    embedding_bag,
    fft,
    flat_index,
    foreach,
    group_norm,
    indexing,
    inplace_views,
    loss,
    margin_losses,
    matrix,
    moments,
    norms,
    optim,
    pointwise,
    reductions,
    renorm,
    repeat,
    scans,
    segment_reduce,
    softmax,
    sorting,
    sparse,
    spatial,
    triangular,
    trilinear,
    unfold,
    vector_norms,
    views,
)
from hp_dtensor.ops.dispatch import RULES, Decision, LocalCall, register

__all__ = ["RULES", "Decision", "LocalCall", "register"]

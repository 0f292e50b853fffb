"""hp_dtensor: DTensor with Shard / Replicate / Partial placements, redistribution and tensor parallelism.

Start with :func:`distribute_tensor` or :meth:`DTensor.from_local`; move
between placements with :meth:`DTensor.redistribute` (see what it will do with
:func:`explain_redistribute`); shard a model with :func:`parallelize_module`.
Libraries that manage DTensor storage themselves (hp_fsdp) use
:func:`local_tensor`, :func:`new_dtensor`, :attr:`DTensor.layout_spec` and
:func:`chunk_sizes` instead of DTensor's private attributes.
"""

import hp_dtensor.ops  # noqa: F401  (registers the op sharding rules)
from hp_dtensor.__about__ import __version__
from hp_dtensor.access import local_tensor
from hp_dtensor.dtensor import DTensor, distribute_module, distribute_tensor, new_dtensor
from hp_dtensor.interop import from_torch_dtensor, to_torch_dtensor
from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.local_map import local_map
from hp_dtensor.ops.fallback import (
    FallbackStat,
    fallback_policy,
    fallback_stats,
    get_fallback_policy,
    reset_fallback_stats,
    set_fallback_policy,
)
from hp_dtensor.ops.random_agreement import (
    ensure_rng_agreement,
    get_rng_agreement_policy,
    reset_rng_agreement,
    rng_agreement_policy,
    set_rng_agreement_policy,
)
from hp_dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard
from hp_dtensor.planner import RedistributePlan, RedistributeStep, explain_redistribute
from hp_dtensor.registration import Decision, LocalCall, OpCall, register_rule, register_sharding
from hp_dtensor.tp import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "ColwiseParallel",
    "DTensor",
    "Decision",
    "FallbackStat",
    "Layout",
    "LocalCall",
    "OpCall",
    "ParallelStyle",
    "Partial",
    "Placement",
    "RedistributePlan",
    "RedistributeStep",
    "Replicate",
    "RowwiseParallel",
    "SequenceParallel",
    "Shard",
    "StridedShard",
    "__version__",
    "chunk_sizes",
    "distribute_module",
    "distribute_tensor",
    "ensure_rng_agreement",
    "explain_redistribute",
    "fallback_policy",
    "fallback_stats",
    "from_torch_dtensor",
    "get_fallback_policy",
    "get_rng_agreement_policy",
    "local_map",
    "local_tensor",
    "new_dtensor",
    "parallelize_module",
    "register_rule",
    "register_sharding",
    "reset_fallback_stats",
    "reset_rng_agreement",
    "rng_agreement_policy",
    "set_fallback_policy",
    "set_rng_agreement_policy",
    "to_torch_dtensor",
]

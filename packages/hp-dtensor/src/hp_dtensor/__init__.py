"""hp_dtensor: DTensor with Shard / Replicate / Partial placements, redistribution and tensor parallelism.

Start with :func:`distribute_tensor` or :meth:`DTensor.from_local`; move
between placements with :meth:`DTensor.redistribute` (see what it will do with
:func:`explain_redistribute`); shard a model with :func:`parallelize_module`.
"""

import hp_dtensor.ops  # noqa: F401  (registers the op sharding rules)
from hp_dtensor.__about__ import __version__
from hp_dtensor.dtensor import DTensor, distribute_module, distribute_tensor
from hp_dtensor.interop import from_torch_dtensor, to_torch_dtensor
from hp_dtensor.layout import Layout
from hp_dtensor.placements import Partial, Placement, Replicate, Shard
from hp_dtensor.planner import RedistributePlan, RedistributeStep, explain_redistribute
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
    "Layout",
    "ParallelStyle",
    "Partial",
    "Placement",
    "RedistributePlan",
    "RedistributeStep",
    "Replicate",
    "RowwiseParallel",
    "SequenceParallel",
    "Shard",
    "__version__",
    "distribute_module",
    "distribute_tensor",
    "explain_redistribute",
    "from_torch_dtensor",
    "parallelize_module",
    "to_torch_dtensor",
]

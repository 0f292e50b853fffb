"""Compose with a sharded-data-parallel wrapper (hp-fsdp) without importing it.

[Note: FSDP protocol]
hp-pipeline must not depend on hp-fsdp, so a stage module takes part in the
``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` steps by *shape*: any module with
the methods of :class:`ShardedModule` is treated as sharded. Per step the
executor

1. calls ``set_requires_gradient_sync(False)`` (when present) before the first
   compute step, so the per-micro-batch backwards only accumulate, and
   ``set_reshard_after_backward(False)`` (when present), so the parameters
   gathered by ``UNSHARD`` survive each micro-batch's backward instead of being
   freed and gathered again for the next micro-batch (with hp-fsdp's default
   ``True`` a step of ``m`` micro-batches costs ``m`` all-gathers per stage
   instead of one);
2. runs ``UNSHARD`` -> ``unshard()`` before the stage's first compute step; a
   returned handle with ``wait()`` is waited before the stage computes;
3. runs ``REDUCE_GRAD`` -> ``set_requires_gradient_sync(True)`` then
   ``reduce_grad()`` after the stage's last backward: the gradients of all
   micro-batches are reduced once per step, not once per micro-batch;
4. runs ``RESHARD`` -> ``set_reshard_after_backward(True)`` (when present:
   FSDP's default, so the module behaves as usual outside the pipeline) then
   ``reshard()`` at the end.

Forward-only steps (no ``loss_fn``) only unshard and reshard. The stage
module's own ``reshard_after_forward`` is left alone: nested units that free
their parameters after forward (a memory choice) still gather them again in
backward, as in plain FSDP; the stage's root unit keeps them by default.

A wrapper without ``reduce_grad`` cannot take part; such a module is treated as
unsharded and its steps are not added. :func:`add_fsdp_steps` inserts the steps
into a compute-only order (before :func:`~hp_pipeline.insert_comms`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from hp_pipeline.ir import MetaStep, MetaStepType, Order

__all__ = ["ShardedModule", "add_fsdp_steps", "is_sharded_module"]


@runtime_checkable
class ShardedModule(Protocol):
    """What a stage module implements to take part in the FSDP steps ([Note: FSDP protocol])."""

    def unshard(self) -> Any:
        """Gather the full parameters; may return a handle whose ``wait()`` finishes it."""

    def reshard(self) -> None:
        """Free the gathered parameters."""

    def reduce_grad(self) -> None:
        """Reduce (e.g. reduce-scatter) the gradients accumulated over the step's micro-batches."""

    # Optional, called when present: set_requires_gradient_sync(bool), set_reshard_after_backward(bool).


def is_sharded_module(module: object) -> bool:
    """Whether ``module`` implements :class:`ShardedModule` (all three methods, callable)."""
    return all(callable(getattr(module, name, None)) for name in ("unshard", "reshard", "reduce_grad"))


def add_fsdp_steps(order: Mapping[int, Sequence[MetaStep]], stages: Collection[int]) -> Order:
    """A copy of ``order`` with ``UNSHARD`` / ``REDUCE_GRAD`` / ``RESHARD`` for ``stages``.

    ``UNSHARD`` goes right before the stage's first compute step, ``REDUCE_GRAD``
    right after its last backward (``B`` or ``W``) and ``RESHARD`` after that
    (or after the last forward of a forward-only order). Parameters stay
    gathered for the whole step: the simplest placement that never gathers
    twice; memory-tighter placements can be written as orders by hand.
    """
    wanted = set(stages)
    result: Order = {}
    for rank, steps in order.items():
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        last_bwd: dict[int, int] = {}
        for pos, step in enumerate(steps):
            if step.stage_index in wanted and step.type.is_compute:
                first.setdefault(step.stage_index, pos)
                last[step.stage_index] = pos
                if step.type in (MetaStepType.BWD, MetaStepType.BWD_WEIGHT):
                    last_bwd[step.stage_index] = pos
        out: list[MetaStep] = []
        for pos, step in enumerate(steps):
            stage = step.stage_index
            if first.get(stage) == pos:
                out.append(MetaStep(None, MetaStepType.UNSHARD, stage))
            out.append(step)
            if last.get(stage) == pos:
                if stage in last_bwd:
                    out.append(MetaStep(None, MetaStepType.REDUCE_GRAD, stage))
                out.append(MetaStep(None, MetaStepType.RESHARD, stage))
        result[rank] = out
    return result

"""Compose with a sharded-data-parallel wrapper (hp-fsdp) without importing it.

Details: [Note: FSDP protocol].
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn

from hp_pipeline.ir import MetaStep, MetaStepType, Order

__all__ = ["ShardedModule", "ShardedUnits", "add_fsdp_steps", "is_sharded_module", "sharded_units"]


# [Note: FSDP protocol]
# hp-pipeline must not depend on hp-fsdp, so a stage takes part in the
# ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` steps by *shape*: every submodule
# of the stage module (the module itself included) with the methods of
# :class:`ShardedModule` is a *unit*. Users wrap the way they do without a
# pipeline: each block, the stage module, or both (nested, bottom-up). The
# *outer* units are those not inside another unit. Per step the executor
#
# 1. before the first compute step, calls on the outer units
#    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``
#    (when present; they apply to the units below, as in FSDP2), so the
#    per-micro-batch backwards only accumulate and keep the parameters
#    gathered, and on every unit whose ``reshard_after_forward`` reads true
#    ``set_reshard_after_forward(False, recurse=False)``, so no micro-batch's
#    forward frees what ``UNSHARD`` gathered (a unit resharding after each
#    forward would gather again for every micro-batch's backward and the next
#    forward: ``2m`` all-gathers per unit instead of one);
# 2. runs ``UNSHARD`` -> ``unshard(async_op=True)`` on every unit before the
#    stage's first compute step; the returned handles are waited before the
#    stage computes, so on an accelerator all gathers of the stage are in
#    flight together;
# 3. runs ``REDUCE_GRAD`` -> ``set_requires_gradient_sync(True)`` then
#    ``reduce_grad()`` on the outer units after the stage's last backward
#    (``reduce_grad`` covers the unit and every unit below it): the gradients of
#    all micro-batches are reduced once per step, not once per micro-batch;
# 4. runs ``RESHARD`` at the end: ``set_reshard_after_backward(True)`` on the
#    outer units (FSDP's default again), each unit's ``reshard_after_forward``
#    put back as it was read, and ``reshard()`` on every unit, so after the step
#    every parameter the module registers is its shard again (the one the
#    optimizer steps).
#
# Step 4 reaching *every* unit is what keeps nested wrapping correct: a unit
# left gathered after the step would run the next forward on its old gathered
# values while the optimizer updates the shards, and its parameters (as the
# module lists them) would carry no gradient.
#
# One all-gather and one reduce-scatter per unit per step, whatever the
# wrapping and the number of micro-batches. Forward-only steps (no
# ``loss_fn``) only unshard and reshard. A wrapper without ``reduce_grad``
# cannot take part; such a module is treated as unsharded.
# :func:`add_fsdp_steps` inserts the steps into a compute-only order (before
# :func:`~hp_pipeline.insert_comms`).


@runtime_checkable
class ShardedModule(Protocol):
    """What a stage module implements to take part in the FSDP steps ([Note: FSDP protocol])."""

    def unshard(self, async_op: bool = False) -> Any:
        """Gather this unit's full parameters; with ``async_op`` a handle whose ``wait()`` finishes it."""

    def reshard(self) -> None:
        """Free this unit's gathered parameters and register its shards again."""

    def reduce_grad(self) -> None:
        """Reduce the gradients accumulated over the step's micro-batches, here and in the units below."""

    # Optional, used when present: set_requires_gradient_sync(bool), set_reshard_after_backward(bool)
    # (applying to the units below), and a readable ``reshard_after_forward`` with
    # set_reshard_after_forward(value, recurse=False).


def is_sharded_module(module: object) -> bool:
    """Whether ``module`` implements :class:`ShardedModule` (all three methods, callable)."""
    return all(callable(getattr(module, name, None)) for name in ("unshard", "reshard", "reduce_grad"))


class ShardedUnits:
    """The units of one stage module: every one, and the outer ones ([Note: FSDP protocol])."""

    def __init__(self, module: nn.Module) -> None:
        self.all: list[Any] = [m for m in module.modules() if is_sharded_module(m)]
        self.outer: list[Any] = []
        covered: set[int] = set()
        for unit in self.all:  # modules() lists a module before everything below it
            if id(unit) not in covered:
                self.outer.append(unit)
                covered.update(id(sub) for sub in unit.modules())
        self._saved_reshard_after_forward: list[tuple[Any, Any]] = []
        managed = {id(p) for unit in self.outer for p in unit.parameters()}
        #: trainable parameters of the stage outside every unit: not reduced over data parallelism
        self.unmanaged = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in managed]

    def check_covers_all(self, where: str) -> None:
        """Refuse a stage whose units leave trainable parameters out ([Note: FSDP protocol]).

        Units mean the stage is data-parallel; a parameter outside all of them
        would get its replica's gradient only, and the replicas would drift
        apart with no error. Raised at schedule construction, before any
        communication.
        """
        if self and self.unmanaged:
            raise ValueError(
                f"{where}: parameters {self.unmanaged} are outside every fully_shard unit of the stage "
                "module, so their gradients would not be averaged over data parallelism and the replicas "
                "would drift apart. Wrap the stage module too (fully_shard(stage_module, mesh=...) after "
                "its blocks), or move them into a wrapped submodule."
            )

    def __bool__(self) -> bool:
        return bool(self.all)

    def begin_step(self, training: bool) -> None:
        """Step 1: keep every unit gathered from ``UNSHARD`` to ``RESHARD``; accumulate only."""
        if training:
            for unit in self.outer:
                _call_if_present(unit, "set_requires_gradient_sync", False)
                _call_if_present(unit, "set_reshard_after_backward", False)
        saved = []
        for unit in self.all:
            value = getattr(unit, "reshard_after_forward", None)
            if value is not False and callable(getattr(unit, "set_reshard_after_forward", None)):
                saved.append((unit, value))
                unit.set_reshard_after_forward(False, recurse=False)
        self._saved_reshard_after_forward = saved

    def unshard(self) -> list[Any]:
        """Step 2: start every unit's gather; the handles to wait before computing."""
        handles = [unit.unshard(async_op=True) for unit in self.all]
        return [h for h in handles if callable(getattr(h, "wait", None))]

    def reduce_grad(self) -> None:
        """Step 3: one reduction of the step's accumulated gradients per unit."""
        for unit in self.outer:
            _call_if_present(unit, "set_requires_gradient_sync", True)
            unit.reduce_grad()

    def reshard(self, training: bool) -> None:
        """Step 4: FSDP's own settings back, every unit holding its shards again."""
        if training:
            for unit in self.outer:
                _call_if_present(unit, "set_reshard_after_backward", True)
        saved, self._saved_reshard_after_forward = self._saved_reshard_after_forward, []
        for unit, value in saved:
            unit.set_reshard_after_forward(value, recurse=False)
        for unit in self.all:
            unit.reshard()


def sharded_units(module: nn.Module) -> ShardedUnits:
    """The units of ``module`` (itself and every submodule implementing :class:`ShardedModule`)."""
    return ShardedUnits(module)


def _call_if_present(module: Any, name: str, value: bool) -> None:
    """Call an optional setter of a unit ([Note: FSDP protocol] requires three methods only)."""
    setter = getattr(module, name, None)
    if callable(setter):
        setter(value)


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

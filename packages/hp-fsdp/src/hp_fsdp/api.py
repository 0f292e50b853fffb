"""The public entry point, ``fully_shard``, and the methods every sharded module gains.

``fully_shard`` is applied bottom-up: the blocks first, the root last. Each
call makes one *unit*: the parameters of the given module(s) that no earlier
call took become DTensor shards communicated together (see
:mod:`hp_fsdp.collectives`), and the module's class is swapped for a subclass
that mixes in :class:`HSDPModule`, so ``isinstance(m, FSDPModule)`` holds and
the control methods are available on the module itself.

Everything is checked and planned before the first module is changed (see
:mod:`hp_fsdp.plan`): a rejected call leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from hp_core import DeviceMesh, StaleMeshError, get_platform, init_device_mesh
from hp_core.distributed import get_world_size
from hp_dtensor import Shard
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

from hp_fsdp.arg_checks import check_divide_factor, check_flag, check_reduce_op_type
from hp_fsdp.param import FSDPParam
from hp_fsdp.param_group import FSDPParamGroup
from hp_fsdp.plan import collect_params, param_ids, validate_call
from hp_fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp.post_forward import check_reshard_after_forward
from hp_fsdp.state import FSDPState, agree, get_state, prefetch_states, states_below
from hp_fsdp.state_dict import register_state_dict_hooks

__all__ = ["FSDPModule", "HSDPModule", "UnshardHandle", "fully_shard"]

_CLASS_CACHE: dict[type, type] = {}
_DEFAULT_MESHES: dict[tuple[str, int], DeviceMesh] = {}


def _default_mesh() -> DeviceMesh:
    """The 1-D mesh over the world that ``mesh=None`` means, built once per process and default group.

    Building a mesh may communicate (hp_core checks that every rank passed the
    same arguments), so a mesh built per call would make every ``fully_shard``
    a synchronisation point that all ranks must reach equally often, which
    they need not ([Note: fully_shard agreement] in :mod:`hp_fsdp.agreement`).
    A mesh whose groups were released is built again.
    """
    key = (get_platform().device_type, get_world_size())
    mesh = _DEFAULT_MESHES.get(key)
    if mesh is not None:
        try:
            mesh.get_group()  # raises once the groups were released (a re-created default group)
            return mesh
        except StaleMeshError:
            pass
    mesh = init_device_mesh(key[0], (key[1],))
    _DEFAULT_MESHES[key] = mesh
    return mesh


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | TorchDeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared on purpose
    offload_policy: OffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    replicate_params: Iterable[nn.Parameter] | None = None,
    comm_fusion: bool = True,
) -> Any:
    """Shard ``module``'s parameters over ``mesh`` and return the module (now an :class:`HSDPModule`).

    * ``mesh``: 1-D (FSDP: shard over all ranks) or 2-D ``(replicate,
      shard)`` (HSDP: shard within a row, all-reduce across rows). Defaults
      to a 1-D mesh over the world.
    * ``reshard_after_forward``: free gathered parameters after forward and
      gather again for backward (ZeRO-3); False keeps them (ZeRO-2 style,
      more memory, one all-gather less per unit). None (the default, as in
      FSDP2) means True for every unit but the root, whose backward starts
      right after its forward; an explicit True or False applies to the root too.
      An int ``N`` (dividing the shard dim's size) frees all but ``1/N`` of the
      gathered parameters, so backward gathers over groups of ``N`` ranks
      only; ``1`` is False and the shard dim's size is True (see [Note:
      reshard to groups of N ranks] in :mod:`hp_fsdp.post_forward`).
    * ``shard_placement_fn(param)``: ``Shard(d)`` to shard ``param`` along
      dim ``d`` instead of 0 (None keeps 0).
    * ``mp_policy``: see :class:`MixedPrecisionPolicy`.
    * ``offload_policy``: :class:`CPUOffloadPolicy` keeps shards and their
      gradients on CPU.
    * ``ignored_params``: left completely alone (not sharded, not reduced).
    * ``replicate_params``: kept whole on every rank (``Replicate()``
      DTensors) and all-reduced after backward, DDP-style.
    * ``comm_fusion``: one collective per unit and direction (True) or one
      per parameter (False); see [Note: fused buckets].
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if mesh is None:
        mesh = _default_mesh()
    elif isinstance(mesh, TorchDeviceMesh):
        # torch's mesh, read once on torch's own process groups (no group created, no communication)
        mesh = DeviceMesh.from_torch(mesh)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    validate_call(
        modules,
        mesh,
        offload_policy,
        reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        comm_fusion=comm_fusion,
    )
    ignored, replicated = param_ids(modules, ignored_params, replicate_params)
    plan = collect_params(modules, ignored, replicated, shard_placement_fn, offload=offload, mesh=mesh)

    # -- nothing was changed above; from here on the modules are converted --
    device = get_platform().device()
    full_group: Any = None
    if any(item.replicate for item in plan):
        full_group = mesh.get_group(0) if mesh.ndim == 1 else mesh.flatten().get_group(0)
    pin = offload and isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    params = [
        FSDPParam(
            item.param,
            item.infos,
            mesh,
            item.shard_dim,
            replicate=item.replicate,
            device=device,
            offload=offload,
            pin_memory=pin,
        )
        for item in plan
    ]
    group = None
    if params:
        group = FSDPParamGroup(
            params,
            mesh,
            mp_policy,
            reshard_after_forward=True,  # set_reshard_after_forward below has the last word
            comm_fusion=comm_fusion,
            full_group=full_group,
        )
    state = FSDPState(modules, group, mp_policy)
    state.set_reshard_after_forward(reshard_after_forward)
    register_state_dict_hooks(state)
    for m in modules:
        cls = type(m)
        new_cls = _CLASS_CACHE.get(cls)
        if new_cls is None:
            new_cls = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {})
            _CLASS_CACHE[cls] = new_cls
        m.__class__ = new_cls
    return module


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the gather and registers the params."""

    def __init__(self, state: FSDPState | None) -> None:
        self._state = state

    def wait(self) -> None:
        """Block until the parameters are gathered and visible on the module."""
        if self._state is not None and self._state.group is not None:
            self._state.group.wait_for_unshard()
        self._state = None


class HSDPModule:
    """Methods mixed into every module ``fully_shard`` converted.

    Setters that take ``recurse`` apply to every unit in the module's subtree
    (the usual need: turn off gradient sync for the whole model), otherwise to
    this unit only.
    """

    def _hp_state(self) -> FSDPState:
        state = get_state(self)  # type: ignore[arg-type]
        if state is None:  # pragma: no cover - the class is only ever set by fully_shard
            raise RuntimeError("this module has no hp_fsdp state; call fully_shard on it first.")
        return state

    def _hp_states(self, recurse: bool, what: str = "") -> list[FSDPState]:
        if what:
            check_flag(what, "recurse", recurse, "True: this unit and every unit below it, False: this unit")
        if not recurse:
            return [self._hp_state()]
        return states_below([self])  # type: ignore[list-item]

    # -- communication control ----------------------------------------------------------------

    def _hp_agree(self) -> None:
        """Before this tree's first collective outside a forward: [Note: fully_shard agreement].

        Units are built bottom-up and compared whole trees at a time, so an
        agreed unit has agreed units below it: the common case costs one flag read.
        """
        if self._hp_state().agreed:
            return
        agree([self], self._hp_states(recurse=True))  # type: ignore[list-item]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters now (e.g. ahead of a custom forward or for a pipeline stage)."""
        check_flag("unshard", "async_op", async_op, "True returns a handle to wait() on, False waits now")
        state = self._hp_state()
        self._hp_agree()
        if state.group is None:
            return UnshardHandle(None) if async_op else None
        state.group.unshard()
        if async_op:
            return UnshardHandle(state)
        state.group.wait_for_unshard()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters and register the shards again."""
        state = self._hp_state()
        if state.group is not None:
            state.group.reshard()

    def reduce_grad(self) -> None:
        """Reduce the gradients accumulated over several backwards, once, for every unit below.

        Meant for pipeline schedules and manual accumulation loops that run
        backwards with ``set_requires_gradient_sync(False)`` and then want one
        reduction at the end; the sync flags are left as they are.
        """
        self._hp_agree()
        pending = []
        for state in self._hp_states(recurse=True):
            if state.group is not None:
                handle = state.group.reduce(force=True)
                if handle is not None:
                    pending.append(handle)
        for handle in pending:
            handle.finish()

    # -- flags --------------------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: keep accumulating full, unreduced gradients (no communication) until set True."""
        what = "set_requires_gradient_sync"
        check_flag(
            what, "requires_gradient_sync", requires_gradient_sync, "False accumulates without reducing"
        )
        for state in self._hp_states(recurse, what):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but defers the all-reduce across the replicate dim."""
        what = "set_requires_all_reduce"
        check_flag(
            what, "requires_all_reduce", requires_all_reduce, "False defers the replicate-dim all-reduce"
        )
        for state in self._hp_states(recurse, what):
            if state.group is not None:
                state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | int | None, *, recurse: bool = True
    ) -> None:
        """Whether units free their gathered parameters after forward (True / False apply to the root too).

        None restores ``fully_shard``'s default (True except on the root), so a
        caller that changed the flag for a while can put back what it read from
        :attr:`reshard_after_forward`. An int ``N`` reshards to groups of ``N``
        ranks, as in ``fully_shard``; it is checked against every unit's mesh
        before any unit changes. Call it on every rank (an int may create
        process groups).
        """
        states = self._hp_states(recurse, "set_reshard_after_forward")
        meshes = {s.group.mesh.identity: s.group.mesh for s in states if s.group is not None}
        for mesh in meshes.values() or [None]:
            check_reshard_after_forward("set_reshard_after_forward", reshard_after_forward, mesh)
        for state in states:
            state.set_reshard_after_forward(reshard_after_forward)

    @property
    def reshard_after_forward(self) -> bool | int | None:
        """This unit's requested ``reshard_after_forward`` (None: the default), to save and restore."""
        return self._hp_state().reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether units free their gathered parameters after backward (False: keep for the next step)."""
        what = "set_reshard_after_backward"
        check_flag(
            what, "reshard_after_backward", reshard_after_backward, "False keeps them for the next step"
        )
        for state in self._hp_states(recurse, what):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[HSDPModule]) -> None:
        """Start these units' all-gathers when this unit's forward starts (explicit prefetch).

        The modules must be units under the same root (checked now if the root
        already ran, else at its first forward).
        """
        state = self._hp_state()
        state.forward_prefetch = prefetch_states("set_modules_to_forward_prefetch", modules, state)

    def set_modules_to_backward_prefetch(self, modules: list[HSDPModule]) -> None:
        """Start these units' all-gathers when this unit's backward starts (replaces the implicit one).

        The modules must be units under the same root, as for forward prefetch.
        """
        state = self._hp_state()
        state.backward_prefetch = prefetch_states("set_modules_to_backward_prefetch", modules, state)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by ``factor`` instead of averaging over the data-parallel ranks."""
        check_divide_factor(factor)
        for state in self._hp_states(recurse=True):
            if state.group is not None:
                state.group.gradient_divide_factor = float(factor)

    def set_reduce_op_type(self, reduce_op_type: Literal["avg", "sum"]) -> None:
        """``avg`` (default: mean over data-parallel ranks) or ``sum`` of the gradients."""
        check_reduce_op_type(reduce_op_type)
        for state in self._hp_states(recurse=True):
            if state.group is not None:
                state.group.reduce_op_type = reduce_op_type

    # -- module conversions -------------------------------------------------------------------

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """After ``to_empty`` / ``.to`` swap parameters, re-adopt the new shards (meta-device init)."""
        for state in self._hp_states(recurse=True):
            if state.group is not None:
                state.group.reshard()
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for state in self._hp_states(recurse=True):
            if state.group is not None:
                for p in state.group.params:
                    p.adopt_registered()
        return result


FSDPModule = HSDPModule

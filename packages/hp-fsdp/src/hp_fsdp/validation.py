"""Checks on a ``fully_shard`` call, and the plan of which parameters the unit takes.

Everything here only reads the modules. ``fully_shard`` runs it first, so a
bad call raises before any parameter or class is replaced; every error names
the parameter or value at fault and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hp_core import DeviceMesh
from hp_core.distributed import get_world_size
from hp_dtensor import DTensor, Shard
from torch import nn

from hp_fsdp.param import ParamInfo
from hp_fsdp.policies import OffloadPolicy
from hp_fsdp.post_forward import group_sizes
from hp_fsdp.state import get_state
from hp_fsdp.tp_layout import check_tp_param

__all__ = ["ParamPlan", "check_reshard_after_forward", "collect_params", "validate_call"]


@dataclass
class ParamPlan:
    """One parameter the unit will manage: its owners, its shard dim, whether it is replicated."""

    param: nn.Parameter
    infos: list[ParamInfo]
    shard_dim: int
    replicate: bool


def check_reshard_after_forward(what: str, value: Any, mesh: DeviceMesh | None = None) -> None:
    """``reshard_after_forward`` is True, False, None or a group size; refuse anything else up front.

    An int ``N`` is FSDP2's "reshard to groups of N ranks" ([Note: reshard to
    groups of N ranks] in :mod:`hp_fsdp.post_forward`): it must divide the
    ranks of ``mesh``'s shard dim (checked when ``mesh`` is given). ``1`` is
    accepted as FSDP2 does, with a warning, since it means False.
    """
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(
            f"{what}: reshard_after_forward={value!r} is a {type(value).__name__}; pass True, False, None "
            "(None: True for every unit but the root) or an int N (reshard to groups of N ranks)."
        )
    if mesh is None:
        if value < 1:
            raise ValueError(
                f"{what}: reshard_after_forward={value} is an int, which means a group size (reshard to "
                "groups of N ranks after forward) and must be at least 1; pass False to keep the parameters "
                "gathered after forward, True to free them."
            )
        return
    size = mesh.size(mesh.ndim - 1)
    valid = group_sizes(size)
    if value not in valid:
        kind = "must be at least 1" if value < 1 else f"must divide the {size} ranks of the mesh's shard dim"
        raise ValueError(
            f"{what}: reshard_after_forward={value} is an int, which means a group size (after forward each "
            f"group of N ranks keeps the parameters sharded among itself), and it {kind} (mesh "
            f"{tuple(mesh.shape)}). Pass one of {valid} ({size}: like True; 1: like False), or True / False."
        )
    if 1 < value < size and mesh.size() != get_world_size():
        raise NotImplementedError(
            f"{what}: reshard_after_forward={value} needs new process groups of {value} ranks, which hp_fsdp "
            f"builds from the mesh's ranks; this mesh {mesh!r} spans {mesh.size()} of the {get_world_size()} "
            "ranks (a slice beside 'tp' or 'pp'), and each rank sees only its own line. "
            f"Pass a mesh over all ranks, or reshard_after_forward in (True, False, 1, {size})."
        )
    if value == 1:
        warnings.warn(
            f"{what}: reshard_after_forward=1 (an int) means groups of 1 rank: every rank keeps the whole "
            "gathered parameters after forward, like False. Pass False to say so, or True to free them.",
            UserWarning,
            stacklevel=3,
        )


def validate_call(
    modules: list[Any], mesh: Any, offload_policy: Any, reshard_after_forward: Any = None
) -> None:
    """Types, mesh shape, ``reshard_after_forward`` against the mesh, and repeated application."""
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules; pass a module or a non-empty list.")
    seen: set[int] = set()
    for index, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: module[{index}] is a {type(m).__name__}, not an nn.Module.")
        if id(m) in seen:
            raise ValueError(
                f"fully_shard: module {type(m).__name__} appears twice in the list; pass it once."
            )
        seen.add(id(m))
        if get_state(m) is not None:
            raise ValueError(
                f"fully_shard: {type(m).__name__} (module[{index}]) was already passed to fully_shard; "
                "apply fully_shard once per module, bottom-up (blocks first, then the root)."
            )
    for i, a in enumerate(modules):
        for j, b in enumerate(modules):
            if i != j and any(sub is b for sub in a.modules()):
                raise ValueError(
                    f"fully_shard: module[{j}] ({type(b).__name__}) is inside module[{i}] "
                    f"({type(a).__name__}); the modules of one unit must not overlap. Call fully_shard on "
                    f"module[{j}] first, then on module[{i}]."
                )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard: mesh must be an hp_core.DeviceMesh, got {type(mesh).__name__}; build one with "
            "hp_core.init_device_mesh(device_type, (world_size,))."
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh has {mesh.ndim} dims {tuple(mesh.shape)} (names {mesh.mesh_dim_names}); "
            "data parallelism needs a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP). Slice the "
            "data-parallel dims out, e.g. mesh['dp_replicate', 'dp_shard']."
        )
    check_reshard_after_forward("fully_shard", reshard_after_forward, mesh)
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard: offload_policy must be an OffloadPolicy (e.g. CPUOffloadPolicy()), got "
            f"{type(offload_policy).__name__}."
        )


def _owned_by_units(modules: list[nn.Module]) -> tuple[set[int], dict[int, str]]:
    """Parameters already managed by units nested inside ``modules``.

    Returns the ids of their sharded parameters, and the ids of the original
    parameters they replaced (with the name they were sharded under), which a
    module outside that unit may still hold when a weight is tied.
    """
    owned: set[int] = set()
    originals: dict[int, str] = {}
    for m in modules:
        for sub in m.modules():
            state = get_state(sub)
            if state is not None and state.group is not None:
                for p in state.group.params:
                    owned.add(id(p.sharded_param))
                    originals[p.orig_param_id] = p.fqn
    return owned, originals


def _managed_modules(modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Submodules whose direct parameters this unit takes: stop at nested units."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def walk(prefix: str, module: nn.Module, top: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if not top and get_state(module) is not None:
            return
        out.append((prefix, module))
        for name, child in module.named_children():
            walk(f"{prefix}.{name}" if prefix else name, child, False)

    for index, m in enumerate(modules):
        walk("" if len(modules) == 1 else f"[{index}]", m, True)
    return out


def collect_params(
    modules: list[nn.Module],
    ignored: set[int],
    replicated: set[int],
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    *,
    offload: bool,
    mesh: DeviceMesh | None = None,
) -> list[ParamPlan]:
    """The unit's parameters in registration order (tied parameters once, with every owner)."""
    owned, originals = _owned_by_units(modules)
    by_id: dict[int, ParamPlan] = {}
    order: list[ParamPlan] = []
    for prefix, module in _managed_modules(modules):
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored or id(param) in owned:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            if id(param) in originals:
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is tied to {originals[id(param)]!r}, which an earlier "
                    "fully_shard call already sharded in another unit; a tied weight must live in one unit. "
                    "Put both modules in the same unit (fully_shard([a, b]) or leave both to the root)."
                )
            info = ParamInfo(module, name, fqn)
            if id(param) in by_id:
                by_id[id(param)].infos.append(info)
                continue
            plan = ParamPlan(param, [info], 0, id(param) in replicated)
            by_id[id(param)] = plan
            order.append(plan)
    _check_params(order, shard_placement_fn, offload, mesh)
    return order


def _check_params(
    plans: list[ParamPlan],
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    offload: bool,
    mesh: DeviceMesh | None = None,
) -> None:
    devices: dict[str, str] = {}
    for plan in plans:
        param, fqn = plan.param, plan.infos[0].fqn
        is_dtensor = isinstance(param, DTensor) or isinstance(getattr(param, "data", None), DTensor)
        if mesh is not None and is_dtensor:
            check_tp_param(param, fqn, mesh, replicate=plan.replicate, shard_dim=plan.shard_dim)
        if param.is_meta:
            devices.setdefault("meta", fqn)
        else:
            devices.setdefault(param.device.type, fqn)
        if offload and not param.is_meta and param.device.type != "cpu":
            raise ValueError(
                f"fully_shard: CPUOffloadPolicy needs parameters on CPU (or meta), but {fqn!r} is on "
                f"{param.device}; build the model on CPU (or on meta and call to_empty after fully_shard)."
            )
        if plan.replicate:
            continue
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is a 0-dim scalar and cannot be sharded; pass it in "
                "replicate_params (or ignored_params)."
            )
        if shard_placement_fn is not None:
            placement = shard_placement_fn(param)
            if placement is not None:
                if not isinstance(placement, Shard):
                    raise TypeError(
                        f"fully_shard: shard_placement_fn returned {placement!r} for {fqn!r}; return "
                        "Shard(dim) or None."
                    )
                dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
                if not 0 <= dim < param.dim():
                    raise ValueError(
                        f"fully_shard: shard_placement_fn returned Shard({placement.dim}) for {fqn!r} of "
                        f"shape {tuple(param.shape)}; the dim must be in [{-param.dim()}, {param.dim() - 1}]."
                    )
                plan.shard_dim = dim
        if mesh is not None and isinstance(param, DTensor):
            check_tp_param(param, fqn, mesh, replicate=False, shard_dim=plan.shard_dim)
    kinds = {k for k in devices if k != "meta"}
    if len(kinds) > 1:
        listing = ", ".join(f"{fqn!r} on {kind}" for kind, fqn in devices.items())
        raise ValueError(
            f"fully_shard: the unit's parameters are on different devices ({listing}); move the module "
            "to one device (module.to(device)) before fully_shard."
        )
    if "meta" in devices and kinds:
        listing = ", ".join(f"{fqn!r} on {kind}" for kind, fqn in devices.items())
        raise ValueError(
            f"fully_shard: some parameters are on meta and some are not ({listing}); create the whole "
            "module on meta (then to_empty after fully_shard) or on a real device."
        )

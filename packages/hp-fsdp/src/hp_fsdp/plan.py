"""Planning a unit: check ``fully_shard``'s arguments against the model and pick its parameters.

As FSDP2's ``_fsdp_init.py``: everything here only reads the model, so
``fully_shard`` runs it before it changes anything and a rejected call leaves
the model as it was. It remembers, weakly, which unit took which modules
(:data:`_TAKEN`), to name the parent when a child is wrapped after it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from hp_core import DeviceMesh
from hp_dtensor import DTensor, Shard
from torch import nn

from hp_fsdp.arg_checks import check_flag, check_instance, from_torch, torch_name
from hp_fsdp.param import FSDPParam, ParamInfo
from hp_fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp.post_forward import check_reshard_after_forward
from hp_fsdp.state import get_state
from hp_fsdp.tp_layout import check_tp_param

__all__ = ["ParamPlan", "collect_params", "param_ids", "validate_call"]


@dataclass
class ParamPlan:
    """One parameter the unit will manage: its owners, its shard dim, whether it is replicated."""

    param: nn.Parameter
    infos: list[ParamInfo]
    shard_dim: int
    replicate: bool


def validate_call(
    modules: list[Any],
    mesh: Any,
    offload_policy: Any,
    reshard_after_forward: Any = None,
    *,
    shard_placement_fn: Any = None,
    mp_policy: Any = None,
    comm_fusion: Any = True,
) -> None:
    """Every argument of ``fully_shard`` that can be judged alone: types, mesh shape, repeated use."""
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules; pass a module or a non-empty list.")
    seen: set[int] = set()
    for index, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard: module[{index}]={m!r:.80} is a {type(m).__name__}, not an nn.Module; pass an "
                "nn.Module or a list of nn.Modules."
            )
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
        _check_not_taken(m, index)
    for i, a in enumerate(modules):
        for j, b in enumerate(modules):
            if i != j and any(sub is b for sub in a.modules()):
                raise ValueError(
                    f"fully_shard: module[{j}] ({type(b).__name__}) is inside module[{i}] "
                    f"({type(a).__name__}); the modules of one unit must not overlap. Call fully_shard on "
                    f"module[{j}] first, then on module[{i}]."
                )
    if not isinstance(mesh, DeviceMesh):
        kind = torch_name(mesh) if from_torch(mesh) else type(mesh).__name__
        raise TypeError(
            f"fully_shard: mesh must be an hp_core.DeviceMesh (or a torch DeviceMesh), got {kind}; build "
            "one with hp_core.init_device_mesh(device_type, (world_size,))."
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh has {mesh.ndim} dims {tuple(mesh.shape)} (names {mesh.mesh_dim_names}); "
            "data parallelism needs a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP). Slice the "
            "data-parallel dims out, e.g. mesh['dp_replicate', 'dp_shard']."
        )
    check_reshard_after_forward("fully_shard", reshard_after_forward, mesh)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"fully_shard: shard_placement_fn={shard_placement_fn!r} is a "
            f"{type(shard_placement_fn).__name__}, not callable; pass a function of the parameter "
            "returning Shard(dim) or None (dim 0), or None."
        )
    check_instance("fully_shard", "mp_policy", mp_policy, MixedPrecisionPolicy, "MixedPrecisionPolicy(...)")
    if offload_policy is not None:
        check_instance(
            "fully_shard", "offload_policy", offload_policy, OffloadPolicy, "CPUOffloadPolicy() or None"
        )
    check_flag(
        "fully_shard", "comm_fusion", comm_fusion, "True: one collective per unit, False: one per parameter"
    )


# Which unit took the parameters of a module: each module a unit manages directly (down to nested
# units) maps, weakly, to the module of the unit it lies under (one of a list unit's modules). Read
# to name the parent when a child is passed to fully_shard after it (see _check_not_taken).
_TAKEN: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()


def _check_not_taken(module: nn.Module, index: int) -> None:
    """Refuse a module whose parameters a unit above it already took (``fully_shard`` top-down).

    ``fully_shard`` on a parent takes every parameter below it that no
    nested unit holds, so calling it on a child afterwards would shard
    shards again (it used to fail deep inside, about DTensor meshes). The
    owner must be a live unit outside ``module``'s subtree: the units of
    children wrapped first, bottom-up, are inside it.
    """
    subtree = {id(sub) for sub in module.modules()}
    for name, sub in module.named_modules():
        ref = _TAKEN.get(sub)
        owner = ref() if ref is not None else None
        if owner is None or id(owner) in subtree or get_state(owner) is None:
            continue
        path = next((n for n, m in owner.named_modules() if m is module), None)
        where = f" as {path!r}" if path else ""
        inner = f" (its submodule {name!r} too)" if name else ""
        raise ValueError(
            f"fully_shard: {type(module).__name__} (module[{index}]) is already managed by the fully_shard "
            f"of its parent {type(owner).__name__}{where}, which took its parameters{inner}; call "
            "fully_shard bottom-up (children first): each block, then the parent. Build the model again "
            "(or start from an unsharded copy) and wrap it in that order."
        )


def _param_list(name: str, value: Any) -> list[Any]:
    """``ignored_params`` / ``replicate_params`` as a list: Parameters, not one tensor or a module."""
    if value is None:
        return []
    if isinstance(value, (torch.Tensor, nn.Module, str)) or not isinstance(value, Iterable):
        hint = "[param]" if isinstance(value, torch.Tensor) else "list(module.parameters())"
        raise TypeError(
            f"fully_shard: {name} is a {type(value).__name__}, not an iterable of parameters; pass a list or "
            f"set of nn.Parameters, e.g. {hint}."
        )
    items = list(value)
    for index, item in enumerate(items):
        if not isinstance(item, nn.Parameter):
            hint = f" (for a name: module.get_parameter({item!r}))" if isinstance(item, str) else ""
            raise TypeError(
                f"fully_shard: {name}[{index}]={item!r:.60} is a {type(item).__name__}, not an nn.Parameter; "
                f"pass the module's Parameter objects{hint}."
            )
    return items


def param_ids(
    modules: list[nn.Module], ignored_params: Any, replicate_params: Any
) -> tuple[set[int], set[int]]:
    """The ids of ``ignored_params`` and ``replicate_params``, each checked against ``modules``.

    A parameter of another module (another copy of the model, a stale
    Parameter object) would otherwise be skipped without a word, and the one
    the user meant stays sharded. A parameter a nested ``fully_shard`` already
    took is fine when that call held it the same way (a set of norm weights
    passed to every call, as the blocks' and the root's ``replicate_params``),
    and refused when it did not: the nested call decided, and this call's
    wish would be ignored.
    """
    ignored = _param_list("ignored_params", ignored_params)
    replicated = _param_list("replicate_params", replicate_params)
    if not ignored and not replicated:
        return set(), set()
    names: dict[int, str] = {}
    for index, module in enumerate(modules):
        base = "" if len(modules) == 1 else f"[{index}]."
        for name, param in module.named_parameters():
            names.setdefault(id(param), base + name)
    nested = _nested_params(modules)
    for what, items in (("ignored_params", ignored), ("replicate_params", replicated)):
        for index, param in enumerate(items):
            taken = nested.get(id(param))
            if taken is not None:
                if what == "replicate_params" and taken.replicate:
                    continue  # the nested call replicated it too
                held = "replicated" if taken.replicate else f"sharded on dim {taken.shard_dim}"
                raise ValueError(
                    f"fully_shard: {what}[{index}] is {taken.fqn!r} (shape {tuple(param.shape)}), which an "
                    f"earlier fully_shard call on a submodule already took and {held}; pass it in {what} of "
                    "that call instead (the unit that takes a parameter decides how it is held)."
                )
            if id(param) not in names:
                kinds = ", ".join(type(m).__name__ for m in modules)
                raise ValueError(
                    f"fully_shard: {what}[{index}] (shape {tuple(param.shape)}) is not a parameter of the "
                    f"module(s) passed ({kinds}); pass parameters of these modules, e.g. "
                    "[module.get_parameter('name')] (a set shared by several calls: keep, per call, the "
                    "parameters of that call's module)."
                )
    both = [names.get(i, "?") for i in set(map(id, ignored)) & set(map(id, replicated))]
    if both:
        raise ValueError(
            f"fully_shard: {sorted(both)} are in both ignored_params and replicate_params; pass each "
            "parameter in one: ignored_params leaves it alone, replicate_params keeps it whole and "
            "all-reduces it."
        )
    return set(map(id, ignored)), set(map(id, replicated))


def _nested_params(modules: list[nn.Module]) -> dict[int, FSDPParam]:
    """Parameters units nested in ``modules`` manage, by the id of their shard and of the original."""
    out: dict[int, FSDPParam] = {}
    for m in modules:
        for sub in m.modules():
            state = get_state(sub)
            if state is not None and state.group is not None:
                for p in state.group.params:
                    out[id(p.sharded_param)] = p
                    out[p.orig_param_id] = p
    return out


def _owned_by_units(modules: list[nn.Module]) -> tuple[set[int], dict[int, str]]:
    """Parameters already managed by units nested inside ``modules``.

    Returns the ids of their sharded parameters, and the ids of the original
    parameters they replaced (with the name they were sharded under), which a
    module outside that unit may still hold when a weight is tied.
    """
    nested = _nested_params(modules).values()
    return {id(p.sharded_param) for p in nested}, {p.orig_param_id: p.fqn for p in nested}


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
    for top in modules:  # the plan is final: remember which of the unit's modules takes each one
        for _, module in _managed_modules([top]):
            _TAKEN[module] = weakref.ref(top)
    return order


def _shard_of(placement: Any, fqn: str) -> Shard | None:
    """What ``shard_placement_fn`` returned for ``fqn``, as hp_dtensor's ``Shard`` (or None).

    torch's ``torch.distributed.tensor.Shard(d)``, what FSDP2's
    ``shard_placement_fn`` returns, means the same here and is read by its
    dim; anything else (``Replicate()``, torch's strided shard, a plain int)
    is refused naming what came back.
    """
    if placement is None or isinstance(placement, Shard):
        return placement
    if from_torch(placement) and type(placement).__name__ == "Shard" and isinstance(placement.dim, int):
        return Shard(placement.dim)
    kind = torch_name(placement) if from_torch(placement) else type(placement).__name__
    raise TypeError(
        f"fully_shard: shard_placement_fn returned {placement!r} for {fqn!r}; return Shard(dim) or None "
        "(hp_dtensor.Shard or torch.distributed.tensor.Shard to shard that dim, None for dim 0), not a "
        f"{kind}."
    )


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
            placement = _shard_of(shard_placement_fn(param), fqn)
            if placement is not None:
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

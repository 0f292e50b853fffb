"""Every check on hp_fsdp's public entry points, and the plan of which parameters a unit takes.

Everything here only reads the model (it remembers, weakly, which unit took
which modules, to name the parent when a child is wrapped after it).
``fully_shard``, the policies' ``__post_init__``,
the :class:`~hp_fsdp.api.HSDPModule` methods and the state-dict load hook run
these checks before they change anything, so a rejected call leaves the model
as it was; every error names the value it saw and the fix. The one check that
needs other ranks, that every rank called ``fully_shard`` alike, runs at the
first communication instead (see [Note: cross-rank agreement]).
"""

from __future__ import annotations

import hashlib
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import hp_core.collectives as hc
import torch
from hp_core import DeviceMesh
from hp_core.distributed import get_world_size
from hp_dtensor import DTensor, Shard
from torch import nn

from hp_fsdp.param import FSDPParam, ParamInfo
from hp_fsdp.post_forward import group_sizes
from hp_fsdp.tp_layout import check_tp_param

if TYPE_CHECKING:
    from hp_fsdp.policies import MixedPrecisionPolicy
    from hp_fsdp.state import FSDPState

__all__ = [
    "ParamPlan",
    "check_agreement",
    "check_divide_factor",
    "check_flag",
    "check_mixed_precision",
    "check_prefetch_under_root",
    "check_reduce_op_type",
    "check_reshard_after_forward",
    "check_state_dict",
    "collect_params",
    "param_ids",
    "prefetch_states",
    "validate_call",
]


def _get_state(module: nn.Module) -> FSDPState | None:
    # hp_fsdp.state (and hp_fsdp.policies) import this module at import time, so the state module
    # is looked up when first needed: importing it here at the top would be circular.
    from hp_fsdp.state import get_state

    return get_state(module)


# -- plain values ---------------------------------------------------------------------------


def check_flag(what: str, name: str, value: Any, meaning: str) -> None:
    """``value`` must be a real bool: a string like ``"no"`` or an int would be truthy and mean yes.

    ``meaning`` says what True and False do, so the message carries the fix.
    """
    if not isinstance(value, bool):
        raise TypeError(
            f"{what}: {name}={value!r} is a {type(value).__name__}, not a bool; "
            f"pass True or False ({meaning})."
        )


def _check_dtype(what: str, name: str, value: Any, meaning: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{what}: {name}={value!r} is a {type(value).__name__}, not a torch.dtype; pass a floating-point "
            f"torch.dtype such as torch.bfloat16 or torch.float32, or None ({meaning})."
        )
    if not value.is_floating_point:
        raise ValueError(
            f"{what}: {name}={value} is not a floating-point dtype, and parameters and gradients cast to it "
            "could not take gradients or be averaged; pass torch.bfloat16, torch.float16 or torch.float32, "
            f"or None ({meaning})."
        )


def check_mixed_precision(policy: MixedPrecisionPolicy) -> None:
    """The fields of a :class:`~hp_fsdp.policies.MixedPrecisionPolicy` (run by its ``__post_init__``)."""
    what = "MixedPrecisionPolicy"
    _check_dtype(what, "param_dtype", policy.param_dtype, "None: compute in each parameter's own dtype")
    _check_dtype(what, "reduce_dtype", policy.reduce_dtype, "None: reduce in param_dtype")
    _check_dtype(what, "output_dtype", policy.output_dtype, "None: leave forward outputs as computed")
    check_flag(
        what, "cast_forward_inputs", policy.cast_forward_inputs, "True casts floating inputs to param_dtype"
    )
    check_flag(
        what,
        "apply_grad_on_fp32_main_grad",
        policy.apply_grad_on_fp32_main_grad,
        "True accumulates into an fp32 main_grad instead of .grad",
    )


def _from_torch(value: Any) -> bool:
    """Whether ``value`` is an instance of one of torch.distributed's classes (FSDP2's, DTensor's)."""
    return type(value).__module__.startswith("torch.distributed")


def _torch_name(value: Any) -> str:
    """The public name of a torch.distributed class (``torch.distributed.fsdp.MixedPrecisionPolicy``)."""
    module = type(value).__module__
    for public in ("torch.distributed.fsdp", "torch.distributed.tensor"):
        if module.startswith(public):
            module = public
            break
    return f"{module}.{type(value).__name__}"


def _hp_equivalent(value: Any) -> str:
    """``value`` (a torch.distributed.fsdp policy, a dataclass) as the hp_fsdp call with its fields."""
    values = ", ".join(f"{f.name}={getattr(value, f.name)!r}" for f in fields(value))
    return f"hp_fsdp.{type(value).__name__}({values})"


def _instance_of(what: str, name: str, value: Any, cls: type, example: str) -> None:
    """``value`` must be an instance of ``cls``; passing the class itself is the usual slip.

    The other usual one is FSDP2's policy of the same name
    (``torch.distributed.fsdp.MixedPrecisionPolicy``), which hp_fsdp's
    ``fully_shard`` does not read: the message spells out the hp_fsdp
    policy with the same field values.
    """
    if isinstance(value, cls):
        return
    if isinstance(value, type) and issubclass(value, cls):
        raise TypeError(
            f"{what}: {name}={value.__name__} is the class, not a policy; instantiate it: {example}."
        )
    if _from_torch(value):
        try:
            fix = _hp_equivalent(value)
        except TypeError:  # not a dataclass in this torch version: name the class only
            fix = f"hp_fsdp.{type(value).__name__}(...)"
        raise TypeError(
            f"{what}: {name}={value!r} is {_torch_name(value)}, torch's FSDP2 "
            f"policy, not hp_fsdp's; import the policy from hp_fsdp instead: pass {fix} (the same fields)."
        )
    raise TypeError(
        f"{what}: {name}={value!r} is a {type(value).__name__}, not an instance of {cls.__name__}; "
        f"pass {example}."
    )


def check_divide_factor(factor: Any) -> None:
    """A finite positive real: 0, a negative, NaN or inf would make every gradient 0, NaN or flip it."""
    bad_type = not isinstance(factor, (int, float)) or isinstance(factor, bool)
    if bad_type or not math.isfinite(factor) or factor <= 0:
        raise ValueError(
            f"set_gradient_divide_factor: factor={factor!r} is not a finite positive number; pass the number "
            "the summed gradients are divided by (e.g. the data-parallel world size, or 1.0 for a plain sum)."
        )


def check_reduce_op_type(reduce_op_type: Any) -> None:
    """Only the two ops FSDP2 offers; anything else would silently fall back to one of them."""
    if reduce_op_type not in ("avg", "sum") or not isinstance(reduce_op_type, str):
        raise ValueError(
            f"set_reduce_op_type: reduce_op_type={reduce_op_type!r}; pass 'avg' (the mean over the "
            "data-parallel ranks) or 'sum'. For another divisor use set_gradient_divide_factor."
        )


def prefetch_states(what: str, modules: Any, owner: FSDPState) -> list[FSDPState]:
    """The units named in a ``set_modules_to_*_prefetch`` list; all checked before any is recorded.

    Whether they share ``owner``'s root can only be told once the root is
    known: here when the tree already ran, otherwise at the root's first
    forward (:func:`check_prefetch_under_root`).
    """
    if isinstance(modules, nn.Module) or not isinstance(modules, (list, tuple)):
        raise TypeError(
            f"{what}: modules is a {type(modules).__name__}, not a list; pass a list of fully_shard-ed "
            f"modules, e.g. [{type(modules).__name__ if isinstance(modules, nn.Module) else 'block'}]."
        )
    states: list[FSDPState] = []
    for index, module in enumerate(modules):
        state = _get_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(
                f"{what}: modules[{index}] ({type(module).__name__}) was not passed to fully_shard; only "
                "fully_shard-ed modules can be prefetched. Call fully_shard on it first."
            )
        states.append(state)
    context = owner.context
    if context is not None:
        for index, state in enumerate(states):
            if state not in context.states:
                raise ValueError(
                    f"{what}: modules[{index}] ({type(state.modules[0]).__name__}) is a unit of another root "
                    f"than {type(owner.modules[0]).__name__}, so its gather would never be used there; "
                    "prefetch only units that run under the same root module."
                )
    return states


def check_prefetch_under_root(states: Sequence[FSDPState]) -> None:
    """Every explicit prefetch target of ``states`` (one root's units) is one of them."""
    members = set(map(id, states))
    for state in states:
        for what, targets in (
            ("set_modules_to_forward_prefetch", state.forward_prefetch),
            ("set_modules_to_backward_prefetch", state.backward_prefetch),
        ):
            for target in targets or ():
                if id(target) not in members:
                    raise ValueError(
                        f"{what}: {type(state.modules[0]).__name__} prefetches "
                        f"{type(target.modules[0]).__name__}, a unit outside the root "
                        f"{type(states[0].modules[0]).__name__} it runs under, so the gather would never be "
                        "used; prefetch only units under the same root module."
                    )


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
    from hp_fsdp.policies import MixedPrecisionPolicy, OffloadPolicy

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
        if _get_state(m) is not None:
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
        kind = _torch_name(mesh) if _from_torch(mesh) else type(mesh).__name__
        raise TypeError(
            f"fully_shard: mesh must be an hp_core.DeviceMesh, got {kind}; build one with "
            "hp_core.init_device_mesh(device_type, (world_size,))."
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
    _instance_of("fully_shard", "mp_policy", mp_policy, MixedPrecisionPolicy, "MixedPrecisionPolicy(...)")
    if offload_policy is not None:
        _instance_of(
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
        if owner is None or id(owner) in subtree or _get_state(owner) is None:
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
            state = _get_state(sub)
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
        if not top and _get_state(module) is not None:
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
    if _from_torch(placement) and type(placement).__name__ == "Shard" and isinstance(placement.dim, int):
        return Shard(placement.dim)
    kind = _torch_name(placement) if _from_torch(placement) else type(placement).__name__
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


# -- cross-rank agreement ----------------------------------------------------------------------

# [Note: cross-rank agreement]
# Each rank calls ``fully_shard`` on its own copy of the model, and nothing
# stops the copies or the arguments from differing (a rank-dependent branch,
# a config read per host). The units' collectives then disagree: a different
# parameter shape or dtype, ``mp_policy``, ``comm_fusion`` or
# ``shard_placement_fn`` changes the all-gather's size (gloo aborts the
# process, NCCL may hang), a different ``reshard_after_forward`` makes one
# rank all-gather in backward while the other does not (a hang), and a shape
# that pads to the same size (13 rows against 14 over 2 ranks) trains on
# mixed-up data without any error at all.
#
# Telling this needs the other ranks' arguments, i.e. communication, and
# ``fully_shard`` itself communicates nothing: on the usual meshes it only
# reads process groups the mesh already built. Adding a collective there
# would make every ``fully_shard`` call a synchronisation point that all
# ranks must reach in the same order, which today they need not (wrapping
# order is free; under pipeline parallelism stages wrap different numbers of
# blocks). So the check rides on the first moment the units communicate
# anyway: the root's first forward (its lazy init), or an explicit
# ``unshard()`` / ``reduce_grad()`` before any forward (how a pipeline
# schedule drives its units), before the first all-gather is issued.
#
# It cannot ride *inside* that all-gather: the all-gather's size is exactly
# what a mismatch changes, so the carrier would break before the check could
# be read. It is a separate exchange of a fixed size: each rank hashes the
# facts of every unit under the root (per parameter its name, global shape,
# dtype, shard dim, replicate and requires_grad; per unit the mesh shape,
# ``reshard_after_forward``, ``mp_policy``, ``comm_fusion`` and the explicit
# prefetch lists) and ``all_gather_object``s the 16-character digest, once
# per root: one collective on a 1-D mesh (which torch runs as two tiny
# all-gathers, the pickled size and then the bytes; it is not in
# ``hp_testing.record_collectives``' per-step counts). On a 2-D mesh it is one per mesh
# dim (shard, then replicate, so every rank sees every digest): one over the
# flattened mesh would need a new process group, which is created
# collectively over the whole world and, inside a pipeline stage's first
# forward, would wait for stages that are blocked receiving from it. Only
# when the digests differ do the ranks exchange the facts themselves (every
# rank sees the same digests, so all take that path together) to name the
# first differing value rank by rank; then every rank raises, before any unit
# gathers. The units were already sharded by then, each rank consistently
# with its own arguments; what the check guarantees is that no rank enters a
# mismatched collective and that the error names the difference. Checks
# that only read local state but run at that moment (prefetch targets under
# the same root) are decided after the exchange, from facts it compared, so
# they too raise on every rank or on none. Flags changed after the first
# forward (``set_requires_gradient_sync`` and the other setters) are not
# compared: they are per-step switches, and checking them would cost a
# collective per step.


def _unit_facts(state: FSDPState, names: dict[int, str]) -> dict[str, Any]:
    """What must agree across ranks for one unit's collectives to match (see [Note: cross-rank agreement])."""
    group = state.group

    def target(other: FSDPState) -> str:
        return names.get(id(other), "<a unit outside this tree>")

    facts: dict[str, Any] = {
        "reshard_after_forward": state.reshard_after_forward,
        **{f"mp_policy.{f.name}": _plain(getattr(state.mp_policy, f.name)) for f in fields(state.mp_policy)},
        "forward_prefetch": None
        if state.forward_prefetch is None
        else [target(t) for t in state.forward_prefetch],
        "backward_prefetch": None
        if state.backward_prefetch is None
        else [target(t) for t in state.backward_prefetch],
    }
    if group is None:
        facts["parameters"] = []
        return facts
    facts["mesh"] = tuple(group.mesh.shape)
    facts["comm_fusion"] = group.comm_fusion
    facts["parameters"] = [
        (
            p.fqn,
            p.global_shape,
            str(p.orig_dtype).removeprefix("torch."),
            "replicate" if p.replicate else f"Shard({p.shard_dim})",
            "requires_grad" if p.sharded_param.requires_grad else "frozen",
        )
        for p in group.params
    ]
    return facts


def _plain(value: Any) -> Any:
    """A dtype as its name (readable in a message, and the same text on every rank)."""
    return str(value) if isinstance(value, torch.dtype) else value


def _unit_names(roots: Sequence[nn.Module], states: Sequence[FSDPState]) -> dict[int, str]:
    """A readable name per unit: its first module's path under ``roots`` ('<root>' for the top)."""
    names: dict[int, str] = {}
    wanted = set(map(id, states))
    for index, root in enumerate(roots):
        base = "" if len(roots) == 1 else f"[{index}]"
        for path, module in root.named_modules():
            state = _get_state(module)
            if state is not None and id(state) in wanted and id(state) not in names:
                full = f"{base}.{path}" if base and path else (base or path)
                names[id(state)] = full or "<root>"
    for state in states:  # a unit reached some other way (not under ``roots``)
        names.setdefault(id(state), f"<{type(state.modules[0]).__name__}>")
    return names


def _gather_over_mesh(obj: Any, mesh: DeviceMesh) -> list[Any]:
    """Every mesh rank's ``obj`` in the mesh's row-major rank order, one exchange per mesh dim."""
    gathered = [obj]
    for dim in reversed(range(mesh.ndim)):  # shard dim first, then replicate: rows, then rows of rows
        parts = hc.all_gather_object(gathered, mesh.get_group(dim))
        gathered = [item for part in parts for item in part]
    return gathered


def _describe(values: list[Any], ranks: list[int]) -> str:
    """``value on ranks [..]`` per distinct value, so a large world stays one line per value."""
    by_value: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        by_value.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
    return "; ".join(
        f"{value} on rank{'s' if len(r) > 1 else ''} {r if len(r) > 1 else r[0]}"
        for value, r in by_value.items()
    )


def _first_difference(per_rank: list[list[tuple[str, dict[str, Any]]]], ranks: list[int]) -> str:
    """The first unit / field / parameter where the ranks' facts differ, with every rank's value."""
    unit_lists = [[name for name, _ in units] for units in per_rank]
    if len(set(map(tuple, unit_lists))) > 1:
        return f"the units (fully_shard calls) under this root differ: {_describe(unit_lists, ranks)}"
    for index, (name, _) in enumerate(per_rank[0]):
        facts = [units[index][1] for units in per_rank]
        for key in facts[0]:
            values = [f.get(key) for f in facts]
            if all(v == values[0] for v in values):
                continue
            if key != "parameters":
                return f"unit {name!r}: {key} differs: {_describe(values, ranks)}"
            fqns = [[p[0] for p in v or ()] for v in values]
            if any(f != fqns[0] for f in fqns):
                return f"unit {name!r}: its parameters differ: {_describe(fqns, ranks)}"
            for position, fqn in enumerate(fqns[0]):
                params = [v[position][1:] for v in values if v is not None]
                if any(p != params[0] for p in params):
                    return (
                        f"unit {name!r}: parameter {fqn!r} (shape, dtype, placement, grad) differs: "
                        f"{_describe(params, ranks)}"
                    )
    return "the units' facts differ"  # pragma: no cover - the digests differed, so some fact does


def check_agreement(
    roots: Sequence[nn.Module], states: Sequence[FSDPState], check: Sequence[FSDPState]
) -> None:
    """Raise on every rank if the ranks built ``check``'s units differently ([Note: cross-rank agreement]).

    ``states`` are all units of the tree (to name prefetch targets),
    ``check`` those not compared yet; they are marked agreed on success.
    One ``all_gather_object`` of a digest per mesh dim, over the mesh of the
    first unit that has parameters; nothing when no unit communicates.
    """
    meshes = [s.group.mesh for s in check if s.group is not None]
    if not meshes:
        return
    mesh = meshes[0]
    names = _unit_names(roots, states)
    local = [(names[id(s)], _unit_facts(s, names)) for s in check]
    digest = hashlib.sha256(repr(local).encode()).hexdigest()[:16]
    digests = _gather_over_mesh(digest, mesh)
    if len(set(digests)) > 1:
        per_rank = _gather_over_mesh(local, mesh)
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        raise ValueError(
            "hp_fsdp: the ranks called fully_shard differently, so the units' collectives would not match "
            f"(a hang, an abort, or silently mixed-up data): {_first_difference(per_rank, ranks)}. Call "
            "fully_shard on every rank with the same module structure, parameter shapes and dtypes and the "
            "same arguments (compute any rank-dependent choice identically on all ranks first). Detected at "
            "the first communication, before any unit gathered; see [Note: cross-rank agreement]."
        )
    for state in check:
        state.agreed = True
        if state.group is not None:  # a name every rank shares: it tags the unit's reductions
            state.group.unit_name = names[id(state)]


# -- state dicts -------------------------------------------------------------------------------


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating-point"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def listed(problems: list[str], cap: int) -> str:
    """The first ``cap`` problems joined for an error message, and how many more there are."""
    more = f"; and {len(problems) - cap} more" if len(problems) > cap else ""
    return "; ".join(problems[:cap]) + more


def check_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, strict: bool) -> None:
    """Check ``module``'s entries of a state dict before ``load_state_dict`` copies any of them.

    nn.Module reports a missing or unexpected key only after it copied the
    others, and a wrong shape of a DTensor on another mesh only after
    gathering it; and it casts an integer tensor into a float parameter
    without a word. Here, in the pre-hook of the outermost unit reached,
    every parameter of the unit's subtree is checked at once: present (when
    ``strict``), a tensor, its global shape, and a dtype of the same kind
    (floating point stays floating point; precision may change, as when a
    float32 checkpoint is loaded into a bfloat16 model).
    """
    problems: list[str] = []
    expected: set[str] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        expected.add(key)
        if key not in state_dict:
            if strict:
                problems.append(f"{key!r} is missing")
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
            continue
        if tuple(value.shape) != tuple(param.shape):
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the model's is {tuple(param.shape)}")
        elif _dtype_kind(value.dtype) != _dtype_kind(param.dtype):
            problems.append(
                f"{key!r} is {str(value.dtype).removeprefix('torch.')}, the model's is "
                f"{str(param.dtype).removeprefix('torch.')} "
                f"({_dtype_kind(value.dtype)} into {_dtype_kind(param.dtype)})"
            )
    if strict:
        for sub_name, sub in module.named_modules(remove_duplicate=False):
            base = prefix + (f"{sub_name}." if sub_name else "")
            for buffer_name, buffer in sub._buffers.items():
                if buffer is not None and buffer_name not in sub._non_persistent_buffers_set:
                    expected.add(base + buffer_name)
            if type(sub).set_extra_state is not nn.Module.set_extra_state:
                expected.add(base + "_extra_state")
        unexpected = sorted(k for k in state_dict if k.startswith(prefix) and k not in expected)
        problems.extend(f"{key!r} is not in the model" for key in unexpected[:5])
    if problems:
        raise RuntimeError(
            f"load_state_dict into {type(module).__name__}: {listed(problems, 8)}. Nothing of it was "
            "loaded. Pass the state dict of this model (the keys of model.state_dict(), full tensors or "
            "DTensors of the same global shape, cast with .to(dtype) where the kind differs), or "
            "strict=False to load a subset."
        )

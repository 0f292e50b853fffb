"""State dicts of a unit: checks and hooks for ``state_dict`` and ``load_state_dict``.

``state_dict()`` returns the sharded DTensors (a unit left gathered is
resharded first); ``load_state_dict`` takes full tensors or DTensors of any
placement, checked for the whole subtree before anything is copied
(:func:`check_state_dict`), or, with ``assign=True``, the shards themselves
([Note: loading with assign=True] in :mod:`hp_fsdp.param`).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hp_fsdp.param_group import FSDPParamGroup
from hp_fsdp.state import FSDPState, eager, states_below

__all__ = ["check_state_dict", "register_state_dict_hooks"]


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating-point"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def _listed(problems: list[str], cap: int) -> str:
    """The first ``cap`` problems joined for an error message, and how many more there are."""
    more = f"; and {len(problems) - cap} more" if len(problems) > cap else ""
    return "; ".join(problems[:cap]) + more


def check_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Check ``module``'s entries of a state dict before ``load_state_dict`` copies any of them.

    nn.Module reports a wrong shape of a DTensor on another mesh only after
    gathering it, and it casts an integer tensor into a float parameter
    without a word. Here, in the pre-hook of the outermost unit reached,
    every parameter of the unit's subtree that the state dict holds is
    checked at once: a tensor, its global shape, and a dtype of the same kind
    (floating point stays floating point; precision may change, as when a
    float32 checkpoint is loaded into a bfloat16 model).

    Missing and unexpected keys are left to nn.Module, as in FSDP2: the hook
    cannot tell them apart from right ones. nn.Module hands every pre-hook
    ``strict=True`` whatever the caller passed, so a check here would refuse
    ``load_state_dict(..., strict=False)``; and a submodule's own pre-hook
    may still rename keys after this one ran (torchtitan's fused QKV merges
    ``wq`` / ``wk`` / ``wv`` into ``wqkv``).
    """
    problems: list[str] = []
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        if key not in state_dict:
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
    if problems:
        raise RuntimeError(
            f"load_state_dict into {type(module).__name__}: {_listed(problems, 8)}. Nothing of it was "
            "loaded. Pass the state dict of this model (the keys of model.state_dict(), full tensors or "
            "DTensors of the same global shape, cast with .to(dtype) where the kind differs)."
        )


def _assigning(local_metadata: Any) -> bool:
    return bool(local_metadata.get("assign_to_params_buffers", False))


def _check_assign(
    module: nn.Module, states: list[FSDPState], state_dict: dict[str, Any], prefix: str
) -> None:
    """``load_state_dict(assign=True)``: every managed value of the subtree must be its shard.

    See [Note: loading with assign=True] in :mod:`hp_fsdp.param`. Runs in the
    outermost unit's pre-hook, before nn.Module assigns anything.
    """
    names = {id(sub): name for name, sub in module.named_modules(remove_duplicate=False)}
    problems = []
    for state in states:
        for param in state.group.params if state.group is not None else []:
            for info in param.infos:
                name = names.get(id(info.module))
                if name is None:
                    continue
                key = prefix + (f"{name}." if name else "") + info.name
                value = state_dict.get(key)
                if isinstance(value, torch.Tensor):
                    problem = param.assign_problem(key, value)
                    if problem is not None:
                        problems.append(problem)
    if problems:
        _raise_assign(type(module).__name__, problems)


def _raise_assign(owner: str, problems: list[str]) -> None:
    raise RuntimeError(
        f"load_state_dict(assign=True) into {owner}: {_listed(problems, 6)}. Nothing was loaded. "
        "assign=True makes each value the sharded parameter itself, so it must be an hp_dtensor.DTensor with"
        " the parameter's mesh and placements (the values of model.state_dict() of a model sharded the same "
        "way, or hp_dtensor.distribute_tensor(full, param.device_mesh, param.placements)), on the shard's "
        "device. Full tensors or DTensors of another sharding load without assign=True (for a meta-device "
        "model after model.to_empty(device=...)), which copies them into the shards."
    )


def register_state_dict_hooks(state: FSDPState) -> None:
    """The unit's ``state_dict`` and ``load_state_dict`` hooks (their handles join ``state``'s)."""

    @eager
    def save_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """A state dict holds shards: reshard a unit left gathered (the root after forward)."""
        _refuse_torch_full_state_dict()
        if state.group is not None and state.group.is_unsharded:
            state.group.reshard()

    for module in state.modules:
        state.handles.append(module.register_state_dict_pre_hook(save_pre_hook))
    state.handles.extend(_register_load_hooks(state.group, state.modules))


def _register_load_hooks(group: FSDPParamGroup | None, modules: Sequence[nn.Module]) -> list[Any]:
    """Let ``load_state_dict`` take full tensors or sharded DTensors for every managed parameter.

    The hook sits on each owning module, so the state-dict key is simply the
    module's prefix plus the attribute name. The unit's own modules get a
    hook that checks their whole subtree's entries first
    (:func:`check_state_dict`): nn.Module runs a parent's
    pre-hooks before it copies anything of the parent or its children, so a
    bad entry is refused before any parameter of the unit changes.

    [Note: loading into a gathered unit]
    A unit may still be gathered when ``load_state_dict`` runs: the root
    keeps its parameters after a forward without grad (an evaluation pass),
    a unit with ``reshard_after_forward=False`` too, and a prefetch may be
    in flight. Its modules then hold the temporary gathered parameters, and
    nn.Module would copy into those, which the next reshard throws away:
    the shards would silently keep their old values. So every pre-hook
    reshards first (the unit's own hook the whole subtree, each owning
    module's hook its unit, for a ``load_state_dict`` called on a submodule),
    as FSDP2's load pre-hook does; the next forward gathers the loaded
    shards.

    A post-hook on each owning module adopts what ``assign=True`` registered
    (see [Note: loading with assign=True] in :mod:`hp_fsdp.param`).
    """
    params = group.params if group is not None else []
    handles = []
    for module in modules:

        def check(
            state_dict: dict[str, Any],
            prefix: str,
            local_metadata: Any,
            strict: bool,
            *args: Any,
            _m: nn.Module = module,
        ) -> None:
            check_state_dict(_m, state_dict, prefix)
            states = states_below([_m])
            if _assigning(local_metadata):
                _check_assign(_m, states, state_dict, prefix)
            for state in states:  # see [Note: loading into a gathered unit]
                if state.group is not None:
                    state.group.reshard()

        handles.append(module._register_load_state_dict_pre_hook(check))
    owned: dict[int, tuple[nn.Module, list[Any]]] = {}
    for param in params:
        for info in param.infos:

            def hook(
                state_dict: dict[str, Any],
                prefix: str,
                local_metadata: Any,
                *args: Any,
                _p: Any = param,
                _n: str = info.name,
                _m: nn.Module = info.module,
            ) -> None:
                key = prefix + _n
                value = state_dict.get(key)
                if isinstance(value, torch.Tensor) and _assigning(local_metadata):
                    problem = _p.assign_problem(key, value)
                    if problem is not None:
                        _raise_assign(type(_m).__name__, [problem])
                if group is not None:
                    group.reshard()  # see [Note: loading into a gathered unit]
                if isinstance(value, torch.Tensor) and not _assigning(local_metadata):
                    state_dict[key] = _p.load_full_or_sharded(value)

            handles.append(info.module._register_load_state_dict_pre_hook(hook))
            owned.setdefault(id(info.module), (info.module, []))[1].append(param)
    for module, module_params in owned.values():

        def adopt(_module: nn.Module, incompatible: Any, _ps: list[Any] = module_params) -> None:
            for p in _ps:
                p.adopt_registered()

        handles.append(module.register_load_state_dict_post_hook(adopt))
    return handles


_TORCH_STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"
_TORCH_STATE_DICT_GETTERS = frozenset({"get_model_state_dict", "get_state_dict"})


def _refuse_torch_full_state_dict() -> None:
    """Refuse torch's ``get_model_state_dict`` / ``get_state_dict`` asked for a full state dict.

    [Note: torch's full state dict helpers]
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
    options=StateDictOptions(full_state_dict=True))`` calls
    ``model.state_dict()`` and then gathers every value that is a
    ``torch.distributed.tensor.DTensor`` (an ``isinstance`` test); any other
    tensor is passed through as if it were already full. hp_fsdp's values are
    ``hp_dtensor.DTensor``s, which torch cannot recognise: the helper
    returned each rank's local shard where the full tensor belongs, and a
    ``torch.save`` of it on rank 0 wrote a "full" checkpoint holding one
    shard per parameter. torch offers no protocol to take part in that
    gather (the test is on its own class; nothing is called on a value it
    passes through, so the value cannot object either), and the
    ``state_dict()`` call itself does not say which kind was asked for. The
    options are an argument of torch's public entry points, so this pre-hook
    looks for an enclosing call of one of them and reads its ``options``; if
    it asks for a full state dict, every rank raises here, before any
    collective, naming what works instead. The sharded form
    (``full_state_dict=False``) works as it is, through DCP's protocol on
    ``hp_dtensor.DTensor``, and so do the setters with full tensors (each
    rank cuts its shard in the load pre-hook). ``get_optimizer_state_dict``
    with ``full_state_dict=True`` never calls into hp_fsdp and cannot be
    caught here (see the README).
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (
            code.co_name in _TORCH_STATE_DICT_GETTERS
            and frame.f_globals.get("__name__") == _TORCH_STATE_DICT_MODULE
        ):
            options = frame.f_locals.get("options")
            if getattr(options, "full_state_dict", False):
                raise NotImplementedError(
                    f"torch.distributed.checkpoint.state_dict.{code.co_name}(..., options=StateDictOptions("
                    f"full_state_dict=True, cpu_offload={getattr(options, 'cpu_offload', None)}, ...)) "
                    "cannot gather an hp_fsdp model: torch gathers only torch.distributed.tensor.DTensor "
                    "values and would return each rank's local shard of hp_fsdp's hp_dtensor.DTensor "
                    "parameters as if it were the full tensor. For a full state dict gather on every rank: "
                    "{k: v.full_tensor() if isinstance(v, hp_dtensor.DTensor) else v for k, v in "
                    "model.state_dict().items()} (add .cpu() to each value to keep them off the device; "
                    "keep the result on rank 0 only if you like). For a checkpoint use "
                    "full_state_dict=False (sharded DTensors) with torch.distributed.checkpoint. Loading a "
                    "full state dict works: model.load_state_dict(full) or set_model_state_dict(model, "
                    "full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=...))."
                )
            return
        frame = frame.f_back

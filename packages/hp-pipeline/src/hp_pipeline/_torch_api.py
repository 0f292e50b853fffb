"""What a schedule's ``step`` hands the executor: torch's two input forms, and torch's meshes as groups.

Details: [Note: pre-split micro-batches], [Note: meshes as groups].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from hp_pipeline.microbatch import split_args_kwargs, split_target

__all__: list[str] = []


def _rank() -> str:
    return f"rank {dist.get_rank()}" if dist.is_initialized() else "this rank"


def _check_list(name: str, value: object, m: int, entry: type | None, example: str) -> None:
    """``value`` is a list of ``m`` entries (each an ``entry`` when given), or an error with the fix."""
    if not isinstance(value, list):
        raise TypeError(
            f"step({name}=...) takes a list with one entry per micro-batch, got a {type(value).__name__}; "
            f"pass a list of n_microbatches={m} entries, e.g. {name}={example}"
        )
    if len(value) != m:
        raise ValueError(
            f"step({name}=...) has {len(value)} entries but the schedule runs n_microbatches={m}; pass "
            f"one entry per micro-batch, or build the schedule with n_microbatches={len(value)}"
        )
    if entry is None:
        return
    for k, item in enumerate(value):
        if not isinstance(item, entry):
            raise TypeError(
                f"step({name}=...) must be a list of {entry.__name__}s, but {name}[{k}] is a "
                f"{type(item).__name__}; e.g. {name}={example}"
            )
        if isinstance(item, Mapping):
            bad = [key for key in item if not isinstance(key, str)]
            if bad:
                raise TypeError(
                    f"step({name}=...): {name}[{k}] has the keys {bad}, which are not str; its keys are "
                    "the names of the stage forwards' keyword arguments"
                )


def check_losses(losses: object) -> None:
    """``losses`` is appended to after the step, so a wrong type must fail before it runs.

    Raised inside ``step``'s pre-step ``try``, so every rank raises it (as a
    :class:`~hp_pipeline.PipelineStepError`) and no rank computes.
    """
    if losses is not None and not isinstance(losses, list):
        raise TypeError(
            f"step(losses=...) takes a list to append each micro-batch's loss to, got a "
            f"{type(losses).__name__} ({losses!r}); pass losses=[] (or leave it None)"
        )


def check_eval_losses(last_stage: int | None, target: Any, target_mbs: Any) -> None:
    """An eval step computes losses only from targets: ``losses=`` without them would stay empty.

    ``last_stage``: its index when this rank hosts it, the step is an eval of
    a schedule with a ``loss_fn`` and ``losses=`` was given; else ``None``.
    """
    if last_stage is not None and target is None and target_mbs is None:
        raise ValueError(
            f"{_rank()} hosts the last stage ({last_stage}) and eval() got losses= but no target=, so there "
            "is no loss to compute; pass the batch's targets, e.g. schedule.eval(target=y, losses=losses) "
            "or eval(..., target_mbs=[y0, y1, ...]), or leave losses out to get the outputs only"
        )


# [Note: pre-split micro-batches]
# torch's newest pipelining takes a step's inputs in one of two forms, and so
# do we. The whole batch, ``step(*args, target=y, **kwargs)``, is cut into
# ``n_microbatches`` pieces by the chunk specs ([Note: nested batches] in
# :mod:`hp_pipeline.microbatch`). The pre-split form, ``step(arg_mbs=[...],
# kwarg_mbs=[...], target_mbs=[...])``, gives one entry per micro-batch and is
# used as given: a tuple of positional inputs, a dict of keyword inputs and a
# target for micro-batch ``k``. torchtitan uses the second form because a batch
# whose metadata depends on its rows (variable-length attention offsets, masks
# built per micro-batch) cannot be cut by a chunk spec.
#
# The meaning follows torch's ``_get_microbatch_inputs``: the form is
# pre-split as soon as one of the three lists is given; the two forms cannot be
# mixed (a positional input, a model keyword or ``target=`` beside a list is an
# error naming what to move where); each list is a ``list`` of exactly
# ``n_microbatches`` entries; ``arg_mbs`` holds tuples and ``kwarg_mbs`` dicts;
# a list left out means "nothing" for every micro-batch. Positional inputs
# reach stage 0 only (later stages take the previous stage's outputs), keyword
# inputs reach the forward of every stage of the rank they are given on (torch's
# ``forward_one_chunk``; torchtitan passes the same ``kwarg_mbs`` on every
# rank), targets reach the loss of the last stage. Whole-batch keyword inputs
# mean the same once split.
#
# Every check here runs inside ``step``'s pre-step ``try``, so a bad call makes
# every rank raise the same :class:`~hp_pipeline.PipelineStepError` before any
# rank computes ([Note: failures] in :mod:`hp_pipeline.executor`), where torch
# raises on the offending rank only and leaves its peers waiting.


def check_pre_split(
    m: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    target: Any,
    arg_mbs: object,
    kwarg_mbs: object,
    target_mbs: object,
) -> bool:
    """Whether the inputs are pre-split; checks them if so ([Note: pre-split micro-batches])."""
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        return False
    if args:
        raise ValueError(
            f"step() got {len(args)} positional input(s) and pre-split inputs; the two forms cannot be "
            "mixed: pass micro-batch k's positional inputs as arg_mbs[k] (a tuple), e.g. "
            "step(arg_mbs=[(x0,), (x1,)]), or pass the whole batch without arg_mbs/kwarg_mbs/target_mbs"
        )
    if kwargs:
        raise ValueError(
            f"step() got the model keyword(s) {sorted(kwargs)} and pre-split inputs; the two forms cannot "
            "be mixed: pass micro-batch k's keyword inputs as kwarg_mbs[k] (a dict), e.g. "
            f"kwarg_mbs=[{{{next(iter(sorted(kwargs)))!r}: value_k}} for each micro-batch]"
        )
    if target is not None:
        raise ValueError(
            "step() got target= and pre-split inputs; the two forms cannot be mixed: pass micro-batch "
            "k's target as target_mbs[k], e.g. step(..., target_mbs=list(y.tensor_split(n_microbatches)))"
        )
    if arg_mbs is not None:
        _check_list("arg_mbs", arg_mbs, m, tuple, "[(x0,), (x1,)]")
    if kwarg_mbs is not None:
        _check_list("kwarg_mbs", kwarg_mbs, m, dict, "[{'mask': m0}, {'mask': m1}]")
    if target_mbs is not None:
        _check_list("target_mbs", target_mbs, m, None, "[y0, y1]")
    return True


def microbatch_inputs(
    *,
    m: int,
    holds_first: bool,
    last_stage: int | None,
    needs_target: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    arg_mbs: list[tuple[Any, ...]] | None,
    kwarg_mbs: list[dict[str, Any]] | None,
    target_mbs: list[Any] | None,
    args_chunk_spec: Sequence[Any] | None,
    kwargs_chunk_spec: Mapping[str, Any] | None,
    example: str,
) -> tuple[list[tuple[Any, ...]] | None, list[dict[str, Any]] | None, list[Any] | None]:
    """This rank's per-micro-batch ``(args, kwargs, targets)``, from either form, checked.

    ``last_stage`` is the last stage's index where this rank holds it, else
    ``None``. ``args`` are ``None`` where the rank holds no stage 0, ``kwargs`` ``None``
    where none were given to a rank without stage 0, ``targets`` ``None``
    where the rank holds no last stage or none were given
    ([Note: pre-split micro-batches]).
    """
    pre_split = check_pre_split(m, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
    holds_last = last_stage is not None
    given_target = target_mbs is not None if pre_split else target is not None
    if holds_last and needs_target and not given_target:
        keyword = "target_mbs" if pre_split else "target"
        value = "[y0, y1, ...]" if pre_split else "y"
        raise ValueError(
            f"{_rank()} hosts the last stage ({last_stage}) and the schedule has a loss_fn, but step() got "
            f"{keyword}=None; pass the batch's targets there, e.g. schedule.step({keyword}={value}, "
            "losses=losses)"
        )
    if pre_split:
        if holds_first and arg_mbs is None and kwarg_mbs is None:
            raise ValueError(
                f"{_rank()} hosts stage 0 but step() got kwarg_mbs/target_mbs and no arg_mbs; pass stage "
                "0's inputs per micro-batch, e.g. step(arg_mbs=[(x0,), (x1,)])"
            )
        args_out = (arg_mbs if arg_mbs is not None else [()] * m) if holds_first else None
        kwargs_out = kwarg_mbs if kwarg_mbs is not None else ([{}] * m if holds_first else None)
        return args_out, kwargs_out, target_mbs if holds_last else None
    args_out = kwargs_out = None
    if holds_first:
        if not args and not kwargs:
            raise ValueError(
                f"{_rank()} hosts stage 0 but step() got no inputs; pass the batch here, e.g. {example}"
            )
        args_out, kwargs_out = split_args_kwargs(args, kwargs, m, args_chunk_spec, kwargs_chunk_spec)
    elif kwargs:
        # Keyword inputs reach every stage of the rank they are given on, as in torch.
        kwargs_out = split_args_kwargs((), kwargs, m, None, kwargs_chunk_spec)[1]
    targets = split_target(target, m) if holds_last and target is not None else None
    return args_out, kwargs_out, targets


# [Note: meshes as groups]
# torch's code passes ``group=pp_mesh.get_group()`` and, more and more, the mesh
# itself. Where hp-pipeline takes a process group it therefore also takes a
# one-dimensional mesh, ours (``hp_core.DeviceMesh``) or torch's
# (``torch.distributed.device_mesh.DeviceMesh``), and uses the group the mesh
# already holds (``mesh.get_group()``): no conversion and no new process group,
# so the stage communicates on exactly the communicator the rest of the program
# uses for that dimension. A mesh of more dims is refused with the slice to pass.


def as_process_group(where: str, group: object, name: str = "group") -> dist.ProcessGroup | None:
    """``group`` as a process group: a group, ``None``, or a 1-D mesh's own group.

    See [Note: meshes as groups]. ``name`` is the argument's name in ``where``
    (``group``, or MPipe's ``dp_group``), for the error.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    dim = "pp" if name == "group" else "dp"
    what = "the pipeline's group" if name == "group" else "the data-parallel group"
    if _is_mesh(group):
        ndim = group.ndim  # type: ignore[attr-defined]
        if ndim != 1:
            names = getattr(group, "mesh_dim_names", None)
            pick = f"mesh[{dim!r}]" if names and dim in names else "a 1-D slice of the mesh"
            raise ValueError(
                f"{where}: {name} is a {ndim}-D {_mesh_kind(group)} (shape {tuple(group.shape)}, dims "  # type: ignore[attr-defined]
                f"{names}); pass the one dimension it runs over, e.g. {pick} or {pick}.get_group()"
            )
        return group.get_group()  # type: ignore[attr-defined]
    raise TypeError(
        f"{where}: {name}={group!r} is a {type(group).__name__}, not a ProcessGroup or a DeviceMesh; pass "
        f"{what} (e.g. mesh[{dim!r}].get_group()), its 1-D mesh (mesh[{dim!r}]), or None"
    )


def _is_mesh(value: object) -> bool:
    from hp_core import DeviceMesh

    if isinstance(value, DeviceMesh):
        return True
    try:
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    except ImportError:  # a torch built without distributed meshes
        return False
    return isinstance(value, TorchDeviceMesh)


def _mesh_kind(mesh: object) -> str:
    return f"{type(mesh).__module__.split('.')[0]} DeviceMesh"


def tower_chunks(owned: Sequence[int], preprocess_inputs: Any, m: int, pre_split: bool) -> list[Any]:
    """MPipe's per-micro-batch tower inputs (a tuple each) for a rank that owns ``owned``.

    The whole batch (a tensor or a tuple of tensors) is cut like the other
    inputs; with pre-split inputs it must be pre-split too, as a list of ``m``
    entries of which the owned ones are given ([Note: pre-split micro-batches]).
    """
    if preprocess_inputs is None:
        raise ValueError(
            f"{_rank()} owns micro-batches {list(owned)} but step() got no preprocess_inputs=; pass the "
            + (
                "tower inputs of every micro-batch as a list on every owner"
                if pre_split
                else "whole batch's tower inputs on every owner"
            )
        )
    if not pre_split:
        whole = preprocess_inputs if isinstance(preprocess_inputs, tuple) else (preprocess_inputs,)
        return split_args_kwargs(whole, {}, m)[0]
    _check_list("preprocess_inputs", preprocess_inputs, m, None, "[pixels0, pixels1, ...]")
    missing = [k for k in owned if preprocess_inputs[k] is None]
    if missing:
        raise ValueError(
            f"{_rank()} owns micro-batches {list(owned)} but preprocess_inputs[k] is None for k in "
            f"{missing}; pass micro-batch k's tower inputs there (None only where this rank owns none)"
        )
    return [item if isinstance(item, tuple) else (item,) for item in preprocess_inputs]

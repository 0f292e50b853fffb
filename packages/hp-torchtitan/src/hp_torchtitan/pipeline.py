"""torchtitan's pipelining function for its decoders, with hp_pipeline's stages and schedules.

Same signature and the same result as torchtitan 0.3.0's
``torchtitan.distributed.pipeline_parallel.pipeline_llm``, so a ``ModelSpec``
names it as its ``pipelining_fn`` and torchtitan's trainer (or our CPU driver)
calls it unchanged: ``(schedule, model_parts, has_first_stage, has_last_stage)``.

How the model is split: [Note: the same split as torchtitan] (above
:func:`decoder_stage_fqns`); how the parts run:
[Note: stages and schedule as torchtitan builds them] (above :func:`pipeline_decoder`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, Literal

import hp_pipeline
import torch
import torch.nn as nn

from hp_torchtitan.meshes import hp_dense_root

_V_SCHEDULES = (hp_pipeline.ScheduleZBVZeroBubble, hp_pipeline.ScheduleDualPipeV)


def _fail(message: str) -> None:
    raise ValueError(f"hp_torchtitan.pipeline_decoder: {message}.")


# [Note: the same split as torchtitan]
# Parity with torchtitan's own PP run needs the same weights on the same stages,
# so the split follows torchtitan's rules exactly:
#
# * the number of stages: ``pipeline_parallel_layers_per_stage`` when set
#   (``ceil((layers + first_less + last_less) / per_stage)`` stages), else one
#   stage per pipeline rank for single-stage schedules and two for looped ones;
# * which modules: ``parallelism.module_fqns_per_model_part`` when given, else
#   :func:`decoder_stage_fqns`: ``tok_embeddings`` counts as
#   ``pipeline_parallel_first_stage_less_layers`` layers, ``norm`` + ``lm_head``
#   as ``pipeline_parallel_last_stage_less_layers``, and the layers are dealt
#   out evenly, the first stages taking one more when they do not divide;
# * which stages a rank holds: ``r, r + pp, ...`` ("loop"), or ``r, 2pp-1-r``
#   for the V schedules (``hp_pipeline.stages_on_rank``);
# * a model part is a deep copy of the whole (meta) model with the modules of
#   other stages set to ``None`` and the other blocks deleted from ``layers``,
#   so parameter names are the whole model's.
def decoder_stage_fqns(
    num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1
) -> list[list[str]]:
    """The module names of each of ``num_stages`` stages of a decoder, as torchtitan deals them out.

    ``input_weight`` / ``output_weight`` are how many layers ``tok_embeddings``
    and ``norm`` + ``lm_head`` count for ([Note: the same split as torchtitan]).
    """
    everything = ["tok_embeddings", *(f"layers.{i}" for i in range(num_layers)), "norm", "lm_head"]
    if num_stages < 1:
        _fail(f"num_stages={num_stages}; use 1 or more")
    if num_stages == 1:
        return [everything]
    effective = num_layers + input_weight + output_weight
    base, extra = divmod(effective, num_stages)
    if base == 0:
        _fail(
            f"{num_stages} stages for {effective} effective layers ({num_layers} layers + first-stage weight "
            f"{input_weight} + last-stage weight {output_weight}) leaves stages empty; use fewer stages"
        )
    if max(input_weight, output_weight) > base:
        _fail(
            f"a first/last-stage weight of {max(input_weight, output_weight)} exceeds the {base} layers a "
            "stage gets; lower pipeline_parallel_first_stage_less_layers / "
            "pipeline_parallel_last_stage_less_layers"
        )
    stages: list[list[str]] = []
    next_layer = 0
    for index in range(num_stages):
        budget = base + (1 if index < extra else 0)
        names = []
        if index == 0:
            names.append("tok_embeddings")
            budget -= input_weight
        elif index == num_stages - 1:
            budget -= output_weight
        take = min(budget, num_layers - next_layer)
        names += [f"layers.{i}" for i in range(next_layer, next_layer + take)]
        next_layer += take
        if index == num_stages - 1:
            names += ["norm", "lm_head"]
        stages.append(names)
    return stages


def split_decoder(model: nn.Module, module_names: list[str]) -> nn.Module:
    """A copy of ``model`` holding only ``module_names`` (top-level modules or ``layers.<i>``).

    Other top-level modules become ``None``, other blocks leave ``layers``;
    torchtitan's decoder forward and ``init_weights`` skip what is missing.
    """
    part = copy.deepcopy(model)
    keep = set(module_names)
    for name, child in list(part.named_children()):
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            wanted = {fqn.split(".", 1)[1] for fqn in keep if fqn.startswith(f"{name}.")}
            if isinstance(child, nn.ModuleDict):
                for key in list(child.keys()):
                    if key not in wanted:
                        del child[key]
            else:
                setattr(part, name, type(child)([m for i, m in enumerate(child) if str(i) in wanted]))
        elif name not in keep:
            setattr(part, name, None)
    return part


def _stage_count(parallel_dims: Any, parallelism: Any, num_layers: int, single: bool) -> int:
    """How many stages the model is cut into ([Note: the same split as torchtitan])."""
    pp = parallel_dims.pp
    per_stage = parallelism.pipeline_parallel_layers_per_stage
    if per_stage is None:
        return pp * (1 if single else 2)
    weights = (
        parallelism.pipeline_parallel_first_stage_less_layers
        + parallelism.pipeline_parallel_last_stage_less_layers
    )
    count = math.ceil((num_layers + weights) / per_stage)
    per_rank, rest = divmod(count, pp)
    if rest:
        _fail(
            f"pipeline_parallel_layers_per_stage={per_stage} cuts {num_layers} layers into {count} stages, "
            f"which pp={pp} does not divide; pick a layers-per-stage value giving a multiple of {pp} stages"
        )
    if single and per_rank != 1:
        _fail(
            f"schedule {parallelism.pipeline_parallel_schedule!r} runs one stage per rank but "
            f"pipeline_parallel_layers_per_stage={per_stage} gives {per_rank}; raise it to "
            f"{num_layers // pp} or more"
        )
    if not single and per_rank < 2:
        _fail(
            f"schedule {parallelism.pipeline_parallel_schedule!r} runs 2 or more stages per rank but "
            f"pipeline_parallel_layers_per_stage={per_stage} gives {per_rank}; lower it"
        )
    return count


def _scalar_loss(loss_fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """torchtitan's loss returns ``(loss, metrics)``; a schedule wants the scalar loss."""

    def scalar_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss, _ = loss_fn(*args, **kwargs)
        return loss

    return scalar_loss


# [Note: stages and schedule as torchtitan builds them]
# Then each part goes through the spec's ``parallelize_fn`` (hp's TP and
# ``fully_shard``), becomes an ``hp_pipeline.PipelineStage`` on torchtitan's
# ``pp`` process group, and the schedule is built as torchtitan builds it:
# ``local_batch_size // pipeline_parallel_microbatch_size`` micro-batches,
# ``scale_grads=False`` (torchtitan's loss is already divided by the global
# count of valid tokens) and a loss function that returns the scalar loss only.
# hp_pipeline's schedules take torchtitan's ``step(arg_mbs=, kwarg_mbs=,
# target_mbs=, losses=, loss_kwargs=, return_outputs=)`` call as it is.
def pipeline_decoder(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
    device: torch.device,
    model_config: Any,
    parallelize_fn: Callable[..., nn.Module],
    loss_fn: Callable[..., Any],
) -> tuple[Any, list[nn.Module], bool, bool]:
    """Cut a torchtitan decoder into hp_pipeline stages (a ``ModelSpec.pipelining_fn``).

    Returns torchtitan's tuple: the schedule, this rank's model parts (one per
    local stage, each parallelized by ``parallelize_fn``), and whether this rank
    holds the first and the last stage.
    """
    if parallelism.pipeline_parallel_schedule_csv:
        _fail(
            f"pipeline_parallel_schedule_csv={parallelism.pipeline_parallel_schedule_csv!r} is not supported "
            "yet; pick a schedule by name in pipeline_parallel_schedule"
        )
    schedule_class = hp_pipeline.get_schedule_class(parallelism.pipeline_parallel_schedule)
    single = issubclass(schedule_class, hp_pipeline.PipelineScheduleSingle)
    microbatch = parallelism.pipeline_parallel_microbatch_size
    if training.local_batch_size % microbatch != 0:
        _fail(
            f"local_batch_size={training.local_batch_size} is not a multiple of "
            f"pipeline_parallel_microbatch_size={microbatch}; make it one"
        )
    fqns = parallelism.module_fqns_per_model_part
    if fqns is None:
        num_layers = len(model_config.layers)
        count = _stage_count(parallel_dims, parallelism, num_layers, single)
        fqns = decoder_stage_fqns(
            count,
            num_layers,
            parallelism.pipeline_parallel_first_stage_less_layers,
            parallelism.pipeline_parallel_last_stage_less_layers,
        )
    num_stages = len(fqns)
    per_rank, rest = divmod(num_stages, parallel_dims.pp)
    if rest:
        _fail(f"{num_stages} model parts for pp={parallel_dims.pp}; give a multiple of {parallel_dims.pp}")
    pp_mesh = parallel_dims.get_mesh("pp")
    style: Literal["loop", "v"] = "v" if schedule_class in _V_SCHEDULES else "loop"
    indices = hp_pipeline.stages_on_rank(pp_mesh.get_local_rank(), pp_mesh.size(), per_rank, style=style)

    root = hp_dense_root(parallel_dims)
    stages, parts = [], []
    for index in indices:
        part = parallelize_fn(
            split_decoder(model, fqns[index]),
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder=dump_folder,
        )
        stage = hp_pipeline.PipelineStage(
            part,
            index,
            num_stages,
            device,
            group=pp_mesh.get_group(),
            get_mesh=lambda names, layout: root[tuple(names)],
        )
        stages.append(stage)
        parts.append(part)

    options: dict[str, Any] = {
        "n_microbatches": training.local_batch_size // microbatch,
        "loss_fn": _scalar_loss(loss_fn),
        "scale_grads": False,
    }
    schedule = schedule_class(stages[0] if single else stages, **options)
    return (
        schedule,
        parts,
        any(stage.is_first for stage in stages),
        any(stage.is_last for stage in stages),
    )

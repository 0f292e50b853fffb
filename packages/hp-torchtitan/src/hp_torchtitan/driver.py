"""The smallest training loop that runs torchtitan's pieces on CPU/gloo: model, spec, optimizer, loss.

It does, step for step, what torchtitan's ``Trainer.train_step`` does; why the
Trainer itself cannot run here and what the loop reproduces:
[Note: why not torchtitan's Trainer] (above :func:`train_losses`). A step with
pipeline parallelism: [Note: pipeline steps] (above :func:`_pp_forward_backward`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from hp_torchtitan.compat import install_triton_stand_in, use_cpu_device
from hp_torchtitan.data import Batch


@dataclass(frozen=True)
class RunConfig:
    """What a parity run varies; the defaults are torchtitan's debugmodel config, scaled to CPU."""

    steps: int = 5
    lr: float = 8e-4
    max_norm: float = 1.0
    warmup_steps: int = 2
    optimizer_implementation: str = "fused"
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "Interleaved1F1B"
    pp_microbatch_size: int = 1


def full_initial_weights(spec: Any, seed: int) -> dict[str, torch.Tensor]:
    """Build ``spec``'s model unsharded on CPU, initialised by torchtitan with ``seed``; its parameters.

    Both runs of a parity check load these, so they start from the same
    weights whatever each DTensor implementation's random-number handling.
    """
    install_triton_stand_in()
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _distribute_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``param`` (a torch DTensor, an hp_dtensor DTensor or a plain tensor)."""
    import hp_dtensor
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import distribute_tensor

    if isinstance(param, TorchDTensor):
        return distribute_tensor(full, param.device_mesh, param.placements)
    if isinstance(param, hp_dtensor.DTensor):
        return hp_dtensor.distribute_tensor(full, param.device_mesh, list(param.placements))
    return full


def load_full_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], *, part: bool = False) -> None:
    """Copy unsharded ``weights`` into ``model``'s (possibly sharded) parameters, by name.

    ``part=True`` for a pipeline stage's model part: it holds some of the names only.
    """
    params = dict(model.named_parameters())
    if (not set(params) <= set(weights)) if part else set(params) != set(weights):
        raise ValueError(
            "load_full_weights: parameter names differ; "
            f"only in model: {sorted(set(params) - set(weights))}, "
            f"only in weights: {sorted(set(weights) - set(params))}."
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(_distribute_like(param, weights[name]))


def _sum_only_reductions_on_gloo(model: nn.Module) -> None:
    """Make torch's FSDP2 reduce with SUM on gloo, where it would ask for PREMUL_SUM.

    torchtitan turns FSDP's gradient division off (divide factor 1.0); torch
    2.13's FSDP2 then reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which
    gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Forcing SUM
    reductions (then a post-division by 1.0) is the same arithmetic. hp_fsdp's
    modules need nothing: they are not torch's FSDPModule.
    """
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, TorchFSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _with_sharding_configs(model_config: Any, parallelism: Any) -> Any:
    """A copy of a Llama 3 model config with torchtitan's TP ``sharding_config``s filled in.

    The Trainer does this in ``model_config.update_from_config`` (which imports
    the Trainer, see the note above); torchtitan's own TP (``model.parallelize``)
    reads them, hp's parallelize function ignores them. Filled in whatever the
    TP degree, as the Trainer does.
    """
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    if not isinstance(model_config, Llama3Model.Config):
        raise TypeError(
            "train_losses: the CPU driver runs Llama 3 model configs only, got "
            f"{type(model_config).__name__}; "
            "use hp_llama3_spec(...) or torchtitan.models.llama3.model_registry(...)."
        )
    model_config = copy.deepcopy(model_config)
    set_llama3_sharding_config(model_config, enable_sp=parallelism.enable_sequence_parallel)
    return model_config


def build_parallel_dims(dp_replicate: int = 1, tp: int = 1, pp: int = 1) -> Any:
    """torchtitan's ``ParallelDims``: ``pp`` x ``tp`` model parallelism, data parallelism over the rest."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    use_cpu_device()
    dist_utils.set_spmd_backend("partial_dtensor")
    world = dist.get_world_size()
    dims = ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=-1,
        cp=1,
        tp=tp,
        pp=pp,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


# [Note: why not torchtitan's Trainer]
# torchtitan 0.3.0's ``Trainer`` cannot run on a CPU-only torch 2.13 without
# changes to torchtitan itself:
#
# * it imports ``torch.utils.tensorboard`` (``components/metrics.py``) and so the
#   ``tensorboard`` package, and its data loader imports HuggingFace ``datasets``;
# * it selects ``torch.cuda`` as its device module when torch sees no
#   accelerator and calls ``set_device`` on it;
# * ``model_config.update_from_config`` imports the Trainer (above);
# * its pipeline path calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=)``,
#   which torch 2.13's schedules do not have (newer torch; hp_pipeline has it).
#
# So this loop does, step for step, what ``Trainer.train_step`` does without
# gradient accumulation: the global count of
# valid tokens summed over the batch mesh, forward with torchtitan's
# document-causal flex-attention masks, torchtitan's cross-entropy divided by
# that count, backward, ``torchtitan.distributed.utils.clip_grad_norm_``, the
# optimizer and LR schedulers built from torchtitan's configs (default AdamW:
# fused, betas (0.9, 0.95), weight decay 0.1; linear warmup then decay), and the
# logged loss summed over the loss mesh. Everything that decides numerics is
# torchtitan's; only the plumbing around it is ours.
def train_losses(
    spec: Any,
    batches: Sequence[Batch],
    weights: Mapping[str, torch.Tensor],
    config: RunConfig | None = None,
) -> tuple[list[float], nn.Module]:
    """Train ``spec``'s model (its own ``parallelize_fn``) for ``config.steps`` steps; return the losses.

    The losses are torchtitan's logged global average loss of each step; the
    model is returned for checks of its parameters. Without PP only: with PP a
    rank holds several model parts (:func:`train_model_parts`).
    """
    config = config or RunConfig()
    if config.pp != 1:
        raise ValueError(
            f"train_losses: config.pp={config.pp} gives each rank its stages' model parts, not one model; "
            "call train_model_parts(...), which returns them as a list."
        )
    losses, parts = train_model_parts(spec, batches, weights, config)
    return losses, parts[0]


@dataclass(frozen=True)
class _Pipeline:
    """What a ``pipelining_fn`` returns besides the model parts, and the micro-batch count."""

    schedule: Any
    has_first: bool
    has_last: bool
    n_microbatches: int


def _build_model_parts(
    spec: Any, parallel_dims: Any, training: Any, parallelism: Any, compile_config: Any, loss_fn: Any
) -> tuple[list[nn.Module], _Pipeline | None]:
    """The spec's model on meta, through its ``pipelining_fn`` (PP) or ``parallelize_fn``."""
    model_config = _with_sharding_configs(spec.model, parallelism)
    with torch.device("meta"):
        model = model_config.build()
    common = {
        "parallel_dims": parallel_dims,
        "training": training,
        "parallelism": parallelism,
        "compile_config": compile_config,
        "ac_config": None,
    }
    with tempfile.TemporaryDirectory() as dump_folder:
        if not parallel_dims.pp_enabled:
            return [spec.parallelize_fn(model, dump_folder=dump_folder, **common)], None
        if spec.pipelining_fn is None:
            raise ValueError(f"train_model_parts: spec {spec.name!r} has no pipelining_fn; run it with pp=1.")
        schedule, parts, has_first, has_last = spec.pipelining_fn(
            model,
            dump_folder=dump_folder,
            device=torch.device("cpu"),
            model_config=model_config,
            parallelize_fn=spec.parallelize_fn,
            loss_fn=loss_fn,
            **common,
        )
    m = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    return parts, _Pipeline(schedule, has_first, has_last, m)


# [Note: pipeline steps]
# With PP the model is cut by the spec's own ``pipelining_fn`` (torchtitan's
# ``pipeline_llm`` for its spec, :func:`hp_torchtitan.pipeline.pipeline_decoder`
# for hp's), and a step is ``Trainer.pp_forward_backward_step``: the batch cut
# into ``local_batch_size // pipeline_parallel_microbatch_size`` micro-batches
# (torchtitan's loader yields them one by one; here they are consecutive rows),
# the model's keyword inputs (``positions``) given to every stage,
# ``loss_kwargs={"global_valid_tokens": ...}`` so each micro-batch's loss is its
# token sum over the step's global count (the schedule does not rescale:
# ``scale_grads=False``), and the step's loss on the last stage's rank the sum of
# the micro-batch losses; a rank without the last stage reports ``-1`` as
# torchtitan does, so after the sum over the loss mesh the logged value there is
# ``-dp`` (torchtitan prints the real loss from a last-stage rank). The gradient
# norm is reduced over ``pp`` too (``clip_grad_norm_(..., pp_mesh=...)``).
# hp_pipeline's schedules get torchtitan's call exactly (pre-split ``arg_mbs`` /
# ``kwarg_mbs`` / ``target_mbs``); torch 2.13's get the whole batch,
# ``step(inputs, target=labels, losses=, loss_kwargs=, positions=...)``, which it
# cuts into the same consecutive micro-batches.
def _pp_forward_backward(
    pipeline: _Pipeline,
    parts: Sequence[nn.Module],
    batch: Batch,
    global_tokens: torch.Tensor,
    needs_masks: bool,
) -> torch.Tensor:
    """``Trainer.pp_forward_backward_step`` on one batch; the step's loss ([Note: pipeline steps])."""
    schedule, has_first, has_last, m = (
        pipeline.schedule,
        pipeline.has_first,
        pipeline.has_last,
        pipeline.n_microbatches,
    )
    loss_kwargs = {"global_valid_tokens": global_tokens}
    losses: list[torch.Tensor] | None = [] if has_last else None
    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        inputs, labels, positions = (t.tensor_split(m) for t in (batch.inputs, batch.labels, batch.positions))
        kwarg_mbs: list[dict[str, Any]] = [{"positions": p} for p in positions]
        if needs_masks:
            for kwargs in kwarg_mbs:
                first: Any = parts[0]  # torchtitan's decoder
                kwargs["attention_masks"] = first.get_attention_masks(positions=kwargs["positions"])
        schedule.step(
            arg_mbs=[(x,) for x in inputs] if has_first else None,
            kwarg_mbs=kwarg_mbs,
            target_mbs=list(labels) if has_last else None,
            losses=losses,
            loss_kwargs=loss_kwargs,
            return_outputs=False,
        )
    else:  # torch 2.13: the whole batch, cut by the schedule into the same micro-batches
        if needs_masks:
            raise NotImplementedError(
                "train_model_parts: torch 2.13's schedules cannot cut attention masks into micro-batches; "
                "use with_sdpa_attention(spec)."
            )
        schedule.step(
            *((batch.inputs,) if has_first else ()),
            target=batch.labels if has_last else None,
            losses=losses,
            return_outputs=False,
            loss_kwargs=loss_kwargs,
            positions=batch.positions,
        )
    if losses is not None:
        return torch.sum(torch.stack(losses))
    return torch.tensor([-1.0])


def _clip_grad_norm_(params: list[torch.Tensor], max_norm: float, pp_mesh: Any) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` (2-norm, foreach), with the PP reduction also for hp parameters.

    [Note: clipping hp parameters under PP]
    torchtitan's function turns the total norm into a plain tensor only when it
    is *torch's* DTensor (``.full_tensor()``), then all-reduces it over ``pp``
    with ``dist.all_reduce``. On hp parameters the total norm is an hp DTensor
    (partial norms over the data-parallel and TP dims); without PP torchtitan's
    function still works (the clip coefficient's arithmetic reduces it), but
    ``dist.all_reduce`` refuses an hp DTensor (hp_dtensor turns torch's
    collectives on a DTensor into a TypeError naming ``full_tensor()``). So with
    PP and hp parameters the same steps run here, with the hp DTensor made whole
    by ``.full_tensor()`` first; everything else calls torchtitan's function.
    """
    import hp_dtensor
    from torchtitan.distributed import utils as dist_utils

    grads = [p.grad for p in params if p.grad is not None]
    if pp_mesh is None or not any(isinstance(g, hp_dtensor.DTensor) for g in grads):
        return dist_utils.clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=pp_mesh)
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    if isinstance(total, hp_dtensor.DTensor):
        total = total.full_tensor()
    total = total**2.0
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    total = total ** (1.0 / 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, True)
    return total


def train_model_parts(
    spec: Any,
    batches: Sequence[Batch],
    weights: Mapping[str, torch.Tensor],
    config: RunConfig | None = None,
) -> tuple[list[float], list[nn.Module]]:
    """Train ``spec``'s model for ``config.steps`` steps; return the logged losses and this rank's parts.

    One part without PP; with PP the parts of this rank's stages, cut and
    scheduled by the spec's own ``pipelining_fn`` ([Note: pipeline steps]).
    """
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    config = config or RunConfig()
    if len(batches) < config.steps:
        raise ValueError(
            f"train_model_parts: {len(batches)} batches for steps={config.steps}; pass one per step."
        )
    parallel_dims = build_parallel_dims(config.dp_replicate, config.tp, config.pp)
    training = TrainingConfig(
        local_batch_size=batches[0].inputs.shape[0],
        seq_len=batches[0].inputs.shape[1],
        steps=config.steps,
        max_norm=config.max_norm,
        mixed_precision_param="float32",
        mixed_precision_reduce="float32",
    )
    compile_config = CompileConfig()
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor",
        pipeline_parallel_degree=config.pp,
        pipeline_parallel_schedule=config.pp_schedule,
        pipeline_parallel_microbatch_size=config.pp_microbatch_size,
    )
    loss_fn = CrossEntropyLoss.Config().build(compile_config=compile_config)
    parts, pipeline = _build_model_parts(spec, parallel_dims, training, parallelism, compile_config, loss_fn)
    for part in parts:
        _sum_only_reductions_on_gloo(part)
        part.to_empty(device="cpu")
        with torch.no_grad():
            # buffers (RoPE); parameters are overwritten next
            cast(Any, part).init_weights(buffer_device=None)
        load_full_weights(part, weights, part=pipeline is not None)
        part.train()

    optimizer_config = dataclasses.replace(
        default_adamw(lr=config.lr), implementation=config.optimizer_implementation
    )
    optimizers = optimizer_config.build(model_parts=parts)
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=config.warmup_steps, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=config.steps)
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    pp_mesh = parallel_dims.get_optional_mesh("pp")

    # As Trainer.post_dataloading_process: masks only for the masked backends (flex, varlen).
    needs_masks = isinstance(
        spec.model.first_attention.inner_attention, (FlexAttention.Config, VarlenAttention.Config)
    )
    losses = []
    for batch in batches[: config.steps]:
        optimizers.zero_grad()
        local_tokens = (batch.labels != IGNORE_INDEX).sum()
        global_tokens = (
            local_tokens if batch_mesh is None else dist_utils.dist_sum_tensor(local_tokens, batch_mesh)
        )
        if pipeline is not None:
            loss = _pp_forward_backward(pipeline, parts, batch, global_tokens, needs_masks)
        else:
            model = parts[0]
            masks = cast(Any, model).get_attention_masks(positions=batch.positions) if needs_masks else None
            pred = model(batch.inputs, positions=batch.positions, attention_masks=masks)
            loss, _ = loss_fn(pred, batch.labels, global_tokens)
            loss.backward()
        _clip_grad_norm_([p for part in parts for p in part.parameters()], config.max_norm, pp_mesh)
        optimizers.step()
        schedulers.step()
        loss = loss.detach()
        if parallel_dims.dp_cp_enabled:
            losses.append(dist_utils.dist_sum(loss, parallel_dims.get_optional_mesh("loss")))
        else:
            losses.append(float(loss.item()))
    return losses, parts

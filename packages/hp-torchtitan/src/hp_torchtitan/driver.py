"""The smallest training loop that runs torchtitan's pieces on CPU/gloo: model, spec, optimizer, loss.

[Note: why not torchtitan's Trainer]
torchtitan 0.3.0's ``Trainer`` cannot run on a CPU-only torch 2.13 without
changes to torchtitan itself:

* it imports ``torch.utils.tensorboard`` (``components/metrics.py``) and so the
  ``tensorboard`` package, and its data loader imports HuggingFace ``datasets``;
* it selects ``torch.cuda`` as its device module when torch sees no
  accelerator and calls ``set_device`` on it;
* ``model_config.update_from_config`` imports the Trainer (above);
* its pipeline path calls ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=)``,
  which torch 2.13's schedules do not have (newer torch; hp_pipeline has it).

So this loop does, step for step, what ``Trainer.train_step`` does for one
data-parallel model part without gradient accumulation: the global count of
valid tokens summed over the batch mesh, forward with torchtitan's
document-causal flex-attention masks, torchtitan's cross-entropy divided by
that count, backward, ``torchtitan.distributed.utils.clip_grad_norm_``, the
optimizer and LR schedulers built from torchtitan's configs (default AdamW:
fused, betas (0.9, 0.95), weight decay 0.1; linear warmup then decay), and the
logged loss summed over the loss mesh. Everything that decides numerics is
torchtitan's; only the plumbing around it is ours.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


def load_full_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy unsharded ``weights`` into ``model``'s (possibly sharded) parameters, by name."""
    params = dict(model.named_parameters())
    if set(params) != set(weights):
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


def build_parallel_dims(dp_replicate: int = 1, tp: int = 1) -> Any:
    """torchtitan's ``ParallelDims``: ``tp`` ranks of TP, data parallelism over the rest, meshes built."""
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
        pp=1,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def train_losses(
    spec: Any,
    batches: Sequence[Batch],
    weights: Mapping[str, torch.Tensor],
    config: RunConfig | None = None,
) -> tuple[list[float], nn.Module]:
    """Train ``spec``'s model (its own ``parallelize_fn``) for ``config.steps`` steps; return the losses.

    The losses are torchtitan's logged global average loss of each step; the
    model is returned for checks of its parameters.
    """
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    config = config or RunConfig()
    if len(batches) < config.steps:
        raise ValueError(f"train_losses: {len(batches)} batches for steps={config.steps}; pass one per step.")
    parallel_dims = build_parallel_dims(config.dp_replicate, config.tp)
    training = TrainingConfig(
        local_batch_size=batches[0].inputs.shape[0],
        seq_len=batches[0].inputs.shape[1],
        steps=config.steps,
        max_norm=config.max_norm,
        mixed_precision_param="float32",
        mixed_precision_reduce="float32",
    )
    compile_config = CompileConfig()
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    with torch.device("meta"):
        model = _with_sharding_configs(spec.model, parallelism).build()
    with tempfile.TemporaryDirectory() as dump_folder:
        model = spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=None,
            dump_folder=dump_folder,
        )
    _sum_only_reductions_on_gloo(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (RoPE); parameters are overwritten next
    load_full_weights(model, weights)
    model.train()

    loss_fn = CrossEntropyLoss.Config().build(compile_config=compile_config)
    optimizer_config = dataclasses.replace(
        default_adamw(lr=config.lr), implementation=config.optimizer_implementation
    )
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=config.warmup_steps, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=config.steps)
    batch_mesh = parallel_dims.get_mesh("batch")
    loss_mesh = parallel_dims.get_mesh("loss")

    # As Trainer.post_dataloading_process: masks only for the masked backends (flex, varlen).
    needs_masks = isinstance(
        spec.model.first_attention.inner_attention, (FlexAttention.Config, VarlenAttention.Config)
    )
    losses = []
    for batch in batches[: config.steps]:
        optimizers.zero_grad()
        local_tokens = (batch.labels != IGNORE_INDEX).sum()
        global_tokens = dist_utils.dist_sum_tensor(local_tokens, batch_mesh)
        masks = model.get_attention_masks(positions=batch.positions) if needs_masks else None
        pred = model(batch.inputs, positions=batch.positions, attention_masks=masks)
        loss, _ = loss_fn(pred, batch.labels, global_tokens)
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), config.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        losses.append(dist_utils.dist_sum(loss.detach(), loss_mesh))
    return losses, model

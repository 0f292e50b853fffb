"""Checkpoints of a run written and read by torchtitan's own ``CheckpointManager`` (DCP), hp or torch.

torchtitan's ``CheckpointManager`` (``components/checkpointer/dcp.py``) runs
on CPU unchanged: it flattens its ``ModelWrapper`` (the model's
``state_dict()``, sharded DTensors under FSDP) beside the
``OptimizersContainer`` (a flat, FQN-keyed state dict whose AdamW moments are
DTensors laid out like their parameters), the LR schedulers and the data
loader, and hands the lot to ``torch.distributed.checkpoint``. So a run here
builds exactly those objects and gives them to a ``CheckpointManager``.

What stands in for torchtitan's trainer and loader:
[Note: what is reproduced instead of torchtitan's] (above :class:`TrainState`);
why hp's and torch's files load across: [Note: interchangeable files].
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import ModelWrapper

from hp_torchtitan.compat import install_triton_stand_in
from hp_torchtitan.data import Batch
from hp_torchtitan.driver import (
    RunConfig,
    _sum_only_reductions_on_gloo,
    _with_sharding_configs,
    build_parallel_dims,
    load_full_weights,
)

__all__ = ["BatchCursor", "TrainState", "TrainingRun", "checkpoint_layout"]


def _storage_of(tensor: torch.Tensor) -> int:
    """The address of the storage behind ``tensor``'s values: its local piece's for either DTensor."""
    import hp_dtensor
    from torch.distributed.tensor import DTensor as TorchDTensor

    if isinstance(tensor, (TorchDTensor, hp_dtensor.DTensor)):
        tensor = tensor.to_local()
    return int(tensor.untyped_storage().data_ptr())


class StorageStableModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper``, made to work on hp's parameters; the same for torch's.

    [Note: ModelWrapper and hp DTensors]
    ``ModelWrapper.state_dict`` keeps the first state dict it made and, on
    each later call, copies a value into the kept tensor unless both share
    storage. Its check unwraps torch's DTensor only (``_local_tensor``) and
    asks any other tensor for ``untyped_storage().data_ptr()``. A DTensor of
    either library is a wrapper subclass without storage of its own, so on an
    hp DTensor that call raises "Attempted to access the data pointer on an
    invalid python storage" at the second ``state_dict()``: the first
    ``CheckpointManager.save``. This wrapper does the same caching and
    compares the local pieces of both DTensor types.
    """

    def state_dict(self) -> dict[str, Any]:
        cache = self.cached_state_dict
        for key, value in self._get_state_dict().items():
            kept = cache.get(key)
            if kept is None or kept.shape != value.shape or kept.dtype != value.dtype:
                cache[key] = value
            elif _storage_of(kept) != _storage_of(value):
                kept.copy_(value)
        return cache


# [Note: what is reproduced instead of torchtitan's]
# * The training loop: torchtitan's ``Trainer`` does not run on a CPU-only
#   torch (see [Note: why not torchtitan's Trainer] in
#   :mod:`hp_torchtitan.driver`), so :class:`TrainingRun` builds the model,
#   optimizer and LR schedulers from torchtitan's configs and takes steps as
#   :func:`hp_torchtitan.driver.train_losses` does, but one at a time, so that a
#   checkpoint can be saved or loaded between steps.
# * The data loader's state: torchtitan's ``ParallelAwareDataloader`` needs
#   HuggingFace ``datasets``. :class:`BatchCursor` stands in: the number of
#   batches a data-parallel rank has consumed, saved under the same per-rank key
#   (``dp_rank_{r}``) torchtitan's loader uses so that DCP keeps every rank's
#   value, and read back on load to pick the next batch.
# * The trainer's own state (``train_state``: the step): :class:`TrainState`.
#
# Everything DCP sees (keys, tensor types, layouts) is torchtitan's.
@dataclass
class TrainState(Stateful):
    """The trainer's own state torchtitan checkpoints as ``train_state``: the step reached."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


@dataclass
class BatchCursor(Stateful):
    """Stand-in for torchtitan's data loader state: how many batches this data-parallel rank consumed.

    Keyed by ``dp_rank_{r}`` as torchtitan's ``ParallelAwareDataloader`` keys
    its state: a key every rank wrote alike would be saved once (DCP keeps one
    writer per key), which is wrong for per-rank data-loader state.
    """

    dp_rank: int
    consumed: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"dp_rank_{self.dp_rank}"
        if key not in state_dict:
            raise KeyError(
                f"BatchCursor: the checkpoint has data-loader state for {sorted(state_dict)}, not {key!r}; "
                "load it with the data-parallel degree it was saved with."
            )
        self.consumed = int(state_dict[key])


@dataclass
class TrainingRun:
    """A model, its optimizer and LR schedulers as torchtitan's Trainer builds them, stepped batch by batch.

    Build it with :meth:`build`; :meth:`step` does one training step of
    ``Trainer.train_step`` (see :mod:`hp_torchtitan.driver`); :meth:`checkpointer`
    gives torchtitan's ``CheckpointManager`` over this run's state.
    """

    model: nn.Module
    optimizers: Any
    lr_schedulers: Any
    parallel_dims: Any
    config: RunConfig
    loss_fn: Any
    needs_masks: bool
    data: BatchCursor
    train_state: TrainState = field(default_factory=TrainState)

    @classmethod
    def build(
        cls, spec: Any, weights: Mapping[str, torch.Tensor], config: RunConfig, *, local_batch: Batch
    ) -> TrainingRun:
        """Parallelize ``spec``'s model with its own ``parallelize_fn``, load ``weights``, build AdamW and LR.

        ``local_batch`` gives the batch and sequence sizes (torchtitan's
        ``TrainingConfig``); the LR schedule runs over ``config.steps`` steps.
        """
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.models.common.attention import FlexAttention, VarlenAttention

        install_triton_stand_in()
        parallel_dims = build_parallel_dims(config.dp_replicate, config.tp)
        training = TrainingConfig(
            local_batch_size=local_batch.inputs.shape[0],
            seq_len=local_batch.inputs.shape[1],
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
            model.init_weights(buffer_device=None)
        load_full_weights(model, weights)
        model.train()
        optimizer_config = dataclasses.replace(
            default_adamw(lr=config.lr), implementation=config.optimizer_implementation
        )
        optimizers = optimizer_config.build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=config.warmup_steps, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ).build(optimizers=optimizers, training_steps=config.steps)
        inner = spec.model.first_attention.inner_attention
        batch_mesh = parallel_dims.get_mesh("batch")
        return cls(
            model=model,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            parallel_dims=parallel_dims,
            config=config,
            loss_fn=CrossEntropyLoss.Config().build(compile_config=compile_config),
            needs_masks=isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)),
            data=BatchCursor(dp_rank=batch_mesh.get_local_rank()),
        )

    def step(self, batches: Sequence[Batch]) -> float:
        """Train on the batch :class:`BatchCursor` points at in ``batches``; return the logged loss."""
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed import utils as dist_utils

        if self.data.consumed >= len(batches):
            raise IndexError(
                f"TrainingRun.step: {self.data.consumed} of {len(batches)} batches consumed already; "
                "pass one batch per step."
            )
        batch = batches[self.data.consumed]
        model = self.model
        self.optimizers.zero_grad()
        local_tokens = (batch.labels != IGNORE_INDEX).sum()
        global_tokens = dist_utils.dist_sum_tensor(local_tokens, self.parallel_dims.get_mesh("batch"))
        masks = cast(Any, model).get_attention_masks(positions=batch.positions) if self.needs_masks else None
        pred = model(batch.inputs, positions=batch.positions, attention_masks=masks)
        loss, _ = self.loss_fn(pred, batch.labels, global_tokens)
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), self.config.max_norm, foreach=True)
        self.optimizers.step()
        self.lr_schedulers.step()
        self.data.consumed += 1
        self.train_state.step += 1
        return float(dist_utils.dist_sum(loss.detach(), self.parallel_dims.get_mesh("loss")))

    def checkpointer(self, folder: str | Path) -> Any:
        """torchtitan's ``CheckpointManager`` over this run: full state, synchronous, in ``folder/step-N``."""
        from torchtitan.components.checkpoint import MODEL, CheckpointManager

        config = CheckpointManager.Config(
            enable=True,
            folder=str(folder),
            interval=1,
            keep_latest_k=0,
            last_save_model_only=False,
        )
        manager = CheckpointManager(
            config,
            dataloader=self.data,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
        )
        manager.states[MODEL] = StorageStableModelWrapper([self.model])
        return manager


# [Note: interchangeable files]
# DCP writes per tensor a global shape and, per rank, the box it saves
# (offsets and sizes). A torch DTensor's box comes from torch's
# ``compute_local_shape_and_global_offset``; an hp DTensor's from its DCP
# protocol (:mod:`hp_dtensor.checkpoint`). For the files to load across the two
# the metadata must describe the same tensors; :func:`checkpoint_layout` reads
# it back so a test can compare the two checkpoints entry by entry (they are
# identical, boxes included, for FSDP and FSDP x TP).
def checkpoint_layout(path: str | Path) -> dict[str, Any]:
    """What a DCP checkpoint's metadata says of each entry: tensors' global shape, dtype and saved boxes.

    A tensor entry becomes ``(shape, dtype, sorted boxes)`` with a box as
    ``(offsets, sizes)``; any other entry (bytes) becomes ``"bytes"``. Two
    checkpoints whose layouts are equal describe the same tensors cut the
    same way ([Note: interchangeable files]).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    layout: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            layout[key] = (tuple(entry.size), entry.properties.dtype, boxes)
        else:
            layout[key] = "bytes"
    return layout

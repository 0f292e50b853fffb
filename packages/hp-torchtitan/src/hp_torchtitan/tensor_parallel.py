"""Tensor parallelism (with sequence parallelism) for torchtitan's Llama 3 decoder, with hp_dtensor.

torchtitan 0.3.0's TP plan written with ``hp_dtensor.parallelize_module``, module
by module: [Note: torchtitan's TP plan] (above :func:`apply_tp`); where the run
differs from torchtitan's (not numerically): [Note: differences from torchtitan's TP run].
"""

from __future__ import annotations

from typing import Any

import hp_core
import torch.nn as nn
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    parallelize_module,
)


def _gather_sequence(tp_mesh: hp_core.DeviceMesh) -> Any:
    """A forward pre-hook: the first argument, ``Shard(1)`` over ``tp_mesh``, all-gathered to ``Replicate``.

    torch's ``PrepareModuleInput``; hp_dtensor has no such style, and the
    attention and feed-forward blocks need one all-gather each before their
    column-wise projections (one per block, not one per projection).
    """

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Shard(1)])
        return (x.redistribute(placements=[Replicate()]), *args[1:])

    return hook


def _check_blocks(model: nn.Module, tp: int) -> None:
    """Refuse, before anything is sharded, blocks this plan cannot cut ``tp`` ways."""
    layers: Any = model.layers  # torchtitan's ModuleDict of blocks
    for name, block in layers.items():
        qkv, feed_forward = block.attention.qkv_linear, block.feed_forward
        if not hasattr(qkv, "wqkv") or feed_forward is None:
            raise NotImplementedError(
                f"hp_torchtitan.apply_tp: layers.{name} has {type(qkv).__name__} / "
                f"{type(feed_forward).__name__}; only dense blocks with a fused wqkv projection are "
                "supported (a Llama 3 flavor)."
            )
        kv_groups = qkv.wqkv.out_features // (qkv.r_dim * qkv.head_dim)
        if kv_groups % tp != 0:
            raise ValueError(
                f"hp_torchtitan.apply_tp: {kv_groups} KV heads do not split over tp={tp} (the fused wqkv "
                "is cut by KV group); pick a tp degree that divides n_kv_heads."
            )


# [Note: torchtitan's TP plan]
# torchtitan 0.3.0 states its TP plan as per-module ``sharding_config``s
# (``models/common/decoder_sharding.py`` + ``models/llama3/sharding.py``) that
# ``Module.parallelize`` turns into torch DTensors. The same plan, written with
# ``hp_dtensor.parallelize_module`` (sequence parallelism on, torchtitan's
# default):
#
# ==========================  ==================================================
# module                      hp style (torchtitan's placement on ``tp``)
# ==========================  ==================================================
# ``tok_embeddings``          row-wise: table ``Shard(0)``, output ``Shard(1)``
# ``layers.*.attention_norm`` ``SequenceParallel`` (weight ``Replicate``)
# ``layers.*.attention``      input ``Shard(1)`` gathered to ``Replicate``
# ``...qkv_linear.wqkv``      column-wise (``Shard(0)`` weight, KV-group interleaved)
# ``layers.*.attention.wo``   row-wise, output reduce-scattered to ``Shard(1)``
# ``layers.*.ffn_norm``       ``SequenceParallel``
# ``layers.*.feed_forward``   input ``Shard(1)`` gathered to ``Replicate``
# ``...w1`` / ``...w3``       column-wise
# ``...feed_forward.w2``      row-wise, output ``Shard(1)``
# ``norm``                    ``SequenceParallel``
# ``lm_head``                 column-wise from ``Shard(1)``, output gathered
# ==========================  ==================================================
#
# Every parameter is then an hp DTensor on the ``tp`` mesh (nothing is left
# whole), so after FSDP all of them live on one 2-D mesh, which gradient
# clipping and the fused optimizer need.
# [Note: differences from torchtitan's TP run]
# Two differences from torchtitan's torch run, neither numerical beyond fp32
# rounding: the residual stream between blocks is the local ``Shard(1)`` piece
# (a plain tensor, as torchtitan's pre-0.3 plan had it) rather than a DTensor, and
# ``lm_head`` hands back replicated logits (a plain tensor) for a plain
# cross-entropy, where torchtitan keeps them vocab-sharded for its loss-parallel
# cross-entropy, which tests for torch's DTensor type.
def apply_tp(model: nn.Module, tp_mesh: hp_core.DeviceMesh) -> None:
    """Shard a torchtitan Llama 3 decoder (on any device, meta included) over the 1-D ``tp_mesh``.

    A pipeline stage's part of the decoder works too: what it does not hold is skipped. Stage
    boundaries then carry the residual stream's local ``Shard(1)`` piece, a plain tensor.
    """
    _check_blocks(model, tp_mesh.size())
    outer = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    # A pipeline stage's model part holds some of these only (the others are None).
    present = {name: style for name, style in outer.items() if getattr(model, name, None) is not None}
    if present:
        parallelize_module(model, tp_mesh, present)
    blocks: Any = model.layers
    for block in blocks.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention.qkv_linear.wqkv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
        block.attention.register_forward_pre_hook(_gather_sequence(tp_mesh))
        block.feed_forward.register_forward_pre_hook(_gather_sequence(tp_mesh))

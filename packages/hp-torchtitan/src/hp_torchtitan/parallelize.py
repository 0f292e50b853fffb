"""torchtitan's parallelize function for its decoders, with hp_fsdp instead of torch's FSDP2.

A ``ModelSpec`` can name :func:`parallelize_decoder` as its ``parallelize_fn``
and torchtitan's trainer (or our CPU driver) calls it unchanged. Its units, TP
first and pipeline stage parts: [Note: torchtitan's FSDP units] (above
:func:`parallelize_decoder`); what it refuses: [Note: not yet in parallelize]
(above :func:`_check_supported`).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from hp_fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hp_torchtitan.meshes import hp_dense_meshes
from hp_torchtitan.tensor_parallel import apply_tp

_RESHARD_POLICIES = ("default", "always", "never")


def _reject(observed: str, fix: str) -> None:
    raise NotImplementedError(f"hp_torchtitan.parallelize_decoder: {observed} is not supported yet; {fix}.")


# [Note: not yet in parallelize]
# What is not here yet raises before anything is applied: context and expert
# parallelism, TP without sequence parallelism, activation
# checkpointing, compile, CPU offload, weight tying (see the README's "Not yet").
def _check_supported(model: nn.Module, parallel_dims: Any, parallelism: Any, compile_config: Any) -> None:
    """Refuse, before any module is touched, every option this slice does not implement."""
    for name in ("cp", "ep"):
        degree = getattr(parallel_dims, name)
        if degree != 1:
            _reject(
                f"{name}={degree}", f"set parallelism's {name} degree to 1 (only FSDP/HSDP x TP x PP so far)"
            )
    if parallel_dims.tp != 1 and not parallelism.enable_sequence_parallel:
        _reject(
            f"tp={parallel_dims.tp} with parallelism.enable_sequence_parallel=False",
            "set enable_sequence_parallel=True (torchtitan's default)",
        )
    backend = parallelism.spmd_backend
    if backend != "partial_dtensor":
        _reject(
            f"parallelism.spmd_backend={backend!r}",
            "set parallelism.spmd_backend='partial_dtensor' (its 'fsdp' mesh is what hp_fsdp shards over)",
        )
    if parallelism.fsdp_reshard_after_forward not in _RESHARD_POLICIES:
        raise ValueError(
            f"hp_torchtitan.parallelize_decoder: parallelism.fsdp_reshard_after_forward="
            f"{parallelism.fsdp_reshard_after_forward!r}; use one of {_RESHARD_POLICIES}."
        )
    if compile_config is not None and compile_config.enable:
        _reject("compile.enable=True", "set compile.enable=False")
    if getattr(model, "enable_weight_tying", False):
        _reject("a model with enable_weight_tying=True", "use a flavor without tied embeddings")


# [Note: torchtitan's FSDP units]
# Same signature and the same FSDP units as torchtitan 0.3.0's
# ``parallelize_llama`` + ``apply_fsdp_to_decoder`` for a dense decoder, so a
# :class:`torchtitan.protocols.model_spec.ModelSpec` can name it as its
# ``parallelize_fn`` and torchtitan's trainer (or our CPU driver) calls it
# unchanged:
#
# * ``tok_embeddings`` one unit, every transformer block one unit, ``norm`` and
#   ``lm_head`` together one unit that keeps its parameters gathered after the
#   forward (the backward needs them first), the root last;
# * fp32 or the configured mixed precision, with ``cast_forward_inputs=False``;
# * gradient division off (``set_gradient_divide_factor(1.0)``): torchtitan's
#   loss is already a sum divided by the global count of valid tokens.
#
# With ``tp > 1`` the decoder is first tensor-parallel (sequence parallel on)
# by :func:`hp_torchtitan.tensor_parallel.apply_tp`, then FSDP shards the TP
# parameters again over the data-parallel dims of the same hp mesh.
#
# Under pipeline parallelism torchtitan (or :func:`hp_torchtitan.pipeline.pipeline_decoder`)
# calls this once per stage's model part; modules a part does not hold are
# ``None`` (or an empty ``layers``) and are skipped, and blocks keep their
# parameters gathered after the forward by default, as torchtitan's
# ``get_fsdp_reshard_after_forward_policy`` does with PP on.
def parallelize_decoder(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """Apply hp_fsdp's ``fully_shard`` to a torchtitan decoder (a ``ModelSpec.parallelize_fn``).

    ``parallel_dims`` is torchtitan's ``ParallelDims`` (meshes built); the
    data-parallel mesh is its ``fsdp`` dim, with ``dp_replicate`` in front for
    HSDP. ``training`` gives the mixed-precision dtypes and CPU offload flag.
    """
    del dump_folder  # only activation-checkpoint debugging writes there
    _check_supported(model, parallel_dims, parallelism, compile_config)
    if ac_config is not None:
        _reject(f"activation_checkpoint={type(ac_config).__name__}", "pass ac_config=None")
    if training.enable_cpu_offload:
        _reject("training.enable_cpu_offload=True", "set training.enable_cpu_offload=False")

    from torchtitan.config import TORCH_DTYPE_MAP

    mesh, tp_mesh = hp_dense_meshes(parallel_dims)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )
    policy = parallelism.fsdp_reshard_after_forward
    # torchtitan's "default" reshards every block after forward unless PP is on: a stage runs
    # several micro-batches' forwards and backwards in a row, which would gather each time.
    blocks_reshard = policy == "always" or (policy == "default" and parallel_dims.pp == 1)
    tail_reshard = policy == "always"

    decoder: Any = model  # torchtitan's Decoder: its submodules by name
    if decoder.tok_embeddings is not None:
        fully_shard(
            decoder.tok_embeddings, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=blocks_reshard
        )
    if decoder.norm is not None and decoder.lm_head is not None:
        tail = [decoder.norm, decoder.lm_head]
        fully_shard(tail, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=tail_reshard)
    for block in decoder.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=blocks_reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    return model

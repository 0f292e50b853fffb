"""Single-process checks: the spec, the refusals before anything is applied, the data split, the stand-in."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn


def _dims(**degrees: int) -> types.SimpleNamespace:
    values = {"tp": 1, "cp": 1, "pp": 1, "ep": 1, **degrees}
    return types.SimpleNamespace(dp_replicate_enabled=False, **values)


def _call(parallel_dims, **overrides):  # type: ignore[no-untyped-def]
    from hp_torchtitan import parallelize_decoder
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    kwargs = {
        "parallel_dims": parallel_dims,
        "training": TrainingConfig(),
        "parallelism": ParallelismConfig(spmd_backend="partial_dtensor"),
        "compile_config": CompileConfig(),
        "ac_config": None,
        "dump_folder": "unused",
    }
    kwargs.update(overrides)
    return parallelize_decoder(nn.Linear(2, 2), **kwargs)


def test_spec_is_torchtitans_llama3_with_hp_parallelize() -> None:
    import hp_torchtitan
    from torchtitan.models.llama3 import model_registry

    spec = hp_torchtitan.hp_llama3_spec("debugmodel")
    theirs = model_registry("debugmodel")
    assert spec.name == "hp_llama3" and spec.flavor == "debugmodel"
    assert spec.parallelize_fn is hp_torchtitan.parallelize_decoder
    assert spec.pipelining_fn is hp_torchtitan.pipeline_decoder
    assert spec.state_dict_adapter is theirs.state_dict_adapter
    assert spec.model.dim == theirs.model.dim and len(spec.model.layers) == len(theirs.model.layers)
    with pytest.raises(ValueError, match=r"unknown Llama 3 flavor 'tiny'.*debugmodel"):
        hp_torchtitan.hp_llama3_spec("tiny")


@pytest.mark.parametrize("dim", ["cp", "ep"])
def test_other_parallelisms_are_refused_by_name(dim: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"{dim}=2 is not supported yet; set parallelism's {dim}"):
        _call(_dims(**{dim: 2}))


def test_tp_without_sequence_parallel_is_refused() -> None:
    from torchtitan.config import ParallelismConfig

    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", enable_sequence_parallel=False)
    with pytest.raises(NotImplementedError, match=r"tp=2 with parallelism.enable_sequence_parallel=False"):
        _call(_dims(tp=2), parallelism=parallelism)


def test_tp_degree_must_divide_the_kv_heads() -> None:
    import hp_torchtitan  # noqa: F401  (the triton stand-in)
    from hp_torchtitan.tensor_parallel import apply_tp
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()
    before = {name: type(p) for name, p in model.named_parameters()}
    three_ranks = types.SimpleNamespace(size=lambda: 3)
    with pytest.raises(ValueError, match=r"16 KV heads do not split over tp=3"):
        apply_tp(model, three_ranks)  # type: ignore[arg-type]
    assert {name: type(p) for name, p in model.named_parameters()} == before  # nothing was sharded


def test_spmd_backend_compile_and_cpu_offload_are_refused() -> None:
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    with pytest.raises(NotImplementedError, match=r"spmd_backend='spmd_types'.*'partial_dtensor'"):
        _call(_dims(), parallelism=ParallelismConfig(spmd_backend="spmd_types"))
    with pytest.raises(NotImplementedError, match=r"compile.enable=True"):
        _call(_dims(), compile_config=CompileConfig(enable=True))
    with pytest.raises(NotImplementedError, match=r"enable_cpu_offload=True"):
        _call(_dims(), training=TrainingConfig(enable_cpu_offload=True))
    with pytest.raises(NotImplementedError, match=r"activation_checkpoint=object"):
        _call(_dims(), ac_config=object())


def test_mesh_conversion_refuses_other_types() -> None:
    from hp_torchtitan import hp_mesh_from_torch

    with pytest.raises(TypeError, match=r"got list; pass parallel_dims.get_mesh"):
        hp_mesh_from_torch([0, 1])


def test_packed_batches_split_a_global_batch_by_rank() -> None:
    from hp_torchtitan.data import packed_batches

    tokens = list(range(100))
    both = [
        packed_batches(tokens, steps=2, local_batch_size=2, seq_len=4, dp_rank=r, dp_degree=2) for r in (0, 1)
    ]
    # step 0: four windows of 5 tokens, rank 0 rows 0-1, rank 1 rows 2-3; step 1 continues the stream
    torch.testing.assert_close(both[0][0].inputs, torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]))
    torch.testing.assert_close(both[1][0].labels, torch.tensor([[11, 12, 13, 14], [16, 17, 18, 19]]))
    torch.testing.assert_close(both[0][1].inputs[0], torch.tensor([20, 21, 22, 23]))
    torch.testing.assert_close(both[0][0].positions, torch.tensor([[0, 1, 2, 3]] * 2))
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside 0..1"):
        packed_batches(tokens, steps=1, local_batch_size=1, seq_len=4, dp_rank=2, dp_degree=2)


def test_triton_stand_in_kernels_explain_themselves() -> None:
    import hp_torchtitan  # noqa: F401  (registers the stand-in when triton is absent)
    from hp_torchtitan.compat import KERNELS_MODULE

    kernels = sys.modules[KERNELS_MODULE]
    if getattr(kernels, "__file__", "").endswith("compat.py"):
        with pytest.raises(
            RuntimeError, match=r"copy_rows_to_peers_kernel is a triton kernel.*install triton"
        ):
            kernels.copy_rows_to_peers_kernel()
        with pytest.raises(AttributeError):
            kernels.some_helper  # noqa: B018
    import torchtitan.models.llama3  # noqa: F401  (imports with or without triton)

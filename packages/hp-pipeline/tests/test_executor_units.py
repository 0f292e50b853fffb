"""Single-process pieces of the executor: batch splitting, FSDP step insertion, stage checks."""

from __future__ import annotations

import pytest
import torch
from hp_pipeline import (
    REPLICATE,
    MetaStepType,
    PipelineStage,
    PipelineStepError,
    Schedule1F1B,
    StageFailure,
    TensorChunkSpec,
    TensorMeta,
    add_fsdp_steps,
    build_1f1b_order,
    build_zbv_order,
    insert_comms,
    is_sharded_module,
    merge_chunks,
    split_args_kwargs,
    validate_order,
)
from torch import nn


def test_split_default_specs_and_uneven_pieces():
    x = torch.arange(10).reshape(10, 1)
    args, kwargs = split_args_kwargs((x, "flag"), {"scale": 2.0, "y": x * 2}, 4)
    assert [a[0].shape[0] for a in args] == [3, 3, 2, 2]
    assert all(a[1] == "flag" for a in args)
    assert all(k["scale"] == 2.0 for k in kwargs)
    assert torch.equal(torch.cat([k["y"] for k in kwargs]), x * 2)


def test_split_with_specs():
    x = torch.arange(12).reshape(2, 6)
    args, kwargs = split_args_kwargs((x, x), {"m": x}, 3, [TensorChunkSpec(1), REPLICATE], {"m": REPLICATE})
    assert [a[0].shape for a in args] == [torch.Size([2, 2])] * 3
    assert all(a[1] is x and k["m"] is x for a, k in zip(args, kwargs, strict=True))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: split_args_kwargs((torch.ones(2),), {}, 4), "size 2 along dim 0.*n_microbatches=4"),
        (lambda: split_args_kwargs((torch.ones(4),), {}, 2, [TensorChunkSpec(3)]), "splits dim 3"),
        (lambda: split_args_kwargs((1,), {}, 2, [TensorChunkSpec(0)]), "REPLICATE"),
        (lambda: split_args_kwargs((torch.ones(4),), {}, 2, []), "1 positional"),
        (lambda: split_args_kwargs((), {}, 2, None, {"z": REPLICATE}), r"\['z'\]"),
    ],
)
def test_split_errors_name_the_value_and_fix(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_merge_chunks():
    parts = [torch.ones(2, 3), torch.zeros(1, 3)]
    assert merge_chunks(parts).shape == (3, 3)
    merged = merge_chunks([(p, p) for p in parts], 0)
    assert isinstance(merged, tuple) and merged[1].shape == (3, 3)
    assert merge_chunks([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("order", [build_1f1b_order(4, 8), build_zbv_order(2, 4)], ids=["1f1b", "zbv"])
def test_fsdp_steps_validate_and_survive_insert_comms(order):
    stages = {s.stage_index for steps in order.values() for s in steps}
    with_fsdp = add_fsdp_steps(order, stages)
    validate_order(with_fsdp)
    runnable = insert_comms(with_fsdp)
    validate_order(runnable, require_comms=True)
    for steps in runnable.values():
        for stage in {s.stage_index for s in steps}:
            kinds = [s.type for s in steps if s.stage_index == stage and s.type.is_fsdp]
            assert kinds == [MetaStepType.UNSHARD, MetaStepType.REDUCE_GRAD, MetaStepType.RESHARD]


def test_sharded_module_detection():
    class Sharded(nn.Linear):
        def unshard(self):
            return None

        def reshard(self):
            return None

        def reduce_grad(self):
            return None

    assert is_sharded_module(Sharded(2, 2))
    assert not is_sharded_module(nn.Linear(2, 2))


def test_stage_arguments_checked():
    with pytest.raises(ValueError, match=r"stage_index must be in 0 .. 1"):
        PipelineStage(nn.Linear(2, 2), 2, 2)
    with pytest.raises(ValueError, match="meta"):
        PipelineStage(nn.Linear(2, 2), 0, 2, device="meta")
    with pytest.raises(TypeError, match=r"nn\.Module"):
        PipelineStage(lambda x: x, 0, 1)  # type: ignore[arg-type]
    stage = PipelineStage(nn.Linear(2, 2), 1, 2)
    assert stage.is_last and not stage.is_first and stage.device.type != "meta"


def test_tensor_meta():
    leaf = torch.ones(2, 3, requires_grad=True)
    assert TensorMeta.of(leaf) == TensorMeta((2, 3), torch.float32, True)
    assert not TensorMeta.of(torch.ones(2, dtype=torch.int64)).requires_grad
    assert TensorMeta.of(leaf).empty(torch.device("cpu")).shape == (2, 3)


def test_step_error_names_ranks_and_keeps_traceback():
    failures = [
        StageFailure(3, 3, "3F1", "ValueError: bad", "Traceback ...\nValueError: bad"),
        StageFailure(1, None, "", "TypeError: no", "tb"),
    ]
    error = PipelineStepError.from_failures(failures)
    text = str(error)
    assert text.startswith("pipeline step failed on rank 1, 3")
    assert "rank 3 raised ValueError: bad in step 3F1 (stage 3)" in text
    assert "--- traceback on rank 3 ---" in text
    assert [f.rank for f in error.failures] == [1, 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_recv_lookahead_checked(bad):
    stage = PipelineStage(nn.Linear(2, 2), 0, 1)
    with pytest.raises(ValueError, match=r"recv_lookahead must be None .* or an int >= 1.*got"):
        Schedule1F1B(stage, 2, recv_lookahead=bad)

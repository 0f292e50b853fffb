"""The public API contract of ``shared/DESIGN.md``, checked against the code.

Outside checks drive the packages through exactly these names and signatures under
plain ``torchrun``; a rename, a reordered argument or a changed default would break
them without failing any package's own tests, which import whatever the code has.
So the contract is written down here a second time, as data, and compared with what
``inspect`` sees. Changing the contract means changing DESIGN.md and this file together.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
KW = inspect.Parameter.KEYWORD_ONLY
MISSING = inspect.Parameter.empty


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter, ``self`` and ``**options`` left out."""
    sig = inspect.signature(fn)
    return [
        (p.name, p.kind, p.default)
        for p in sig.parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


# (module, attribute): every name DESIGN.md lists.
NAMES = {
    "hp_core": ["init_device_mesh", "DeviceMesh", "get_platform"],
    "hp_dtensor": [
        "DTensor",
        "Shard",
        "Replicate",
        "Partial",
        "distribute_tensor",
        "distribute_module",
        "parallelize_module",
        "ColwiseParallel",
        "RowwiseParallel",
        "SequenceParallel",
        "to_torch_dtensor",
        "from_torch_dtensor",
        "local_map",
        "register_sharding",
    ],
    "hp_fsdp": ["fully_shard", "HSDPModule", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy"],
    "hp_pipeline": [
        "MetaStep",
        "MetaStepType",
        "PipelineStage",
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleZeroBubble",
        "ScheduleZBV",
        "ScheduleZBVZeroBubble",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleDualPipeV",
        "ScheduleMPipe",
        "get_schedule_class",
        "insert_comms",
        "validate_order",
        "simulate",
        "render_order",
    ],
}


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, names in NAMES.items() for n in names])
def test_every_contract_name_is_exported(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    assert hasattr(mod, name), f"{module}.{name} is in DESIGN.md's contract but not exported"
    assert name in mod.__all__, f"{module}.{name} exists but is missing from {module}.__all__"


@pytest.mark.parametrize("module", ["hp_core", "hp_dtensor", "hp_fsdp", "hp_pipeline", "hp_testing"])
def test_all_lists_only_real_names(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names {missing}, which do not exist"


def test_init_device_mesh_signature() -> None:
    import hp_core

    assert _params(hp_core.init_device_mesh) == [
        ("device_type", POS, MISSING),
        ("mesh_shape", POS, MISSING),
        ("mesh_dim_names", KW, None),
    ]


def test_device_mesh_surface() -> None:
    import hp_core

    for attr in (
        "shape",
        "ndim",
        "mesh_dim_names",
        "get_group",
        "get_local_rank",
        "get_coordinate",
        "size",
        "flatten",
        "to_torch",
        "from_torch",
        "__getitem__",
    ):
        assert hasattr(hp_core.DeviceMesh, attr), f"DeviceMesh.{attr} is in the contract"
    for method in ("get_group", "get_local_rank", "size"):
        (only,) = _params(getattr(hp_core.DeviceMesh, method))
        assert only[2] is None, f"DeviceMesh.{method}'s dimension defaults to None in the contract"
    assert _params(hp_core.DeviceMesh.flatten) == [("name", POS, None)]
    assert _params(hp_core.DeviceMesh.from_torch) == [("torch_mesh", POS, MISSING)]  # a classmethod


def test_dtensor_signatures() -> None:
    from hp_dtensor import DTensor

    assert _params(DTensor.from_local) == [
        ("local", POS, MISSING),
        ("device_mesh", POS, MISSING),
        ("placements", POS, MISSING),
        ("shape", KW, None),
        ("run_check", KW, False),
    ]
    assert _params(DTensor.redistribute) == [
        ("device_mesh", POS, None),
        ("placements", POS, None),
        ("async_op", KW, False),
        ("forward_dtype", KW, None),
        ("backward_dtype", KW, None),
    ]
    for attr in ("to_local", "full_tensor", "placements", "device_mesh"):
        assert hasattr(DTensor, attr), f"DTensor.{attr} is in the contract"
    # DCP's protocol lives on DTensor itself: a TP-only model checkpoints without hp-fsdp.
    for attr in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__"):
        assert attr in vars(DTensor), f"DTensor must carry DCP's {attr} itself"


def test_local_map_and_register_sharding_signatures() -> None:
    import hp_dtensor

    assert _params(hp_dtensor.local_map) == [
        ("func", POS, None),
        ("out_placements", POS, None),
        ("in_placements", POS, None),
        ("in_grad_placements", POS, None),
        ("device_mesh", POS, None),
        ("redistribute_inputs", KW, False),
    ]
    assert _params(hp_dtensor.register_sharding) == [("op", POS, MISSING)]


def test_fully_shard_signature() -> None:
    import hp_fsdp

    params = _params(hp_fsdp.fully_shard)
    assert [(n, k) for n, k, _ in params] == [
        ("module", POS),
        ("mesh", KW),
        ("reshard_after_forward", KW),
        ("shard_placement_fn", KW),
        ("mp_policy", KW),
        ("offload_policy", KW),
        ("ignored_params", KW),
        ("replicate_params", KW),
        ("comm_fusion", KW),
    ]
    defaults = {n: d for n, _, d in params}
    assert defaults["reshard_after_forward"] is None, "None carries FSDP2's meaning (True except the root)"
    assert defaults["mp_policy"] == hp_fsdp.MixedPrecisionPolicy()
    assert defaults["comm_fusion"] is True
    for n in ("mesh", "shard_placement_fn", "offload_policy", "ignored_params", "replicate_params"):
        assert defaults[n] is None, n


def test_fsdp_module_methods() -> None:
    import hp_fsdp

    assert hp_fsdp.FSDPModule is hp_fsdp.HSDPModule
    for method in (
        "unshard",
        "reshard",
        "set_requires_gradient_sync",
        "set_requires_all_reduce",
        "set_reshard_after_forward",
        "set_reshard_after_backward",
        "set_modules_to_forward_prefetch",
        "set_modules_to_backward_prefetch",
        "set_gradient_divide_factor",
        "set_reduce_op_type",
    ):
        assert callable(getattr(hp_fsdp.FSDPModule, method, None)), f"FSDPModule.{method} is in the contract"


def test_policies_fields_in_order() -> None:
    import hp_fsdp

    assert [n for n, _, _ in _params(hp_fsdp.MixedPrecisionPolicy)] == [
        "param_dtype",
        "reduce_dtype",
        "output_dtype",
        "cast_forward_inputs",
        "apply_grad_on_fp32_main_grad",
    ]
    assert [n for n, _, _ in _params(hp_fsdp.CPUOffloadPolicy)] == ["pin_memory"]


SINGLE_STAGE = ["ScheduleGPipe", "Schedule1F1B", "ScheduleZeroBubble"]
MULTI_STAGE = [
    "ScheduleInterleaved1F1B",
    "ScheduleZBV",
    "ScheduleZBVZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleDualPipeV",
]


@pytest.mark.parametrize("name", SINGLE_STAGE + MULTI_STAGE)
def test_schedule_constructor_and_step(name: str) -> None:
    import hp_pipeline

    cls = getattr(hp_pipeline, name)
    first = "stage" if name in SINGLE_STAGE else "stages"
    head = [n for n, _, _ in _params(cls.__init__)][:3]
    expected = [first, "n_microbatches", "loss_fn"]
    assert head == expected, f"{name}: torch's argument order is {expected}, got {head}"
    step = {n: (k, d) for n, k, d in _params(cls.step)}
    assert step["target"] == (KW, None) and step["losses"] == (KW, None)


@pytest.mark.parametrize(
    ("torch_name", "ours"),
    [
        ("GPipe", "ScheduleGPipe"),
        ("1F1B", "Schedule1F1B"),
        ("Interleaved1F1B", "ScheduleInterleaved1F1B"),
        ("LoopedBFS", "ScheduleLoopedBFS"),
        ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble"),
        ("ZBVZeroBubble", "ScheduleZBVZeroBubble"),
        ("DualPipeV", "ScheduleDualPipeV"),
    ],
)
def test_get_schedule_class_takes_torchs_names(torch_name: str, ours: str) -> None:
    import hp_pipeline

    assert hp_pipeline.get_schedule_class(torch_name) is getattr(hp_pipeline, ours)
    assert hp_pipeline.get_schedule_class(torch_name.lower()) is getattr(hp_pipeline, ours)


def test_get_schedule_class_names_the_choices() -> None:
    import hp_pipeline

    with pytest.raises(ValueError, match="Interleaved1F1B") as info:
        hp_pipeline.get_schedule_class("Interleaved2F2B")
    assert "Interleaved2F2B" in str(info.value)


def test_meta_step_leading_arguments() -> None:
    import hp_pipeline

    assert [n for n, _, _ in _params(hp_pipeline.MetaStep)][:3] == ["micro_index", "type", "stage_index"]


def test_hp_testing_contract() -> None:
    from importlib.metadata import entry_points

    import hp_testing.fixtures as fixtures

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("hp-run") == "hp_testing.launcher:main"
    assert callable(fixtures.make_device_mesh_factory)

"""Bad input to every public entry point: a clear error, on every rank, with nothing changed.

The rule: every public entry point checks its arguments before it changes anything.

Each case checks three things: the message names the value the call saw and
the fix, the call raised (on every rank: the distributed tests run the same
body on each rank and fail if any rank does not raise), and nothing changed
(the module has no hooks, no hp_fsdp state and plain parameters; a setter
left every unit's flags as they were; a rejected load left every shard's
values). Cases that need other ranks' arguments raise at the first
communication instead ([Note: fully_shard agreement] in agreement.py): those
tests check that no all-gather was issued and the units were not initialised.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_dtensor import DTensor, Replicate, Shard
from hp_fsdp import CPUOffloadPolicy, HSDPModule, MixedPrecisionPolicy, fully_shard
from hp_fsdp.state import STATE_ATTR, get_state
from hp_testing import record_collectives
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build

# -- policies: checked when built, no process group needed -------------------------------------

POLICY_CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "param_dtype as a string",
        lambda: MixedPrecisionPolicy(param_dtype="bfloat16"),  # type: ignore[arg-type]
        TypeError,
        r"param_dtype='bfloat16' is a str, not a torch.dtype; pass a floating-point torch.dtype",
    ),
    (
        "param_dtype not floating point",
        lambda: MixedPrecisionPolicy(param_dtype=torch.int64),
        ValueError,
        r"param_dtype=torch.int64 is not a floating-point dtype.*pass torch.bfloat16",
    ),
    (
        "reduce_dtype bool",
        lambda: MixedPrecisionPolicy(reduce_dtype=torch.bool),
        ValueError,
        r"reduce_dtype=torch.bool is not a floating-point dtype.*None: reduce in param_dtype",
    ),
    (
        "output_dtype a Python type",
        lambda: MixedPrecisionPolicy(output_dtype=float),  # type: ignore[arg-type]
        TypeError,
        r"output_dtype=<class 'float'> is a type, not a torch.dtype; pass",
    ),
    (
        "cast_forward_inputs a string",
        lambda: MixedPrecisionPolicy(cast_forward_inputs="yes"),  # type: ignore[arg-type]
        TypeError,
        r"cast_forward_inputs='yes' is a str, not a bool; pass True or False",
    ),
    (
        "apply_grad_on_fp32_main_grad an int",
        lambda: MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=1),  # type: ignore[arg-type]
        TypeError,
        r"apply_grad_on_fp32_main_grad=1 is a int, not a bool; pass True or False",
    ),
    (
        "pin_memory a string",
        lambda: CPUOffloadPolicy(pin_memory="no"),  # type: ignore[arg-type]
        TypeError,
        r"CPUOffloadPolicy: pin_memory='no' is a str, not a bool; pass True or False",
    ),
]


@pytest.mark.parametrize(("name", "make", "kind", "message"), POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_bad_policy_fields(name: str, make: Callable[[], Any], kind: type[Exception], message: str) -> None:
    with pytest.raises(kind, match=message):
        make()


def test_good_policies_still_build() -> None:
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32, False, True)
    assert policy.reduce_dtype is torch.float32
    assert CPUOffloadPolicy(pin_memory=False).pin_memory is False


# -- fully_shard: every argument, nothing changed ----------------------------------------------


def _case(cases: list[tuple[Any, ...]], name: str) -> Any:
    """The rest of the case called ``name`` (distributed tests take only picklable parameters: names)."""
    return next(case[1:] for case in cases if case[0] == name)


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return dict(model.named_parameters())


def _untouched(model: nn.Module, before: dict[str, Any]) -> None:
    """No class swap, no state, no hooks, the same plain Parameter objects."""
    assert not isinstance(model, HSDPModule)
    assert dict(model.named_parameters()) == before
    for name, p in model.named_parameters():
        assert not isinstance(p, DTensor), name
        assert p is before[name], name
    for m in model.modules():
        assert STATE_ATTR not in m.__dict__
        assert not m._forward_pre_hooks and not m._forward_hooks
        assert not m._load_state_dict_pre_hooks and not m._state_dict_pre_hooks


def _other_param() -> nn.Parameter:
    return build(seed=1).emb.weight


FULLY_SHARD_CASES: list[tuple[str, Callable[[nn.Module], dict[str, Any]], type[Exception], str]] = [
    (
        "shard_placement_fn not callable",
        lambda m: {"shard_placement_fn": 5},
        TypeError,
        r"shard_placement_fn=5 is a int, not callable; pass a function of the parameter "
        r"returning Shard\(dim\)",
    ),
    (
        "shard_placement_fn returns Replicate",
        lambda m: {"shard_placement_fn": lambda p: Replicate()},
        TypeError,
        r"returned Replicate\(\) for 'emb.weight'; return Shard\(dim\) or None",
    ),
    (
        "mp_policy a string",
        lambda m: {"mp_policy": "bf16"},
        TypeError,
        r"mp_policy='bf16' is a str, not an instance of MixedPrecisionPolicy; "
        r"pass MixedPrecisionPolicy\(...\)",
    ),
    (
        "mp_policy the class",
        lambda m: {"mp_policy": MixedPrecisionPolicy},
        TypeError,
        r"mp_policy=MixedPrecisionPolicy is the class, not a policy; instantiate it",
    ),
    (
        "offload_policy the class",
        lambda m: {"offload_policy": CPUOffloadPolicy},
        TypeError,
        r"offload_policy=CPUOffloadPolicy is the class, not a policy; instantiate it: CPUOffloadPolicy\(\)",
    ),
    (
        "offload_policy a string",
        lambda m: {"offload_policy": "cpu"},
        TypeError,
        r"offload_policy='cpu' is a str, not an instance of OffloadPolicy; pass CPUOffloadPolicy\(\) or None",
    ),
    (
        "comm_fusion a string",
        lambda m: {"comm_fusion": "no"},
        TypeError,
        r"comm_fusion='no' is a str, not a bool; pass True or False",
    ),
    (
        "ignored_params a module",
        lambda m: {"ignored_params": m.norm},
        TypeError,
        r"ignored_params is a LayerNorm, not an iterable of parameters; "
        r"pass a list .*list\(module.parameters",
    ),
    (
        "ignored_params one Parameter",
        lambda m: {"ignored_params": m.norm.weight},
        TypeError,
        r"ignored_params is a Parameter, not an iterable of parameters; .* e.g. \[param\]",
    ),
    (
        "ignored_params a plain tensor",
        lambda m: {"ignored_params": [torch.zeros(3)]},
        TypeError,
        r"ignored_params\[0\]=tensor\(\[0., 0., 0.\]\) is a Tensor, not an nn.Parameter",
    ),
    (
        "ignored_params of another model",
        lambda m: {"ignored_params": [_other_param()]},
        ValueError,
        r"ignored_params\[0\] \(shape \(13, 6\)\) is not a parameter of the module\(s\) passed "
        r"\(Transformer\); "
        r"pass parameters of these modules",
    ),
    (
        "replicate_params by name",
        lambda m: {"replicate_params": ["norm.weight"]},
        TypeError,
        r"replicate_params\[0\]='norm.weight' is a str.*module.get_parameter\('norm.weight'\)",
    ),
    (
        "replicate_params of another model",
        lambda m: {"replicate_params": [_other_param()]},
        ValueError,
        r"replicate_params\[0\] \(shape \(13, 6\)\) is not a parameter of the module\(s\) passed",
    ),
    (
        "a parameter both ignored and replicated",
        lambda m: {"ignored_params": [m.norm.weight], "replicate_params": [m.norm.weight]},
        ValueError,
        r"\['norm.weight'\] are in both ignored_params and replicate_params; pass each parameter in one",
    ),
    (
        "reshard_after_forward a string",
        lambda m: {"reshard_after_forward": "yes"},
        TypeError,
        r"reshard_after_forward='yes' is a str; pass True, False, None",
    ),
    (
        "mesh a string",
        lambda m: {"mesh": "cpu"},
        TypeError,
        r"mesh must be an hp_core.DeviceMesh \(or a torch DeviceMesh\), got str; build one with "
        r"hp_core.init_device_mesh",
    ),
]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", [c[0] for c in FULLY_SHARD_CASES])
def test_bad_fully_shard_arguments(rank: int, world_size: int, name: str) -> None:
    kwargs, kind, message = _case(FULLY_SHARD_CASES, name)
    model = build()
    before = _snapshot(model)
    with pytest.raises(kind, match=message):
        fully_shard(model, **kwargs(model))
    _untouched(model, before)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("module", [42, "list"], ids=["an int", "a list holding a string"])
def test_bad_module_argument(rank: int, world_size: int, module: Any) -> None:
    model = build()
    before = _snapshot(model)
    arg, index = (42, 0) if module == 42 else ([model, "x"], 1)
    with pytest.raises(
        TypeError, match=rf"module\[{index}\]=.* is a (int|str), not an nn.Module; pass an nn.Module"
    ):
        fully_shard(arg)
    _untouched(model, before)


@pytest.mark.distributed(world_size=2)
def test_ignored_param_already_sharded_by_a_nested_unit(rank: int, world_size: int) -> None:
    model = build()
    weight = model.blocks[0].up.weight
    fully_shard(model.blocks[0])
    before = _snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"is 'up.weight' \(shape \(13, 6\)\), which an earlier fully_shard call on a submodule "
        r"already took and sharded on dim 0; pass it in ignored_params of that call",
    ):
        fully_shard(model, ignored_params=[weight])
    assert not isinstance(model, HSDPModule) and get_state(model) is None
    assert _snapshot(model) == before


@pytest.mark.distributed(world_size=2)
def test_good_param_sets_still_work(rank: int, world_size: int) -> None:
    """The checks accept what they should: a generator, a set, parameters of nested plain modules."""
    model = build()
    fully_shard(
        model,
        ignored_params=(p for p in model.norm.parameters()),
        replicate_params={model.blocks[0].norm1.weight},
    )
    assert not isinstance(model.norm.weight, DTensor)
    assert model.blocks[0].norm1.weight.placements == (Replicate(),)


# -- HSDPModule methods: flags unchanged ---------------------------------------------------------


def _flags(model: nn.Module) -> list[tuple[Any, ...]]:
    out = []
    for m in model.modules():
        state = get_state(m)
        if state is not None and state.group is not None:
            g = state.group
            out.append(
                (
                    g.requires_gradient_sync,
                    g.requires_all_reduce,
                    g.reshard_after_forward,
                    g.reshard_after_backward,
                    g.gradient_divide_factor,
                    g.reduce_op_type,
                    state.reshard_after_forward,
                    state.forward_prefetch,
                    state.backward_prefetch,
                )
            )
    return out


def _sharded() -> Any:
    model = build()
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


SETTER_CASES: list[tuple[str, Callable[[Any], Any], type[Exception], str]] = [
    (
        "unshard async_op a string",
        lambda m: m.unshard(async_op="yes"),
        TypeError,
        r"unshard: async_op='yes' is a str, not a bool; pass True or False",
    ),
    (
        "set_requires_gradient_sync a string",
        lambda m: m.set_requires_gradient_sync("no"),
        TypeError,
        r"requires_gradient_sync='no' is a str, not a bool; pass True or False",
    ),
    (
        "set_requires_gradient_sync recurse None",
        lambda m: m.set_requires_gradient_sync(False, recurse=None),
        TypeError,
        r"set_requires_gradient_sync: recurse=None is a NoneType, not a bool",
    ),
    (
        "set_requires_all_reduce an int",
        lambda m: m.set_requires_all_reduce(0),
        TypeError,
        r"set_requires_all_reduce: requires_all_reduce=0 is a int, not a bool",
    ),
    (
        "set_reshard_after_forward a float",
        lambda m: m.set_reshard_after_forward(1.0),
        TypeError,
        r"set_reshard_after_forward: reshard_after_forward=1.0 is a float; pass True, False, None",
    ),
    (
        "set_reshard_after_backward None",
        lambda m: m.set_reshard_after_backward(None),
        TypeError,
        r"reshard_after_backward=None is a NoneType, not a bool; pass True or False",
    ),
    (
        "set_modules_to_forward_prefetch a module, not a list",
        lambda m: m.set_modules_to_forward_prefetch(m.blocks[0]),
        TypeError,
        r"modules is a HSDPBlock, not a list; pass a list of fully_shard-ed modules, e.g. \[HSDPBlock\]",
    ),
    (
        "set_modules_to_backward_prefetch a plain module",
        lambda m: m.set_modules_to_backward_prefetch([m.blocks[0], nn.Linear(1, 1)]),
        ValueError,
        r"modules\[1\] \(Linear\) was not passed to fully_shard.*Call fully_shard on it first",
    ),
    (
        "set_gradient_divide_factor zero",
        lambda m: m.set_gradient_divide_factor(0),
        ValueError,
        r"factor=0 is not a finite positive number; pass the number the summed gradients are divided by",
    ),
    (
        "set_gradient_divide_factor nan",
        lambda m: m.set_gradient_divide_factor(float("nan")),
        ValueError,
        r"factor=nan is not a finite positive number",
    ),
    (
        "set_gradient_divide_factor a bool",
        lambda m: m.set_gradient_divide_factor(True),
        ValueError,
        r"factor=True is not a finite positive number",
    ),
    (
        "set_reduce_op_type mean",
        lambda m: m.set_reduce_op_type("mean"),
        ValueError,
        r"reduce_op_type='mean'; pass 'avg' \(the mean over the data-parallel ranks\) or 'sum'",
    ),
]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", [c[0] for c in SETTER_CASES])
def test_bad_method_arguments(rank: int, world_size: int, name: str) -> None:
    call, kind, message = _case(SETTER_CASES, name)
    model = _sharded()
    flags = _flags(model)
    with record_collectives() as log:
        with pytest.raises(kind, match=message):
            call(model)
    assert _flags(model) == flags
    assert len(log) == 0, "a rejected call communicates nothing"
    assert all(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.distributed(world_size=2)
def test_prefetch_of_another_roots_unit(rank: int, world_size: int) -> None:
    """Refused at the root's first forward (every rank, before any gather), or at once once it ran."""
    model, other = _sharded(), _sharded()
    model.set_modules_to_forward_prefetch([other.blocks[0]])  # the root is not known yet: accepted for now
    tokens = torch.randint(0, 13, (2, 4))
    with record_collectives() as log:
        with pytest.raises(
            ValueError, match=r"prefetches HSDPBlock, a unit outside the root HSDPTransformer"
        ):
            model(tokens)
    assert log.count("all_gather_into_tensor") == 0
    assert get_state(model).context is None  # the lazy init did not commit
    model.set_modules_to_forward_prefetch([model.blocks[0]])
    model(tokens)  # the root is known now
    flags = _flags(model)
    with pytest.raises(ValueError, match=r"modules\[0\] \(HSDPBlock\) is a unit of another root than"):
        model.set_modules_to_backward_prefetch([other.blocks[1]])
    assert _flags(model) == flags


# -- state dicts: checked before any parameter is copied ---------------------------------------

STATE_DICT_CASES: list[tuple[str, Callable[[dict[str, Any]], Any], dict[str, Any], str]] = [
    (
        "a wrong shape",
        lambda sd: sd.update({"head.weight": torch.zeros(14, 6, dtype=torch.float64)}),
        {},
        r"'head.weight' has shape \(14, 6\), the model's is \(13, 6\)",
    ),
    (
        "an integer tensor for a float parameter",
        lambda sd: sd.update({"head.bias": torch.ones(13, dtype=torch.int64)}),
        {},
        r"'head.bias' is int64, the model's is float64 \(integer into floating-point\)",
    ),
    (
        "a list instead of a tensor",
        lambda sd: sd.update({"norm.weight": [1.0] * 6}),
        {"strict": False},
        r"'norm.weight' is a list, not a tensor",
    ),
]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", [c[0] for c in STATE_DICT_CASES])
def test_bad_state_dict(rank: int, world_size: int, name: str) -> None:
    spoil, kwargs, message = _case(STATE_DICT_CASES, name)
    model = _sharded()
    donor = build(seed=7)  # other values everywhere: a half-applied load would show
    state_dict = dict(donor.state_dict())
    spoil(state_dict)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=message + r".*Nothing of it was loaded"):
        model.load_state_dict(state_dict, **kwargs)
    for key, value in model.state_dict().items():
        assert torch.equal(value.to_local(), before[key]), key
    model.load_state_dict(donor.state_dict())  # the donor's own state dict loads
    assert torch.equal(model.emb.weight.full_tensor(), donor.emb.weight)


@pytest.mark.distributed(world_size=2)
def test_missing_and_unexpected_keys_follow_nn_module(rank: int, world_size: int) -> None:
    """As FSDP2: nn.Module names them (strict=True raises, strict=False loads the rest and lists them)."""
    model = _sharded()
    donor = build(seed=7)
    state_dict = dict(donor.state_dict())
    state_dict.pop("emb.weight")
    state_dict["nope"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\).*emb\.weight.*Unexpected key\(s\).*nope"):
        model.load_state_dict(state_dict)
    result = model.load_state_dict(state_dict, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["emb.weight"], ["nope"])
    torch.testing.assert_close(model.head.weight.full_tensor(), donor.head.weight)


@pytest.mark.distributed(world_size=2)
def test_state_dict_of_another_precision_loads(rank: int, world_size: int) -> None:
    """Floating point into floating point is a cast, as in nn.Module (fp32 checkpoint, fp64 model)."""
    model = _sharded()
    donor = build(seed=7, dtype=torch.float32)
    model.load_state_dict(donor.state_dict())
    assert model.head.weight.dtype == torch.float64
    torch.testing.assert_close(model.head.weight.full_tensor(), donor.head.weight.double())


# -- cross-rank agreement: every rank raises at the first communication ------------------------


def _count_object_gathers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The agreement's exchanges ([Note: cross-rank agreement] in hp_core.agreement) in order:

    "digest" for each all_gather of its int64 digest (the units' own gathers move
    floating-point data), "facts" for each all_gather_object on a mismatch.
    """
    calls: list[str] = []
    gather, gather_object = dist.all_gather, dist.all_gather_object

    def counted(parts: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.dtype == torch.int64:
            calls.append("digest")
        return gather(parts, tensor, *args, **kwargs)

    def counted_object(*args: Any, **kwargs: Any) -> Any:
        calls.append("facts")
        return gather_object(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather", counted)
    monkeypatch.setattr(dist, "all_gather_object", counted_object)
    return calls


CROSS_RANK_CASES: list[tuple[str, Callable[[nn.Module, int], tuple[dict[str, Any], dict[str, Any]]], str]] = [
    (
        "reshard_after_forward",
        lambda m, r: ({"reshard_after_forward": r == 0}, {}),
        r"unit '<root>': reshard_after_forward differs: True on rank 0; False on rank 1",
    ),
    (
        "mp_policy",
        lambda m, r: ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32 if r == 0 else None)}, {}),
        r"unit '<root>': mp_policy.param_dtype differs: torch.float32 on rank 0; None on rank 1",
    ),
    (
        "comm_fusion",
        lambda m, r: ({"comm_fusion": r == 1}, {}),
        r"comm_fusion differs: False on rank 0; True on rank 1",
    ),
    (
        "shard_placement_fn",
        lambda m, r: ({"shard_placement_fn": (lambda p: Shard(p.dim() - 1)) if r else None}, {}),
        r"unit '<root>': parameter 'emb.weight' \(shape, dtype, placement, grad\) differs: "
        r"\(\(13, 6\), 'float64', 'Shard\(0\)', 'requires_grad'\) on rank 0; "
        r"\(\(13, 6\), 'float64', 'Shard\(1\)', 'requires_grad'\) on rank 1",
    ),
    (
        "parameter shape that pads alike",
        lambda m, r: ({}, {}),  # the model itself differs: see _rank_model
        r"unit '<root>': parameter 'emb.weight' .* differs: "
        r"\(\(13, 6\),.* on rank 0; \(\(14, 6\),.* on rank 1",
    ),
    (
        "ignored_params on one rank",
        lambda m, r: ({}, {"ignored_params": [m.norm.weight] if r == 0 else None}),
        r"unit '<root>': its parameters differ: \['emb.weight', 'norm.bias', .*\] on rank 0; "
        r"\['emb.weight', 'norm.weight', 'norm.bias', .*\] on rank 1",
    ),
    (
        "blocks wrapped on one rank only",
        lambda m, r: ({}, {}),  # see _rank_model
        r"the units \(fully_shard calls\) under this root differ: "
        r"\['<root>', 'blocks.0', 'blocks.1'\] on rank 0; "
        r"\['<root>'\] on rank 1",
    ),
]


def _rank_model(name: str, rank: int) -> nn.Module:
    model = build()
    if name == "parameter shape that pads alike" and rank == 1:
        model.emb = nn.Embedding(14, 6).double()  # 13 and 14 rows both pad to 7 per rank: silent before
    return model


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", [c[0] for c in CROSS_RANK_CASES])
def test_arguments_that_differ_across_ranks(
    rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    arguments, message = _case(CROSS_RANK_CASES, name)
    model = _rank_model(name, rank)
    block_kwargs, root_kwargs = arguments(model, rank)
    if not (name == "blocks wrapped on one rank only" and rank == 1):
        for block in model.blocks:
            fully_shard(block, **block_kwargs)
    fully_shard(model, **block_kwargs, **root_kwargs)
    gathers = _count_object_gathers(monkeypatch)
    with record_collectives() as log:
        with pytest.raises(
            ValueError, match=r"the ranks called fully_shard differently.*" + f"(?:{message})"
        ):
            model(torch.randint(0, 13, (2, 4)))
    assert len(log) == 0, "no unit gathered"
    assert gathers == ["digest", "facts"], "one digest exchange, then the facts"
    states = [get_state(m) for m in model.modules() if get_state(m) is not None]
    assert all(s.context is None and s.is_root is None for s in states), "the lazy init did not commit"
    assert not any(s.group is not None and s.group.is_unsharded for s in states), "nothing gathered"
    # the same message on every rank: the fix is named too
    with pytest.raises(ValueError, match=r"Call fully_shard on every rank with the same module structure"):
        model(torch.randint(0, 13, (2, 4)))


@pytest.mark.distributed(world_size=4)
def test_hsdp_difference_on_one_rank_is_seen_by_all(
    rank: int, world_size: int, device_mesh_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 3 differs from its row and its column; ranks 0, 1 and 2 must raise too (no rank gathers)."""
    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    model = build()
    fully_shard(model, mesh=mesh, reshard_after_forward=rank == 3)
    gathers = _count_object_gathers(monkeypatch)
    with record_collectives() as log:
        with pytest.raises(
            ValueError, match=r"reshard_after_forward differs: False on ranks \[0, 1, 2\]; True on rank 3"
        ):
            model(torch.randint(0, 13, (2, 4)))
    assert len(log) == 0
    assert gathers == ["digest"] * 2 + ["facts"] * 2, "digests over shard then replicate dim, then the facts"


@pytest.mark.distributed(world_size=2)
def test_unshard_before_forward_checks_agreement(rank: int, world_size: int) -> None:
    """A pipeline schedule unshards before any forward: the check runs there, before the gather."""
    model = build()
    fully_shard(model, comm_fusion=rank == 0)
    with record_collectives() as log:
        with pytest.raises(ValueError, match=r"comm_fusion differs: True on rank 0; False on rank 1"):
            model.unshard()
    assert len(log) == 0


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("mesh_shape", [(2,), (1, 2)], ids=["fsdp", "hsdp"])
def test_agreement_costs_one_exchange_per_mesh_dim_once(
    rank: int,
    world_size: int,
    device_mesh_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    mesh_shape: tuple[int, ...],
) -> None:
    """When the ranks agree: one digest exchange per mesh dim at the first forward, none after."""
    mesh = device_mesh_factory(mesh_shape)
    model = build()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gathers = _count_object_gathers(monkeypatch)
    tokens = torch.randint(0, 13, (2, 4))
    model(tokens).sum().backward()
    assert gathers == ["digest"] * len(mesh_shape)
    model(tokens).sum().backward()
    model.unshard()
    model.reshard()
    assert gathers == ["digest"] * len(mesh_shape), "checked once"


def test_messages_name_the_fix_without_a_process_group() -> None:
    """The policy messages are complete sentences: observed value, then what to pass."""
    with pytest.raises(TypeError) as info:
        MixedPrecisionPolicy(param_dtype="bf16")  # type: ignore[arg-type]
    text = str(info.value)
    assert re.search(r"param_dtype='bf16'.*pass a floating-point torch.dtype such as torch.bfloat16", text)

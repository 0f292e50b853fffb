"""Every bad call to hp_dtensor's public API is a clear error, on every rank, that changes nothing.

Each distributed case is one bad call on 2 ranks. The test checks that the
message names the observed value and the fix, that every rank raised the
same kind of error (gathered afterwards, which also proves no rank is left in
a collective), and that nothing changed: the module handed in keeps its plain
parameters and has no hooks, the tensor handed in is untouched. The cases
whose arguments differ between ranks used to corrupt data (a longer tensor
broadcast into a shorter one), abort the process (a dtype mismatch) or hang
(a plan applied on one rank only); [Note: cross-rank agreement] in
``hp_core.agreement`` catches them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hp_core
import pytest
import torch
from hp_core import DeviceMesh, init_device_mesh
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Partial,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    distribute_module,
    distribute_tensor,
    from_torch_dtensor,
    parallelize_module,
    to_torch_dtensor,
)
from torch import nn
from torch.distributed.tensor._ops._embedding_ops import _MaskPartial


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


@dataclass
class Ctx:
    """What a case may use: this rank, a 1-D and a 2-D mesh, a fresh model and a tensor."""

    rank: int
    mesh: DeviceMesh
    mesh2: DeviceMesh
    model: MLP
    tensor: torch.Tensor


@dataclass(frozen=True)
class Bad:
    """One bad call: ``call(ctx)`` must raise ``error`` naming ``observed`` and ``fix``."""

    name: str
    call: Callable[[Ctx], Any]
    error: type[BaseException]
    observed: str  # regex: the value the caller passed
    fix: str  # regex: what to do instead


def _partition_fails_half_way(c: Ctx) -> None:
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name == "up":  # shard one layer, then fail on the next
            module.register_parameter(
                "weight", nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(0)]))
            )
        if name == "down":
            raise RuntimeError("partition_fn failed on 'down'")

    distribute_module(c.model, c.mesh, partition)


def _torch(c: Ctx) -> torch.Tensor:
    return to_torch_dtensor(distribute_tensor(c.tensor, c.mesh, [Shard(0)]))


S0, R = Shard(0), Replicate()
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}

CASES = [
    # -- distribute_tensor
    Bad(
        "distribute a list",
        lambda c: distribute_tensor([1.0, 2.0], c.mesh, [S0]),
        TypeError,
        r"list \[1\.0, 2\.0\]",
        r"torch\.as_tensor",
    ),
    Bad(
        "distribute a DTensor",
        lambda c: distribute_tensor(distribute_tensor(c.tensor, c.mesh, [S0]), c.mesh, [R]),
        TypeError,
        r"already a DTensor",
        r"\.redistribute\(placements=",
    ),
    Bad(
        "Shard dim out of range",
        lambda c: distribute_tensor(c.tensor, c.mesh, [Shard(2)]),
        ValueError,
        r"Shard\(2\) is out of range for a 1-D tensor",
        r"dim in \[-1, 0\]",
    ),
    Bad(
        "placements count vs mesh ndim",
        lambda c: distribute_tensor(c.tensor, c.mesh, [S0, R]),
        ValueError,
        r"2 placement\(s\).*1-D mesh",
        r"one placement per mesh dim",
    ),
    Bad(
        "a torch.distributed collective on a DTensor",
        lambda c: torch.distributed.all_reduce(distribute_tensor(c.tensor, c.mesh, [S0])),
        TypeError,
        r"c10d\.allreduce_\.default was called on an hp_dtensor\.DTensor",
        r"dtensor\.to_local\(\).*dtensor\.full_tensor\(\)",
    ),
    Bad(
        "torch's placement",
        lambda c: distribute_tensor(c.tensor, c.mesh, [_MaskPartial()]),
        TypeError,
        r"torch\.distributed\.tensor\.placement_types\._MaskPartial, which has no hp_dtensor equivalent",
        r"takes Shard\(d\), Replicate\(\) and Partial",
    ),
    Bad(
        "a single placement",
        lambda c: distribute_tensor(c.tensor, c.mesh, S0),
        TypeError,
        r"single placement Shard\(dim=0\)",
        r"wrap it: \[Shard\(dim=0\)\]",
    ),
    Bad(
        "placement a str",
        lambda c: distribute_tensor(c.tensor, c.mesh, ["S0"]),
        TypeError,
        r"'S0'",
        r"Shard\(d\), Replicate\(\) or Partial\(op\)",
    ),
    Bad(
        "src_data_rank outside",
        lambda c: distribute_tensor(c.tensor, c.mesh, [R], src_data_rank=5),
        ValueError,
        r"src_data_rank=5",
        r"\[0, 2\) or None",
    ),
    Bad(
        "src_data_rank a str",
        lambda c: distribute_tensor(c.tensor, c.mesh, [R], src_data_rank="0"),
        TypeError,
        r"str '0'",
        r"src_data_rank=0",
    ),
    Bad(
        "src_data_rank a bool",
        lambda c: distribute_tensor(c.tensor, c.mesh, [R], src_data_rank=True),
        TypeError,
        r"bool True",
        r"src_data_rank=0",
    ),
    Bad(
        "mesh a str",
        lambda c: distribute_tensor(c.tensor, "tp", [R]),
        TypeError,
        r"got builtins\.str",
        r"init_device_mesh",
    ),
    Bad(
        "tensor shape differs across ranks",
        lambda c: distribute_tensor(torch.ones(4 + c.rank), c.mesh, [S0]),
        ValueError,
        r"\(0,\): tensor=\('Tensor', \(4,\).*\(1,\): tensor=\('Tensor', \(5,\)",
        r"same shape, dtype",
    ),
    Bad(
        "tensor dtype differs across ranks",
        lambda c: distribute_tensor(
            torch.ones(4, dtype=torch.float64 if c.rank else torch.float32), c.mesh, [S0]
        ),
        ValueError,
        r"torch\.float32.*torch\.float64",
        r"same shape, dtype",
    ),
    Bad(
        "placements differ across ranks",
        lambda c: distribute_tensor(c.tensor, c.mesh, [S0 if c.rank else R]),
        ValueError,
        r"\(0,\): placements=\('Replicate\(\)',\); mesh coordinate \(1,\): placements=\('Shard\(dim=0\)',\)",
        r"the same placements",
    ),
    Bad(
        "bad placement on one rank only",
        lambda c: distribute_tensor(c.tensor, c.mesh, [Shard(3) if c.rank else S0]),
        ValueError,
        r"Shard\(dim=3\)",
        r"the same placements",
    ),
    # -- DTensor.from_local
    Bad(
        "from_local of a list",
        lambda c: DTensor.from_local([1.0], c.mesh, [S0]),
        TypeError,
        r"got list",
        r"torch\.as_tensor",
    ),
    Bad(
        "from_local shape a str",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, [S0], shape="ab"),
        TypeError,
        r"str 'ab'",
        r"e\.g\. shape=\(2,\)",
    ),
    Bad(
        "from_local negative shape",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, [R], shape=(-2,)),
        ValueError,
        r"shape=\(-2,\)",
        r"non-negative ints",
    ),
    Bad(
        "from_local shape ndim",
        lambda c: DTensor.from_local(torch.ones(2, 2), c.mesh, [S0], shape=(4,)),
        ValueError,
        r"shape=\(4,\) has 1 dims but the local tensor has 2",
        r"same number of dims",
    ),
    Bad(
        "from_local shape vs local sizes",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, [S0], shape=(5,)),
        ValueError,
        r"\{\(0,\): \(2,\), \(1,\): \(2,\)\} add up to \(4,\), not shape=\(5,\)",
        r"true global shape",
    ),
    Bad(
        "from_local unsharded dim vs shape",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, [R], shape=(3,)),
        ValueError,
        r"local size 2 must equal shape\[0\]=3",
        r"fix shape= or the placements",
    ),
    Bad(
        "from_local run_check not a bool",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, [S0], run_check="yes"),
        TypeError,
        r"str 'yes'",
        r"True or False",
    ),
    Bad(
        "run_check: local shapes disagree",
        lambda c: DTensor.from_local(torch.ones(2, 2 + c.rank), c.mesh, [S0], run_check=True),
        ValueError,
        r"\{\(0,\): \(2, 2\), \(1,\): \(2, 3\)\}",
        r"Fix the local tensors or the placements",
    ),
    Bad(
        "run_check: dtypes disagree",
        lambda c: DTensor.from_local(
            torch.ones(2, dtype=torch.float64 if c.rank else torch.float32), c.mesh, [S0], run_check=True
        ),
        ValueError,
        r"torch\.float32.*torch\.float64",
        r"one dtype",
    ),
    Bad(
        "run_check: placements disagree",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, [S0 if c.rank else R], run_check=True),
        ValueError,
        r"placements=\('Replicate\(\)',\).*placements=\('Shard\(dim=0\)',\)",
        r"the same placements",
    ),
    Bad(
        "shape=: shape argument disagrees",
        lambda c: DTensor.from_local(torch.ones(2), c.mesh, [S0], shape=(4 + c.rank,)),
        ValueError,
        r"shape=\(4,\).*shape=\(5,\)",
        r"the same shape=",
    ),
    # -- redistribute
    Bad(
        "redistribute to another mesh",
        lambda c: distribute_tensor(c.tensor, c.mesh, [S0]).redistribute(c.mesh2, [R, R]),
        ValueError,
        r"mesh_dim_names=\('dp', 'tp'\)\) differs from the tensor's mesh",
        r"full_tensor\(\) and distribute_tensor\(\)",
    ),
    Bad(
        "redistribute Shard out of range",
        lambda c: distribute_tensor(c.tensor, c.mesh, [S0]).redistribute(placements=[Shard(3)]),
        ValueError,
        r"Shard\(3\)",
        r"dim in \[-1, 0\]",
    ),
    Bad(
        "redistribute without placements",
        lambda c: distribute_tensor(c.tensor, c.mesh, [S0]).redistribute(),
        ValueError,
        r"pass placements=",
        r"\[Replicate\(\)\] \* 1",
    ),
    Bad(
        "redistribute mesh a str",
        lambda c: distribute_tensor(c.tensor, c.mesh, [S0]).redistribute("tp", [R]),
        TypeError,
        r"builtins\.str",
        r"init_device_mesh",
    ),
    # -- parallelize_module
    Bad(
        "plan key matches nothing",
        lambda c: parallelize_module(c.model, c.mesh, {"up": ColwiseParallel(), "nope": RowwiseParallel()}),
        KeyError,
        r"\['nope'\] match no submodule",
        r"the module has \['up', 'norm', 'down'\]",
    ),
    Bad(
        "Colwise on a LayerNorm",
        lambda c: parallelize_module(c.model, c.mesh, {"up": ColwiseParallel(), "norm": ColwiseParallel()}),
        TypeError,
        r"'norm'.* is a LayerNorm",
        r"SequenceParallel\(\) for norms",
    ),
    Bad(
        "Rowwise on the whole model",
        lambda c: parallelize_module(c.model, c.mesh, RowwiseParallel()),
        TypeError,
        r"the module is a MLP",
        r"Linear or Embedding itself",
    ),
    Bad(
        "plan value a str",
        lambda c: parallelize_module(c.model, c.mesh, {"up": "colwise"}),
        TypeError,
        r"plan\['up'\] is str 'colwise'",
        r"ColwiseParallel\(\), RowwiseParallel\(\)",
    ),
    Bad(
        "plan a list",
        lambda c: parallelize_module(c.model, c.mesh, ["up"]),
        TypeError,
        r"got list \['up'\]",
        r"\{'up': ColwiseParallel\(\)",
    ),
    Bad(
        "plan key an int",
        lambda c: parallelize_module(c.model, c.mesh, {1: ColwiseParallel()}),
        TypeError,
        r"plan key 1 is a int",
        r"dotted submodule names",
    ),
    Bad(
        "two keys, one submodule",
        lambda c: parallelize_module(c.model, c.mesh, {"up": ColwiseParallel(), "u*": ColwiseParallel()}),
        ValueError,
        r"'up' is matched by plan keys 'up' and 'u\*'",
        r"disjoint submodules",
    ),
    Bad(
        "2-D mesh",
        lambda c: parallelize_module(c.model, c.mesh2, PLAN),
        ValueError,
        r"2-D mesh \(1, 2\)",
        r"mesh\['tp'\]",
    ),
    Bad(
        "parallelize mesh a str",
        lambda c: parallelize_module(c.model, "tp", PLAN),
        TypeError,
        r"builtins\.str",
        r"init_device_mesh",
    ),
    Bad(
        "module a str",
        lambda c: parallelize_module("model", c.mesh, PLAN),
        TypeError,
        r"str 'model'",
        r"torch\.nn\.Module",
    ),
    Bad(
        "plans differ across ranks",
        lambda c: parallelize_module(c.model, c.mesh, PLAN if c.rank == 0 else {"up": ColwiseParallel()}),
        ValueError,
        r"\(0,\): parallelize_plan=.*'down'.*\(1,\): parallelize_plan=",
        r"same plan on every rank",
    ),
    Bad(
        "models differ across ranks",
        lambda c: parallelize_module(
            c.model if c.rank == 0 else nn.Sequential(nn.Linear(4, 4)), c.mesh, ColwiseParallel()
        ),
        ValueError,
        r"different module",
        r"same module",
    ),
    # -- distribute_module
    Bad(
        "distribute_module of a str",
        lambda c: distribute_module("model", c.mesh),
        TypeError,
        r"str 'model'",
        r"torch\.nn\.Module",
    ),
    Bad(
        "partition_fn not callable",
        lambda c: distribute_module(c.model, c.mesh, partition_fn=3),
        TypeError,
        r"int 3",
        r"callable or None",
    ),
    Bad(
        "input_fn not callable",
        lambda c: distribute_module(c.model, c.mesh, input_fn="x"),
        TypeError,
        r"str 'x'",
        r"callable or None",
    ),
    Bad(
        "partition_fn raises half-way",
        _partition_fails_half_way,
        RuntimeError,
        r"partition_fn failed on 'down'",
        r".",
    ),
    Bad(
        "modules differ across ranks",
        lambda c: distribute_module(c.model if c.rank == 0 else nn.Linear(2, 2), c.mesh),
        ValueError,
        r"different parameters and buffers",
        r"same module on every rank",
    ),
    # -- interop
    Bad(
        "to_torch_dtensor of a tensor",
        lambda c: to_torch_dtensor(c.tensor),
        TypeError,
        r"got Tensor",
        r"distribute_tensor\(\.\.\.\)",
    ),
    Bad(
        "from_torch_dtensor of a tensor",
        lambda c: from_torch_dtensor(c.tensor),
        TypeError,
        r"got Tensor",
        r"torch\.distributed\.tensor\.distribute_tensor",
    ),
    Bad(
        "from_torch_dtensor mesh a str",
        lambda c: from_torch_dtensor(_torch(c), device_mesh="tp"),
        TypeError,
        r"builtins\.str",
        r"init_device_mesh",
    ),
    Bad(
        "from_torch_dtensor mesh shape",
        lambda c: from_torch_dtensor(_torch(c), device_mesh=c.mesh2),
        ValueError,
        r"\(1, 2\) but the tensor's torch mesh has \(2,\)",
        r"matching mesh",
    ),
]
BY_NAME = {case.name: case for case in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


def _state(model: nn.Module) -> list[Any]:
    """Everything a failing call must leave alone: parameter and buffer types and shapes, and hooks."""
    entries: list[Any] = [(k, type(v).__name__, tuple(v.shape)) for k, v in model.state_dict().items()]
    entries += [(name, type(p).__name__) for name, p in model.named_parameters()]
    entries += [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    return entries


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(BY_NAME))  # by name: the ranks receive picklable parameters
def test_bad_call_is_a_clear_error_on_every_rank(rank: int, world_size: int, name: str) -> None:
    case = BY_NAME[name]
    torch.manual_seed(0)
    ctx = Ctx(
        rank,
        init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
        init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")),
        MLP(),
        torch.arange(4.0),
    )
    before = _state(ctx.model)
    weights = [p.detach().clone() for p in ctx.model.parameters()]
    with pytest.raises(case.error) as caught:
        case.call(ctx)
    message = str(caught.value)
    assert re.search(case.observed, message), f"the observed value is not named: {message}"
    assert re.search(case.fix, message), f"the fix is not named: {message}"
    # Nothing changed: no plan is half-applied, no parameter replaced, the tensor is untouched.
    assert _state(ctx.model) == before
    assert all(torch.equal(p, w) for p, w in zip(ctx.model.parameters(), weights, strict=True))
    assert torch.equal(ctx.tensor, torch.arange(4.0))
    # Every rank raised the same kind of error, and none is stuck in a collective.
    assert hp_core.all_gather_object(type(caught.value).__name__) == [case.error.__name__] * world_size


# -- single process: what is checked where the object is built ------------------------------------

LOCAL = [
    Bad("Shard(float)", lambda c: Shard(1.5), TypeError, r"float 1\.5", r"e\.g\. Shard\(0\) or Shard\(-1\)"),
    Bad("Shard(str)", lambda c: Shard("0"), TypeError, r"str '0'", r"e\.g\. Shard\(0\)"),
    Bad(
        "Partial('mean')",
        lambda c: Partial("mean"),
        ValueError,
        r"'mean'",
        r"one of \['sum', 'avg', 'max', 'min', 'product', 'norm'\]",
    ),
    Bad("Partial(int)", lambda c: Partial(5), TypeError, r"reduce_op=5", r"Partial\('sum'\)"),
    Bad(
        "Colwise input_layouts a str",
        lambda c: ColwiseParallel(input_layouts="replicate"),
        TypeError,
        r"input_layouts='replicate'",
        r"Replicate\(\), Shard\(-1\)",
    ),
    Bad(
        "Colwise output_layouts a list",
        lambda c: ColwiseParallel(output_layouts=[Shard(-1)]),
        TypeError,
        r"\[Shard\(dim=-1\)\]",
        r"not a sequence",
    ),
    Bad(
        "Colwise use_local_output a str",
        lambda c: ColwiseParallel(use_local_output="no"),
        TypeError,
        r"'no'",
        r"True or False",
    ),
    Bad(
        "Rowwise input_layouts a str",
        lambda c: RowwiseParallel(input_layouts="shard"),
        TypeError,
        r"'shard'",
        r"one Placement",
    ),
    Bad(
        "SequenceParallel sequence_dim a str",
        lambda c: SequenceParallel(sequence_dim="1"),
        TypeError,
        r"'1'",
        r"sequence_dim=1",
    ),
    Bad(
        "SequenceParallel gather_input_sizes an int",
        lambda c: SequenceParallel(gather_input_sizes=1),
        TypeError,
        r"=1\)",
        r"True or False",
    ),
]


@pytest.mark.parametrize("case", LOCAL, ids=[case.name for case in LOCAL])
def test_bad_value_is_caught_where_it_is_written(case: Bad) -> None:
    with pytest.raises(case.error) as caught:
        case.call(None)  # type: ignore[arg-type]
    message = str(caught.value)
    assert re.search(case.observed, message), f"the observed value is not named: {message}"
    assert re.search(case.fix, message), f"the fix is not named: {message}"


@pytest.mark.distributed(world_size=2)
def test_one_rowwise_style_serves_a_linear_and_an_embedding(rank: int, world_size: int) -> None:
    # A style object is not changed by applying it: the embedding's replicated input used to be
    # written into the shared style, and a Linear applied later got the embedding's layouts.
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    style = RowwiseParallel()
    model = nn.ModuleDict({"emb": nn.Embedding(6, 4), "lin": nn.Linear(4, 2)})
    parallelize_module(model, mesh, {"emb": style, "lin": style})
    assert (style.input_layouts, style.desired_input_layouts) == (Shard(-1), Shard(-1))
    ids = torch.tensor([[0, 5, 2]])
    x = torch.randn(1, 3, 4).chunk(2, dim=-1)[rank]
    assert model["emb"](ids).shape == (1, 3, 4) and model["lin"](x).shape == (1, 3, 2)


@pytest.mark.distributed(world_size=2)
def test_good_calls_pass_the_checks(rank: int, world_size: int) -> None:
    # Values that are fine but look different across processes or are not plain ints must not be
    # taken for bad input: a generator of placements (its repr holds an address), numpy sizes.
    import numpy as np

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = distribute_tensor(torch.arange(4.0), mesh, (p for p in [Shard(0)]))
    assert x.to_local().tolist() == [[0.0, 1.0], [2.0, 3.0]][rank]
    ragged = DTensor.from_local(torch.ones(1 + rank, 2), mesh, [Shard(0)], shape=(np.int64(3), 2))
    assert ragged.shape == (3, 2) and ragged.full_tensor().shape == (3, 2)
    checked = DTensor.from_local(torch.ones(2), mesh, [Replicate()], run_check=True)
    assert checked.shape == (2,)

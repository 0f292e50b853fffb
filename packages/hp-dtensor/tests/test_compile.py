"""``torch.compile(fullgraph=True)`` over tensor-parallel blocks, against a single-process eager copy.

The TP boundaries are opaque calls that AOTAutograd traces through ([Note: TP
boundaries under torch.compile] in ``hp_dtensor/tracing.py``), the op rules run
at trace time, and redistribution issues functional collectives ([Note:
collectives under torch.compile] in ``hp_core/_issue.py``): one graph, no graph
break, and no recompile after the first step. Each case trains a few
steps (SGD): the loss, every gradient and every parameter after the step match the
eager single-process model.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from hp_dtensor import ColwiseParallel, DTensor, RowwiseParallel, SequenceParallel, Shard, parallelize_module
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from tp_models import MLP, Attention, SequenceParallelBlock, TinyLM


def _mlp(mesh: Any) -> tuple[nn.Module, nn.Module, Callable[[int], Any]]:
    ref = MLP()
    model = parallelize_module(copy.deepcopy(ref), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, ref, lambda step: torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _mlp_uneven(mesh: Any) -> tuple[nn.Module, nn.Module, Callable[[int], Any]]:
    """Hidden 7 over 2 ranks (4, 3): the row-wise input's global size comes from its weight."""
    ref = MLP(8, 7)
    model = parallelize_module(copy.deepcopy(ref), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, ref, lambda step: torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _attention(mesh: Any) -> tuple[nn.Module, nn.Module, Callable[[int], Any]]:
    ref = Attention()
    plan = {
        "q": ColwiseParallel(use_local_output=False),
        "k": ColwiseParallel(use_local_output=False),
        "v": ColwiseParallel(use_local_output=False),
        "o": RowwiseParallel(),
    }
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    return model, ref, lambda step: torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(step))


def _sequence_parallel(mesh: Any) -> tuple[nn.Module, nn.Module, Callable[[int], Any]]:
    ref = SequenceParallelBlock()
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),  # local: added to the local residual
        "out_norm": SequenceParallel(use_local_output=True),
    }
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    return model, ref, lambda step: torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(step))


BUILDERS = {
    "mlp": _mlp,
    "mlp_uneven": _mlp_uneven,
    "attention": _attention,
    "sequence_parallel": _sequence_parallel,
}
CASES = [
    ("mlp", "aot_eager"),
    ("mlp", "inductor"),
    ("mlp_uneven", "aot_eager"),
    ("mlp_uneven", "inductor"),
    ("attention", "aot_eager"),
    ("sequence_parallel", "aot_eager"),
]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _check_step(model: nn.Module, ref: nn.Module, step: int) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p, DTensor) and p.grad is not None, name
        _close(p.grad.full_tensor(), r.grad, f"step {step} {name}.grad")


def _train(run: Callable[[int], tuple[torch.Tensor, torch.Tensor]], model: nn.Module, ref: nn.Module) -> None:
    """Four SGD steps; from the second on, any recompilation is an error.

    (SGD, not Adam: Adam's first steps turn rounding-size gradient differences into lr-sized ones.)
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss, ref_loss = run(step)
        _close(loss, ref_loss, f"step {step} loss")
        loss.backward()
        ref_loss.backward()
        _check_step(model, ref, step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            _close(p.full_tensor(), r.detach(), f"step {step} {name} after SGD")


def _one_graph(what: str) -> None:
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], f"{what}: graph breaks {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == 1, f"{what}: {dict(counters['stats'])}"


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize(("block", "backend"), CASES)
def test_tp_block_compiles_fullgraph(rank: int, device_mesh_factory: Any, block: str, backend: str) -> None:
    torch._dynamo.reset()  # the pooled ranks are reused: start from empty caches and counters
    torch._dynamo.utils.counters.clear()
    mesh = device_mesh_factory((2,), ("tp",))
    torch.manual_seed(0)
    model, ref, data = BUILDERS[block](mesh)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    me = mesh.get_local_rank()

    def run(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = data(step)
        if block == "sequence_parallel":  # sequence-sharded in and out
            out = compiled(x.chunk(2, dim=1)[me].contiguous())
            assert not isinstance(out, DTensor) and out.shape == (2, 4, 8), out.shape
            whole = DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()
            return whole.pow(2).mean(), ref(x).pow(2).mean()
        return compiled(x).pow(2).mean(), ref(x).pow(2).mean()

    _train(run, model, ref)
    _one_graph(f"{block} on {backend}")


@pytest.mark.distributed(world_size=2, timeout=300)
def test_vocab_parallel_embedding_and_loss_compile_fullgraph(rank: int, device_mesh_factory: Any) -> None:
    """Row-wise embedding, column-wise head and the vocab-parallel cross-entropy, all in one graph."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mesh = device_mesh_factory((2,), ("tp",))
    torch.manual_seed(0)
    ref = TinyLM()
    plan = {"embed": RowwiseParallel(), "head": ColwiseParallel(use_local_output=False)}
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)

    def loss_of(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(ids).flatten(0, 1), ids.roll(1, 1).flatten())

    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True)

    def run(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(step))
        loss = compiled(model, ids)
        assert isinstance(loss, DTensor), type(loss)
        return loss.full_tensor(), loss_of(ref, ids)

    _train(run, model, ref)
    _one_graph("vocab-parallel embedding and loss")

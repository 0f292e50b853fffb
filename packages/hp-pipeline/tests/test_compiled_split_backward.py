"""Compiled stages under a split backward need no switch from the user ([Note: compiled split backward]).

DualPipeV runs a full ``B`` and, for other micro-batches, an ``I`` (a backward
that keeps the graph) through the same compiled graph. With AOTAutograd's
donated buffers on (torch's default) that is refused, unless the graphs were
compiled, and the ``I`` runs, with them off, which the ``I`` kind arranges
for the compute steps of the runners that run it, and only there. Those steps
also compile under their own cache-key tag, so a donating backward that a full
backward left in inductor's caches is not served to them ([Note: compile
caches under a split backward] in ``hp_pipeline._builtin_kinds``).
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config
from hp_pipeline import MetaStep, MetaStepType, PipelineStage, ScheduleDualPipeV, stages_on_rank
from torch import nn

T = MetaStepType


class Block(nn.Module):
    """``h + fc2(tanh(fc1(h)))``: its compiled backward donates the saved ``fc1`` output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))


def _full_then_retained(block: nn.Module, context: bool = False) -> None:
    """A full backward through the compiled graph, then one that keeps the graph (DualPipeV's B, then I)."""

    def scoped(step: MetaStep) -> Any:
        around = T.BWD_INPUT.spec.around
        assert around is not None
        return around(None, step) if context else contextlib.nullcontext()

    x0, x1 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    with scoped(MetaStep(0, T.FWD, 0)):
        y0 = block(x0)
    y0.sum().backward()
    with scoped(MetaStep(1, T.FWD, 0)):
        y1 = block(x1)
    with scoped(MetaStep(1, T.BWD_INPUT, 0)):
        torch.autograd.grad(y1.sum(), [x1], retain_graph=True)
    y1.sum().backward()


def test_the_input_grad_kind_scopes_donated_buffers_off() -> None:
    assert T.BWD_INPUT.spec.wraps == ("F", "B", "I", "W")
    torch._dynamo.reset()
    block = Block()
    block.compile(backend="aot_eager")
    with pytest.raises(RuntimeError, match="donated buffers"):
        _full_then_retained(block)  # torch's refusal, without the context
    torch._dynamo.reset()
    block = Block()
    block.compile(backend="aot_eager")
    _full_then_retained(block, context=True)
    assert functorch_config.donated_buffer is True, "the switch is scoped, not flipped for the process"
    torch._dynamo.reset()


@pytest.mark.distributed(world_size=2, timeout=240)
def test_dualpipev_with_compiled_stages_matches_eager(rank: int, world_size: int) -> None:
    torch._dynamo.reset()  # pooled ranks are reused
    torch.manual_seed(3)
    blocks = [Block().double() for _ in range(4)]  # fp64: micro-batch sums against one batch, exactly
    reference = nn.Sequential(*copy.deepcopy(blocks))
    mine = stages_on_rank(rank, 2, 2, style="v")
    stages = []
    for s in mine:
        blocks[s].compile(backend="aot_eager")
        stages.append(PipelineStage(blocks[s], s, 4))
    loss_fn = nn.MSELoss(reduction="sum")
    schedule = ScheduleDualPipeV(stages, 4, loss_fn, scale_grads=False)
    assert any(s.type is T.BWD for s in schedule.order[rank]) and any(
        s.type is T.BWD_INPUT for s in schedule.order[rank]
    )
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):
        x, y = (torch.randn(8, 8, generator=gen, dtype=torch.float64) for _ in range(2))
        schedule.step(*((x,) if 0 in mine else ()), target=y if 3 in mine else None)
        loss_fn(reference(x), y).backward()
        assert functorch_config.donated_buffer is True
    for s in mine:
        for ours, ref in zip(blocks[s].parameters(), reference[s].parameters(), strict=True):
            torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


class TanhBlock(nn.Module):
    """``h + tanh(fc(h))``: inductor's donating backward writes into the saved ``tanh`` output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


def test_split_backward_is_not_served_a_cached_donating_backward() -> None:
    """A full backward cached a donating backward of the same graph; ``F``, ``I``, ``W`` must not run it.

    Inductor's FX graph cache does not key a backward by the inputs it may
    donate, so without the tag of [Note: compile caches under a split backward]
    the ``I`` got the cached kernel, which overwrote the saved ``tanh`` output,
    and the ``W`` computed wrong weight gradients, silently (ZB-H1's last stage
    after a 1F1B run had filled the cache).
    """
    torch._dynamo.reset()
    cache = tempfile.mkdtemp(prefix="hp_pipeline_inductor_cache_")  # fresh: nothing cached before this test
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    around = T.BWD_INPUT.spec.around
    assert around is not None
    try:
        with (
            torch._inductor.config.patch(fx_graph_cache=True),
            functorch_config.patch(enable_autograd_cache=True),
        ):
            warm = TanhBlock().double()  # a 1F1B run or a training script: a full backward, donating
            warm.compile()
            warm(torch.randn(2, 8, dtype=torch.float64, requires_grad=True)).sum().backward()
            torch._dynamo.reset()
            block = TanhBlock().double()
            reference = copy.deepcopy(block)
            block.compile()  # inductor
            x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)  # a received activation
            with around(None, MetaStep(0, T.FWD, 1)):
                loss = block(x).square().sum()
            with around(None, MetaStep(0, T.BWD_INPUT, 1)):
                (grad_x,) = torch.autograd.grad(loss, [x], retain_graph=True)
            with around(None, MetaStep(0, T.BWD_WEIGHT, 1)):
                torch.autograd.backward(loss, inputs=list(block.parameters()))
        x_ref = x.detach().requires_grad_(True)
        reference(x_ref).square().sum().backward()
        torch.testing.assert_close(grad_x, x_ref.grad)
        for ours, ref in zip(block.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, ref.grad)
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        shutil.rmtree(cache, ignore_errors=True)
        torch._dynamo.reset()

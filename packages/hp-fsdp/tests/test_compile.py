"""``torch.compile`` of ``fully_shard`` models: per block and whole model, against one eager process.

The hooks run eagerly around the compiled graphs ([Note: hooks under
torch.compile] in ``hp_fsdp/state.py``), so the graphs hold the blocks'
compute on the gathered parameters. Each case trains a few AdamW steps and is
compared with an eager single-process copy (losses, every gradient, every
parameter after the step), then keeps training with dynamo's
``error_on_recompile``: after the first step nothing compiles again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from hp_dtensor import ColwiseParallel, RowwiseParallel, parallelize_module
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import Block, Tol, build, build_tp, parity, ref_copy, shard_blocks

# name: (what is compiled, backend, world size, fully_shard options, activation checkpointing)
CASES: dict[str, tuple[str, str, int, str, bool]] = {
    "blocks-aot_eager": ("blocks", "aot_eager", 2, "", False),
    "whole-aot_eager": ("whole", "aot_eager", 2, "", False),
    "blocks-inductor": ("blocks", "inductor", 2, "", False),
    "whole-inductor": ("whole", "inductor", 2, "", False),
    "blocks-aot_eager-hsdp": ("blocks", "aot_eager", 4, "hsdp", False),
    "blocks-aot_eager-bf16": ("blocks", "aot_eager", 2, "bf16", False),
    "blocks-aot_eager-no-reshard": ("blocks", "aot_eager", 2, "no_reshard", False),
    "blocks-aot_eager-checkpointed": ("blocks", "aot_eager", 2, "", True),
    # FSDP x TP (2-D): column-/row-wise MLP inside each block, the block compiled after fully_shard
    "blocks-aot_eager-tp": ("blocks", "aot_eager", 4, "tp", False),
    "blocks-inductor-tp": ("blocks", "inductor", 4, "tp", False),
}

BF16_TOL = Tol(rtol=5e-2, atol=2e-2, loss_rtol=2e-2, loss_atol=2e-2, param_atol=6e-2)


class CheckpointedBlock(Block):
    """The test block with its whole forward under non-reentrant activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


def _options(kind: str, device_mesh_factory: Any) -> dict[str, Any]:
    from hp_fsdp import MixedPrecisionPolicy

    if kind == "hsdp":
        return {"mesh": device_mesh_factory((2, 2), ("replicate", "shard"))}
    if kind == "bf16":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if kind == "no_reshard":
        return {"reshard_after_forward": False}
    return {}


def _compile(model: nn.Module, what: str, backend: str) -> None:
    if what == "whole":
        model.compile(backend=backend)
    else:
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile(backend=backend)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.distributed(world_size=c[2], timeout=300)) for n, c in CASES.items()],
)
def test_compiled_fully_shard_matches_eager(
    rank: int, world_size: int, device_mesh_factory: Any, name: str
) -> None:
    what, backend, _, kind, checkpointed = CASES[name]
    torch._dynamo.reset()  # the pooled ranks are reused: start from empty caches and counters
    torch._dynamo.utils.counters.clear()
    model = build_tp() if kind == "tp" else build()
    if checkpointed:
        for i, block in enumerate(model.blocks):
            replacement = CheckpointedBlock()
            replacement.load_state_dict(block.state_dict())
            model.blocks[i] = replacement.to(torch.float64)
    tol = None
    if kind == "bf16":
        model = model.float()
        tol = BF16_TOL
    ref = ref_copy(model)
    dp_rank, dp_world = rank, world_size
    if kind == "tp":
        mesh = device_mesh_factory((2, 2), ("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        shard_blocks(model, mesh=mesh["dp"])
        dp_rank, dp_world = mesh.get_local_rank("dp"), 2
    else:
        shard_blocks(model, **_options(kind, device_mesh_factory))
    _compile(model, what, backend)

    parity(model, ref, dp_rank=dp_rank, dp_world=dp_world, steps=1, tol=tol)
    compiled = dict(torch._dynamo.utils.counters["stats"])
    assert compiled.get("unique_graphs", 0) > 0, f"{name}: nothing was compiled: {compiled}"
    # The hooks run around the graphs, not inside them: no graph break, as with torch's fully_shard.
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, f"{name}: graph breaks {breaks}"
    # No recompile after the first step: guards hold no per-step state.
    with torch._dynamo.config.patch(error_on_recompile=True):
        parity(model, ref, dp_rank=dp_rank, dp_world=dp_world, steps=3, tol=tol)
    assert dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs") == compiled.get("unique_graphs")


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_compiled_before_fully_shard(rank: int, world_size: int, how: str) -> None:
    """Compiling first, then sharding (the other common order) trains the same: the hooks stay eager."""
    torch._dynamo.reset()
    model = build()
    ref = ref_copy(model)
    from hp_fsdp import fully_shard

    for i, block in enumerate(model.blocks):
        if how == "module.compile":
            block.compile(backend="aot_eager")
        else:  # an OptimizedModule wrapping the block: fully_shard manages the parameters it shares
            model.blocks[i] = torch.compile(block, backend="aot_eager")
            # the reference gets the same wrapper (names gain "_orig_mod."), run by dynamo's eager backend
            ref.blocks[i] = torch.compile(ref.blocks[i], backend="eager")
        fully_shard(model.blocks[i])
    fully_shard(model)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        parity(model, ref, dp_rank=rank, dp_world=world_size, steps=2)

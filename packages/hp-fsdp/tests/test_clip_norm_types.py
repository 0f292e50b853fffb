"""``clip_grad_norm_`` with ``norm_type=inf`` and ``3`` on fully_shard and FSDP x TP gradients.

Against a single-process copy of the model after one backward: the total
norm, every clipped gradient, and the communication of the clip itself (a
scalar all-reduce per mesh dim, no gather, no fallback).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import ColwiseParallel, RowwiseParallel, distribute_module, fallback_stats, parallelize_module
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build_tp, full, global_batch, loss_fn, ref_copy


def _sharded(layout: str, device_mesh_factory: Any) -> tuple[Any, Any, int]:
    from hp_fsdp import fully_shard

    model = build_tp()
    ref = ref_copy(model)
    if layout == "fsdp":
        mesh = device_mesh_factory((4,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, ref, 4
    mesh = device_mesh_factory((2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # The layers TP leaves whole are replicated over "tp" (as torchtitan does), so every norm
    # of the clip lives on one (dp, tp) mesh.
    distribute_module(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, ref, 2


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_clip_grad_norm_matches_one_process(rank, device_mesh_factory, layout):  # type: ignore[no-untyped-def]
    model, ref, dp = _sharded(layout, device_mesh_factory)
    tokens, targets = global_batch(0, dp)
    dp_rank = rank // (4 // dp)
    per_rank = tokens.shape[0] // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    loss_fn(model, tokens[rows], targets[rows]).backward()
    loss_fn(ref, tokens, targets).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    ref_grads = [r.grad.detach().clone() for r in ref.parameters()]

    for norm_type in (math.inf, 3.0):
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        for r, g in zip(ref.parameters(), ref_grads, strict=True):
            r.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        before = fallback_stats()
        with record_collectives() as log:
            got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type)
        counts = log.counts()
        assert set(counts) == {"all_reduce"}, (norm_type, counts)  # no gather: scalars only
        assert counts["all_reduce"] == (1 if layout == "fsdp" else 2), (norm_type, counts)
        assert log.nbytes("all_reduce") == 8 * counts["all_reduce"]  # one float64 scalar each
        assert fallback_stats() == before
        torch.testing.assert_close(full(got), want, rtol=1e-12, atol=0)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(full(p.grad), r.grad, rtol=1e-10, atol=1e-12, msg=name)

"""Memory per rank: shards and their gradients are 1/W of the model; gathered parameters stay bounded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hp_fsdp.param import FSDPParam
from hp_fsdp.state import get_state

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build, global_batch, loss_fn, shard_blocks


def _padded_bytes(model: Any, world: int) -> int:
    total = 0
    for p in model.parameters():
        rows = p.shape[0]
        total += world * -(-rows // world) * (p.numel() // rows) * p.element_size()
    return total


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("reshard", [True, False])
def test_sharded_and_gathered_memory(rank: int, world_size: int, reshard: bool, monkeypatch: Any) -> None:
    model = build(n_blocks=4)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    padded = _padded_bytes(model, world_size)
    unit_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks]
    unit_bytes.append(full_bytes - sum(unit_bytes))
    shard_blocks(model, reshard_after_forward=reshard)
    params = [p for m in model.modules() if (s := get_state(m)) and s.group for p in s.group.params]

    peak = [0]
    original = FSDPParam.alloc_unsharded

    def tracking(self: FSDPParam, dtype: Any) -> Any:
        out = original(self, dtype)
        live = sum(
            q._unsharded_buffer.untyped_storage().nbytes() for q in params if q._unsharded_buffer is not None
        )
        peak[0] = max(peak[0], live)
        return out

    monkeypatch.setattr(FSDPParam, "alloc_unsharded", tracking)
    tokens, targets = global_batch(0, world_size)
    loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()

    # shards + their gradients: exactly this rank's piece, at most 1/W of the padded model each
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    local_grads = sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters())
    assert local == local_grads <= padded / world_size
    assert local <= full_bytes / world_size + (padded - full_bytes)

    # gathered parameters: ZeRO-3 holds the root plus at most two blocks (current and prefetched);
    # without resharding every unit stays gathered until backward reshards it
    largest_two = sum(sorted(unit_bytes[:-1])[-2:])
    pad_slack = padded - full_bytes
    if reshard:
        assert peak[0] <= unit_bytes[-1] + largest_two + pad_slack, (peak[0], unit_bytes)
        assert peak[0] < full_bytes
    else:
        assert full_bytes <= peak[0] <= padded
    # after backward everything is resharded
    assert all(not p.is_unsharded_allocated() for p in params)

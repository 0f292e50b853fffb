"""Memory per rank: shards and their gradients are 1/W of the model; gathered parameters stay bounded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hp_dtensor import DTensor, local_tensor
from hp_fsdp.collectives import TAG_BITS
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


def _storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = local_tensor(t) if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.distributed(world_size=4)
def test_peak_params_and_grads_per_rank(rank: int, world_size: int, monkeypatch: Any) -> None:
    """Peak of sharded params + grads + gathered params + unreduced grads, by storage accounting.

    Sampled at every point where a unit gathers, reshards or reduces. The bound: this rank's
    1/W of the (padded) parameters and of their gradients, plus the root unit (gathered from
    forward to the end of backward by default) and the largest block, each with its full
    gradient. The unsharded model with its gradients would need 2x the model on every rank.
    """
    from hp_fsdp.param_group import FSDPParamGroup

    model = build(n_blocks=8)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    padded = _padded_bytes(model, world_size)
    block_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    root_bytes = full_bytes - sum(
        sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks
    )
    shard_blocks(model)
    fsdp_params = [p for m in model.modules() if (s := get_state(m)) and s.group for p in s.group.params]

    def live() -> int:
        tensors: list[Any] = []
        for p in fsdp_params:
            tensors += [p.sharded_param, p.sharded_param.grad, p._unsharded_buffer, p._unsharded_view_buffer]
            tensors.append(p.unsharded_param.grad if p.unsharded_param is not None else None)
            tensors.append(p.unsharded_accumulated_grad)
        return _storage_bytes(tensors)

    peak = [0]

    def sampled(name: str) -> None:
        original = getattr(FSDPParamGroup, name)

        def wrapper(self: FSDPParamGroup, *args: Any, **kwargs: Any) -> Any:
            peak[0] = max(peak[0], live())
            out = original(self, *args, **kwargs)
            peak[0] = max(peak[0], live())
            return out

        monkeypatch.setattr(FSDPParamGroup, name, wrapper)

    for name in ("wait_for_unshard", "reshard", "reduce"):
        sampled(name)
    for step in range(2):  # the second step starts with sharded gradients already present
        tokens, targets = global_batch(step, world_size)
        loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
    peak[0] = max(peak[0], live())

    pad = padded - full_bytes
    # each unit's reduce output ends with its trailer: a gradient flag per parameter and the unit's tag
    # ([Note: gradient flags] and [Note: one unit's reduction met another's] in collectives.py)
    groups = {id(s.group): s.group for m in model.modules() if (s := get_state(m)) and s.group}.values()
    elem = fsdp_params[0].sharded_param.element_size()
    flags = sum(len(g.sharded) + TAG_BITS for g in groups) * elem
    bound = 2 * padded // world_size + 2 * (root_bytes + block_bytes) + 2 * pad + flags
    assert peak[0] <= bound, (peak[0], bound)
    assert peak[0] >= padded // world_size + block_bytes  # it did measure a gathered block
    assert peak[0] < full_bytes + flags  # far from the 2x full_bytes of unsharded params + grads
    # after backward: the shards, and their gradients as views of each unit's padded reduce output
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert live() == local + padded // world_size + flags

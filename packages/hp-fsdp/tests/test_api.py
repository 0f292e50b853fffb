"""The HSDPModule control methods: unshard/reshard, prefetch, reduce op and divide factor, main_grad."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor
from hp_fsdp import MixedPrecisionPolicy, UnshardHandle

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import (
    build,
    count_collectives,
    full,
    global_batch,
    loss_fn,
    parity,
    ref_copy,
    shard_blocks,
)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("async_op", [False, True])
def test_unshard_and_reshard(rank: int, world_size: int, async_op: bool) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model)
    block = model.blocks[0]
    handle = block.unshard(async_op=async_op)
    if async_op:
        assert isinstance(handle, UnshardHandle)
        handle.wait()
    else:
        assert handle is None
    assert type(block.up.weight) is torch.nn.Parameter
    torch.testing.assert_close(block.up.weight, ref.blocks[0].up.weight, rtol=0, atol=0)
    block.reshard()
    assert isinstance(block.up.weight, DTensor)


@pytest.mark.distributed(world_size=2)
def test_explicit_prefetch_keeps_counts_and_numbers(rank: int, world_size: int) -> None:
    model = build(n_blocks=3)
    ref = ref_copy(model)
    shard_blocks(model)
    blocks = list(model.blocks)
    for i in range(len(blocks) - 1):
        blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])
        blocks[i + 1].set_modules_to_backward_prefetch([blocks[i]])
    tokens, targets = global_batch(0, world_size)
    with count_collectives() as counter:
        loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
    assert counter.calls == {"all_gather": 4 + 3, "reduce_scatter": 4, "all_reduce": 0}
    model.zero_grad()
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3)


def _grads_after_one_step(model: Any, rank: int, world: int) -> dict[str, torch.Tensor]:
    tokens, targets = global_batch(0, world)
    loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
    return {name: full(p.grad) for name, p in model.named_parameters()}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("how", ["sum", "factor"])
def test_reduce_op_type_and_divide_factor(rank: int, world_size: int, how: str) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model)
    if how == "sum":
        model.set_reduce_op_type("sum")
        scale = float(world_size)  # the sum of the ranks' mean gradients
    else:
        model.set_gradient_divide_factor(4.0)
        scale = world_size / 4.0
    grads = _grads_after_one_step(model, rank, world_size)
    tokens, targets = global_batch(0, world_size)
    loss_fn(ref, tokens, targets).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], scale * p.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.distributed(world_size=2)
def test_fp32_main_grad(rank: int, world_size: int) -> None:
    model = build(dtype=torch.float32)
    ref = ref_copy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, apply_grad_on_fp32_main_grad=True)
    shard_blocks(model, mp_policy=policy)
    tokens, targets = global_batch(0, world_size)
    loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
    loss_fn(ref, tokens, targets).backward()
    for name, p in model.named_parameters():
        assert p.grad is None, name
        assert isinstance(p.main_grad, DTensor) and p.main_grad.dtype == torch.float32, name
        torch.testing.assert_close(
            full(p.main_grad), dict(ref.named_parameters())[name].grad, rtol=5e-2, atol=2e-2
        )


@pytest.mark.distributed(world_size=2)
def test_no_grad_forward_matches_and_leaves_shards(rank: int, world_size: int) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model)
    tokens, _ = global_batch(0, world_size)
    with torch.no_grad():
        out = model(tokens)
    torch.testing.assert_close(out, ref(tokens), rtol=1e-12, atol=1e-12)
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())


@pytest.mark.distributed(world_size=2)
def test_module_to_dtype_after_sharding(rank: int, world_size: int) -> None:
    model = build()
    ref = ref_copy(model).to(torch.float32)
    shard_blocks(model)
    before = {name: id(p) for name, p in model.named_parameters()}
    model.to(torch.float32)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.float32, name
        assert p.to_local().dtype == torch.float32, name
        assert id(p) == before[name], name  # swapped in place: an optimizer built earlier stays valid
    grads = _grads_after_one_step(model, rank, world_size)
    tokens, targets = global_batch(0, world_size)
    loss_fn(ref, tokens, targets).backward()
    for name, p in ref.named_parameters():
        assert grads[name].dtype == torch.float32
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.distributed(world_size=2)
def test_implicit_backward_prefetch(rank: int, world_size: int, monkeypatch: Any) -> None:
    """On accelerators each unit's backward starts the previous unit's gather; forced on here."""
    from hp_fsdp.param_group import FSDPParamGroup
    from hp_fsdp.state import FSDPState, get_state

    model = build(n_blocks=3)
    ref = ref_copy(model)
    shard_blocks(model)
    tokens, targets = global_batch(0, world_size)
    mine = slice(2 * rank, 2 * rank + 2)
    with torch.no_grad():
        model(tokens[mine])  # lazy init
    context = get_state(model).context
    # Off on CPU (only explicit prefetch, see [Note: implicit prefetch]); on under
    # NCCL/HCCL emulation, where the platform reports an accelerator's device type.
    from hp_core import get_platform

    assert context.implicit_prefetch is (get_platform().device_type != "cpu")
    context.implicit_prefetch = True
    groups = {id(get_state(b).group): i for i, b in enumerate(model.blocks)}
    events: list[tuple[str, int]] = []
    unshard, post_backward = FSDPParamGroup.unshard, FSDPState.post_backward

    def record_unshard(self: Any) -> None:
        if id(self) in groups and self._gather is None and not self.is_unsharded:
            events.append(("gather", groups[id(self)]))
        unshard(self)

    def record_post_backward(self: Any, **kwargs: Any) -> None:
        if self.group is not None and id(self.group) in groups and not self.group.post_backward_done:
            events.append(("reduce", groups[id(self.group)]))
        post_backward(self, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", record_unshard)
    monkeypatch.setattr(FSDPState, "post_backward", record_post_backward)
    loss = loss_fn(model, tokens[mine], targets[mine])
    events.clear()
    loss.backward()
    # block 1's gather starts while block 2 is still in backward (before block 2 reduces), and so on
    assert events.index(("gather", 1)) < events.index(("reduce", 2)), events
    assert events.index(("gather", 0)) < events.index(("reduce", 1)), events
    model.zero_grad()
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=2)


@pytest.mark.distributed(world_size=2)
def test_implicit_forward_prefetch_on_cpu(rank: int, world_size: int, monkeypatch: Any) -> None:
    """On CPU a unit starts the next unit's gather before it computes ([Note: implicit forward prefetch])."""
    from hp_core import get_platform
    from hp_fsdp.param_group import FSDPParamGroup
    from hp_fsdp.state import get_state

    model = build(n_blocks=3)
    ref = ref_copy(model)
    shard_blocks(model)
    tokens, targets = global_batch(0, world_size)
    mine = slice(2 * rank, 2 * rank + 2)
    loss_fn(model, tokens[mine], targets[mine]).backward()  # records the forward order
    context = get_state(model).context
    assert context.implicit_forward_prefetch is (get_platform().device_type == "cpu")
    context.implicit_forward_prefetch = True  # forced on under NCCL/HCCL emulation too
    groups = {id(get_state(b).group): i for i, b in enumerate(model.blocks)}
    events: list[tuple[str, int]] = []
    unshard = FSDPParamGroup.unshard

    def record_unshard(self: Any) -> None:
        if id(self) in groups and self.is_idle_sharded:
            events.append(("gather", groups[id(self)]))
        unshard(self)

    monkeypatch.setattr(FSDPParamGroup, "unshard", record_unshard)
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, o, i=i: events.append(("computed", i)))
    with count_collectives() as counter:
        loss = loss_fn(model, tokens[mine], targets[mine])
    assert counter.calls["all_gather"] == 4  # prefetching moves gathers earlier, never adds one
    # block i+1's gather was started before block i computed
    for i in range(2):
        assert events.index(("gather", i + 1)) < events.index(("computed", i)), events
    loss.backward()
    model.zero_grad()

    # The order changes: block 1 is skipped. Its prefetch (from block 0) must not outlive the
    # forward, or the optimizer step would leave stale gathered values for a later forward.
    skipped = model.blocks[1]
    kept = {k: v for k, v in model.blocks._modules.items() if k != "1"}
    monkeypatch.setattr(model.blocks, "_modules", kept)
    with torch.no_grad():
        model(tokens[mine])
    assert not get_state(skipped).group.is_unsharded and get_state(skipped).group.is_idle_sharded
    assert isinstance(skipped.up.weight, DTensor)
    monkeypatch.undo()
    model.reshard()  # the root stays gathered after forward; the optimizer must see the shards
    context.implicit_forward_prefetch = get_platform().device_type == "cpu"
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_keeps_counts_and_numbers(
    rank: int, world_size: int, monkeypatch: Any, reentrant: bool
) -> None:
    """Blocks re-run their forward in backward (checkpointed): [Note: forward in backward]."""
    from hp_fsdp.state import FSDPState, get_state
    from torch.utils.checkpoint import checkpoint

    model = build(n_blocks=3)
    ref = ref_copy(model)
    shard_blocks(model)

    def forward(tokens: torch.Tensor) -> torch.Tensor:  # the blocks' hooks run again in the recompute
        h = model.emb(tokens)
        for block in model.blocks:
            h = checkpoint(block, h, use_reentrant=reentrant)
        return model.head(model.norm(h))

    model.forward = forward
    tokens, targets = global_batch(0, world_size)
    mine = slice(2 * rank, 2 * rank + 2)
    groups = {id(get_state(b).group): i for i, b in enumerate(model.blocks)}
    reduced: list[int] = []
    post_backward = FSDPState.post_backward

    def record_post_backward(self: Any, *, final: bool = False) -> None:
        group = self.group
        tracked = not final and group is not None and id(group) in groups and not group.post_backward_done
        if tracked and group.post_backward_runs + 1 >= group.forward_calls:
            reduced.append(groups[id(group)])
        post_backward(self, final=final)

    monkeypatch.setattr(FSDPState, "post_backward", record_post_backward)
    for _ in range(2):  # the second step runs with the forward order known (implicit prefetch on CPU)
        with count_collectives() as counter:
            loss = loss_fn(model, tokens[mine], targets[mine])
        assert counter.calls["all_gather"] == 4
        reduced.clear()
        with count_collectives() as counter:
            loss.backward()
        # each block gathers once for its backward (recompute and gradients share the gather) and
        # reduces in its own post-backward, in backward order, not late in the final callback
        assert counter.calls == {"all_gather": 3, "reduce_scatter": 4, "all_reduce": 0}
        assert reduced == [2, 1, 0], reduced
        assert all(not get_state(b)._ran for b in model.blocks)  # the re-run left no half-run mark
        model.zero_grad()
    monkeypatch.undo()
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=2)

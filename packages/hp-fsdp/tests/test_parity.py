"""Numerical parity: sharded training matches a single-process copy on the same global batch.

Every run: a 2-block transformer wrapped per block plus the root, 10 AdamW
steps, losses / every gradient / every parameter compared each step. Float64
keeps Adam's division by sqrt(v) from amplifying reduction-order rounding.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Replicate, Shard
from hp_fsdp import CPUOffloadPolicy, FSDPModule, HSDPModule, MixedPrecisionPolicy

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import Tol, build, parity, ref_copy, shard_blocks

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "no_reshard": {"reshard_after_forward": False},
    "unfused": {"comm_fusion": False},
    "offload": {"offload_policy": CPUOffloadPolicy()},
    "shard_dim1": {"shard_placement_fn": lambda p: Shard(p.dim() - 1)},
    "shard_dim1_unfused": {"shard_placement_fn": lambda p: Shard(p.dim() - 1), "comm_fusion": False},
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fsdp_parity_2_ranks(rank: int, world_size: int, config: str) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model, **CONFIGS[config])
    assert isinstance(model, FSDPModule) and FSDPModule is HSDPModule
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        expected = 1 if config.startswith("shard_dim1") else 0
        assert p.placements == (Shard(min(expected, p.dim() - 1)),), name
    parity(model, ref, dp_rank=rank, dp_world=world_size)


@pytest.mark.distributed(world_size=4)
def test_fsdp_parity_4_ranks_uneven(rank: int, world_size: int) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model)
    # vocab 13 over 4 ranks: chunk sizes 4, 4, 4, 1; a bias of 6 rows: 2, 2, 2, 0
    assert model.emb.weight.to_local().shape[0] == [4, 4, 4, 1][rank]
    assert model.blocks[0].proj.bias.to_local().shape[0] == [2, 2, 2, 0][rank]
    parity(model, ref, dp_rank=rank, dp_world=world_size)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("fusion", [True, False])
def test_hsdp_parity_2x2(rank: int, world_size: int, device_mesh_factory: Any, fusion: bool) -> None:
    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    model = build()
    ref = ref_copy(model)
    shard_blocks(model, mesh=mesh, comm_fusion=fusion)
    assert model.head.weight.placements == (Replicate(), Shard(0))
    parity(model, ref, dp_rank=rank, dp_world=world_size)


@pytest.mark.distributed(world_size=2)
def test_bf16_mixed_precision_within_bf16_tolerance(rank: int, world_size: int) -> None:
    model = build(dtype=torch.float32)
    ref = ref_copy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_blocks(model, mp_policy=policy)
    assert model.head.weight.dtype == torch.float32  # fp32 master shards
    # Adam normalises each update to about lr (1e-2): a bf16 sign flip of a tiny gradient moves a
    # parameter by up to 2 lr per step, so parameters get a few lr of slack; gradients and losses
    # are held to bf16 rounding.
    tol = Tol(rtol=5e-2, atol=2e-2, loss_rtol=2e-2, loss_atol=2e-2, param_atol=6e-2)
    parity(model, ref, dp_rank=rank, dp_world=world_size, tol=tol)


@pytest.mark.distributed(world_size=2)
def test_bf16_is_really_bf16(rank: int, world_size: int) -> None:
    """The mixed-precision run must differ from fp32 (else the test above proves nothing)."""
    seen: list[torch.dtype] = []
    model = build(dtype=torch.float32)
    model.blocks[0].up.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    from hp_fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    out = model(torch.zeros(2, 4, dtype=torch.long))
    assert seen == [torch.bfloat16]
    assert out.dtype == torch.float32


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("sync_each", [True, False])
def test_gradient_accumulation(rank: int, world_size: int, sync_each: bool) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model)

    def toggle(m: Any, i: int) -> None:
        m.set_requires_gradient_sync(sync_each or i == 3)

    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=4, micro=4, before_micro=toggle)


@pytest.mark.distributed(world_size=2)
def test_reduce_grad_after_unsynced_backwards(rank: int, world_size: int) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model)
    model.set_requires_gradient_sync(False)
    parity(
        model,
        ref,
        dp_rank=rank,
        dp_world=world_size,
        steps=3,
        micro=3,
        after_backward=lambda m: m.reduce_grad(),
    )


@pytest.mark.distributed(world_size=4)
def test_hsdp_deferred_all_reduce(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    model = build()
    ref = ref_copy(model)
    shard_blocks(model, mesh=mesh)

    def toggle(m: Any, i: int) -> None:
        m.set_requires_all_reduce(i == 2)

    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3, micro=3, before_micro=toggle)


@pytest.mark.distributed(world_size=2)
def test_replicate_params_parity(rank: int, world_size: int) -> None:
    model = build()
    ref = ref_copy(model)
    norms = [p for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()]
    for block in model.blocks:
        shard_kwargs = {"replicate_params": [p for p in norms if any(p is q for q in block.parameters())]}
        from hp_fsdp import fully_shard

        fully_shard(block, **shard_kwargs)
    from hp_fsdp import fully_shard

    fully_shard(model, replicate_params=norms)
    assert model.blocks[0].norm1.weight.placements == (Replicate(),)
    assert model.norm.bias.placements == (Replicate(),)
    assert model.head.weight.placements == (Shard(0),)
    parity(model, ref, dp_rank=rank, dp_world=world_size)


@pytest.mark.distributed(world_size=2)
def test_ignored_params_stay_local(rank: int, world_size: int) -> None:
    from hp_fsdp import fully_shard
    from hp_fsdp_testlib import global_batch, loss_fn

    model = build()
    ref = ref_copy(model)
    ignored = model.head.bias
    fully_shard(model, ignored_params=[ignored])
    assert type(model.head.bias) is torch.nn.Parameter and model.head.bias is ignored
    assert isinstance(model.head.weight, DTensor)
    tokens, targets = global_batch(0, world_size)
    mine = slice(2 * rank, 2 * rank + 2)
    loss_fn(model, tokens[mine], targets[mine]).backward()
    loss_fn(ref, tokens[mine], targets[mine]).backward()  # ignored: the local gradient, never reduced
    torch.testing.assert_close(model.head.bias.grad, ref.head.bias.grad)
    other = torch.ones(1, dtype=torch.float64) * float(model.head.bias.grad.sum())
    import hp_core.collectives as hc

    gathered = torch.empty(2, dtype=torch.float64)
    hc.all_gather_into_tensor(gathered, other)
    assert gathered[0] != gathered[1]  # the ranks' grads really differ: nothing was averaged


@pytest.mark.distributed(world_size=2)
def test_tied_embedding_and_head_share_one_shard(rank: int, world_size: int) -> None:
    from hp_fsdp import fully_shard

    model = build()
    model.head.weight = model.emb.weight  # (13, 6) both: tie them
    ref = ref_copy(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert model.head.weight is model.emb.weight and isinstance(model.emb.weight, DTensor)
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3)


@pytest.mark.distributed(world_size=2)
def test_tied_weight_split_across_units_is_refused(rank: int, world_size: int) -> None:
    from hp_fsdp import fully_shard

    model = build()
    model.head.weight = model.emb.weight
    fully_shard(model.emb)
    with pytest.raises(ValueError, match=r"'head.weight' is tied to 'weight'.*same unit"):
        fully_shard(model)
    assert not isinstance(model, FSDPModule)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("reshard", [True, False])
def test_oracle_torch_fully_shard_passes_the_same_parity(
    rank: int, world_size: int, device_mesh_factory: Any, reshard: bool
) -> None:
    """The parity harness itself is right: torch's own fully_shard passes it on the same model."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = device_mesh_factory((world_size,), ("dp",)).to_torch()
    model = build()
    ref = ref_copy(model)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3)


@pytest.mark.distributed(world_size=2)
def test_parity_detects_a_wrong_gradient(rank: int, world_size: int) -> None:
    """The harness can fail: a gradient scaled on one unit is caught."""
    model = build()
    ref = ref_copy(model)
    shard_blocks(model)
    model.set_gradient_divide_factor(1.0)  # sums instead of averaging: gradients twice too large
    with pytest.raises(AssertionError, match="grad"):
        parity(model, ref, dp_rank=rank, dp_world=world_size, steps=1)


@pytest.mark.distributed(world_size=4)
def test_hsdp_replicate_params_parity(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    from hp_fsdp import fully_shard

    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    model = build()
    ref = ref_copy(model)
    norms = [p for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()]
    for block in model.blocks:
        fully_shard(
            block, mesh=mesh, replicate_params=[p for p in norms if any(p is q for q in block.parameters())]
        )
    fully_shard(model, mesh=mesh, replicate_params=norms)
    assert model.norm.weight.placements == (Replicate(), Replicate())
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=4)


@pytest.mark.distributed(world_size=2)
def test_root_without_own_parameters(rank: int, world_size: int) -> None:
    """Every parameter lives in a child unit: the root unit has no group but still drives backward."""
    from hp_fsdp import fully_shard

    model = build()
    ref = ref_copy(model)
    for sub in (model.emb, *model.blocks, model.norm, model.head):
        fully_shard(sub)
    fully_shard(model)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3)

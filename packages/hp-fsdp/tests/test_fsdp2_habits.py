"""Arguments written with FSDP2 habits, and ``fully_shard`` called top-down.

torch's own ``MixedPrecisionPolicy`` / ``CPUOffloadPolicy`` / ``OffloadPolicy``
(from ``torch.distributed.fsdp``) are refused naming torch's class and the
hp_fsdp policy with the same fields; a ``torch.distributed.tensor.Shard(d)``
from ``shard_placement_fn`` is read as its dim (training matches a
single-process copy); a ``DeviceMesh`` of torch is named as such; and a child
passed to ``fully_shard`` after its parent gets "already managed by the
parent's fully_shard; call fully_shard bottom-up" instead of an error about
DTensor meshes. Every refusal happens on every rank (each rank runs the body)
before anything changes.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import DTensor, Shard
from hp_fsdp import HSDPModule, fully_shard
from hp_fsdp.state import STATE_ATTR
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build, parity, ref_copy, shard_blocks
from test_bad_input import _untouched  # a sibling test module, found through sys.path

TORCH_POLICIES = {
    "MixedPrecisionPolicy": (
        lambda fsdp: {"mp_policy": fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        r"mp_policy=MixedPrecisionPolicy\(.*\) is torch\.distributed\.fsdp\.MixedPrecisionPolicy, "
        r"torch's FSDP2 policy, not hp_fsdp's; import the policy from hp_fsdp instead: pass "
        r"hp_fsdp\.MixedPrecisionPolicy\(param_dtype=torch\.bfloat16, reduce_dtype=None, output_dtype=None, "
        r"cast_forward_inputs=True\)",
    ),
    "CPUOffloadPolicy": (
        lambda fsdp: {"offload_policy": fsdp.CPUOffloadPolicy(pin_memory=False)},
        r"offload_policy=CPUOffloadPolicy\(pin_memory=False\) is torch\.distributed\.fsdp\.CPUOffloadPolicy, "
        r"torch's FSDP2 policy, not hp_fsdp's; .*pass hp_fsdp\.CPUOffloadPolicy\(pin_memory=False\)",
    ),
    "OffloadPolicy": (
        lambda fsdp: {"offload_policy": fsdp.OffloadPolicy()},
        r"offload_policy=OffloadPolicy\(\) is torch\.distributed\.fsdp\.OffloadPolicy, torch's FSDP2 policy, "
        r"not hp_fsdp's; .*pass hp_fsdp\.OffloadPolicy\(\)",
    ),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", sorted(TORCH_POLICIES))
def test_torch_policy_names_the_hp_fsdp_equivalent(rank: int, world_size: int, name: str) -> None:
    import torch.distributed.fsdp as torch_fsdp

    make, message = TORCH_POLICIES[name]
    model = build()
    before = dict(model.named_parameters())
    with pytest.raises(TypeError, match=message):
        fully_shard(model, **make(torch_fsdp))
    _untouched(model, before)


@pytest.mark.distributed(world_size=2)
def test_torch_device_mesh_is_taken(rank: int, world_size: int) -> None:
    """torch's DeviceMesh is read once as ours, on its own process groups: the same units, no new group."""
    from torch.distributed.device_mesh import init_device_mesh

    torch_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = build()
    fully_shard(model, mesh=torch_mesh)
    param = next(model.parameters())
    assert param.device_mesh.mesh_dim_names == ("dp",)
    assert param.device_mesh.get_group() is torch_mesh.get_group()
    with pytest.raises(TypeError, match=r"hp_core\.DeviceMesh \(or a torch DeviceMesh\), got str"):
        fully_shard(build(), mesh="dp")  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=2)
def test_torch_shard_from_shard_placement_fn_trains(rank: int, world_size: int) -> None:
    """FSDP2's ``shard_placement_fn`` returns torch's ``Shard``; it means the same dim here."""
    from torch.distributed.tensor import Shard as TorchShard

    model = build()
    ref = ref_copy(model)
    shard_blocks(model, shard_placement_fn=lambda p: TorchShard(p.dim() - 1))
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(p.dim() - 1),), name
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3)


@pytest.mark.distributed(world_size=2)
def test_other_torch_placements_are_refused(rank: int, world_size: int) -> None:
    from torch.distributed.tensor import Replicate as TorchReplicate

    model = build()
    before = dict(model.named_parameters())
    with pytest.raises(
        TypeError,
        match=r"returned Replicate\(\) for 'emb\.weight'; return Shard\(dim\) or None \(hp_dtensor\.Shard or "
        r"torch\.distributed\.tensor\.Shard to shard that dim, None for dim 0\), not a "
        r"torch\.distributed\.tensor\.Replicate",
    ):
        fully_shard(model, shard_placement_fn=lambda p: TorchReplicate())
    _untouched(model, before)


def _parent_first() -> nn.Module:
    model = build()
    fully_shard(model)
    return model


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("child", ["blocks.0", "blocks.1.up", "blocks"])
def test_child_after_parent(rank: int, world_size: int, child: str) -> None:
    model = _parent_first()
    sub = model.get_submodule(child)
    params = dict(model.named_parameters())
    with pytest.raises(
        ValueError,
        match=rf"fully_shard: \w+ \(module\[0\]\) is already managed by the fully_shard of its parent "
        rf"HSDPTransformer as '{child}', which took its parameters.*call fully_shard bottom-up "
        r"\(children first\)",
    ):
        fully_shard(sub)
    assert STATE_ATTR not in sub.__dict__ and not isinstance(sub, HSDPModule)
    assert dict(model.named_parameters()) == params and all(
        params[n] is p for n, p in model.named_parameters()
    )


@pytest.mark.distributed(world_size=2)
def test_child_after_a_list_unit(rank: int, world_size: int) -> None:
    model = build()
    fully_shard([model.emb, model.blocks[0]])
    with pytest.raises(
        ValueError,
        match=r"Linear \(module\[0\]\) is already managed by the fully_shard of its parent HSDPBlock as 'up'",
    ):
        fully_shard(model.blocks[0].up)


@pytest.mark.distributed(world_size=2)
def test_bottom_up_is_not_mistaken_for_top_down(rank: int, world_size: int) -> None:
    """Blocks first, then the root: the units below the root must not count as parents."""
    model = build()
    ref = copy.deepcopy(model)
    shard_blocks(model)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=2)
    other = build()
    fully_shard(other.blocks[0])
    fully_shard([other.blocks[1], other.norm])  # a list unit beside a nested one, then the root
    fully_shard(other)

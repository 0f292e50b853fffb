"""DeviceMesh.from_torch: torch's meshes read as ours, on torch's own process groups (2 and 4 ranks).

Every conversion runs with ``torch.distributed.new_group`` patched to raise:
a group torch already has must never be created again. The group cache is
cleared first where a test checks group identity, so groups cached by earlier
tests over the same ranks do not stand in for torch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_core import DeviceMesh, init_device_mesh
from hp_core.mesh import clear_group_cache
from hp_testing import record_collectives
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh


@contextlib.contextmanager
def no_new_groups() -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"new_group{args} was called for a group torch already has")

    with mock.patch.object(dist, "new_group", refuse):
        yield


def ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def summed(value: int, group: dist.ProcessGroup) -> int:
    tensor = torch.tensor([value])
    hp_core.all_reduce(tensor, group=group)
    return int(tensor.item())


@pytest.mark.distributed(world_size=2)
def test_one_dim_torch_mesh(rank: int) -> None:
    theirs = torch_init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with no_new_groups(), record_collectives() as log:
        mesh = DeviceMesh.from_torch(theirs)
        assert DeviceMesh.from_torch(theirs) is mesh  # memoised per torch mesh
    assert len(log) == 0  # nothing communicated
    assert mesh.device_type == "cpu" and mesh.shape == (2,) and mesh.mesh_dim_names == ("dp",)
    assert mesh.mesh.tolist() == [0, 1] and mesh.get_local_rank() == rank == theirs.get_local_rank()
    assert mesh.get_group() is theirs.get_group()
    assert summed(rank + 1, mesh.get_group()) == 3
    assert mesh.to_torch() is theirs and DeviceMesh.from_torch(mesh) is mesh
    with pytest.raises(TypeError, match=r"expected a torch\.distributed\.device_mesh\.DeviceMesh, got "):
        DeviceMesh.from_torch("dp")  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=4)
def test_two_dim_torch_mesh_groups_slices_and_round_trip(rank: int) -> None:
    clear_group_cache()
    theirs = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with no_new_groups():
        mesh = DeviceMesh.from_torch(theirs)
        assert mesh.mesh.tolist() == theirs.mesh.tolist() == [[0, 1], [2, 3]]
        assert mesh.mesh_dim_names == ("dp", "tp") and mesh.get_coordinate() == theirs.get_coordinate()
        for dim in ("dp", "tp"):
            assert mesh.get_group(dim) is theirs.get_group(dim)
            assert mesh.get_local_rank(dim) == theirs.get_local_rank(dim)
            assert mesh[dim].get_group() is theirs[dim].get_group()  # our slice: torch's group
            sliced = DeviceMesh.from_torch(theirs[dim])  # torch's slice: a new torch object each time
            assert sliced is DeviceMesh.from_torch(theirs[dim]) and sliced == mesh[dim]
            assert sliced.get_group() is theirs.get_group(dim)
        # slices of one torch mesh compose like ours: concatenate, permute
        both = DeviceMesh.concatenate(
            [DeviceMesh.from_torch(theirs["tp"]), DeviceMesh.from_torch(theirs["dp"])]
        )
        assert both == mesh.permute("tp", "dp") and both.get_group("dp") is theirs.get_group("dp")
        assert mesh.flatten().get_group() is dist.group.WORLD  # the world's ranks: the default group
        assert mesh.to_torch() is theirs and DeviceMesh.from_torch(mesh.to_torch()) is mesh
    assert summed(rank, mesh.get_group("tp")) == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
    assert summed(rank, mesh.get_group("dp")) == {0: 2, 1: 4, 2: 2, 3: 4}[rank]
    native = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert native == mesh and native.get_group("tp") is theirs.get_group("tp")  # cached: torch's
    assert native.to_torch() is theirs  # equal meshes share one torch view
    own = init_device_mesh("cpu", (4, 1), mesh_dim_names=("a", "b"))  # ours first: to_torch builds torch's
    assert DeviceMesh.from_torch(own.to_torch()) is own
    clear_group_cache()  # our groups are released; torch's are torch's and stay alive
    again = DeviceMesh.from_torch(theirs)
    assert again is not mesh and again.get_group("dp") is theirs.get_group("dp")
    assert summed(1, again.get_group("dp")) == 2


@pytest.mark.distributed(world_size=4)
def test_flattened_sliced_and_size_one_dims(rank: int) -> None:
    clear_group_cache()
    # torchtitan's shape: (dp_shard, cp, tp) with cp == 1, and dp_shard x cp flattened
    theirs = torch_init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
    flat = theirs["dp_shard", "cp"]._flatten("dp_shard_cp")
    with no_new_groups():
        mesh = DeviceMesh.from_torch(theirs)
        assert mesh.mesh.tolist() == theirs.mesh.tolist() and mesh.shape == (2, 1, 2)
        for dim in ("dp_shard", "cp", "tp"):
            assert mesh.get_group(dim) is theirs.get_group(dim)
        assert ranks(mesh.get_group("cp")) == [rank]
        ours_flat = mesh["dp_shard_cp"]  # torch's flattened dim is reachable by name, as in torch
        assert ours_flat is DeviceMesh.from_torch(flat) and ours_flat.mesh.tolist() == flat.mesh.tolist()
        # the cache holds one group per set of ranks: dp_shard's, which has dp_shard_cp's ranks
        assert ours_flat.get_group() is theirs.get_group("dp_shard")
        assert ranks(ours_flat.get_group()) == ranks(flat.get_group()) == [rank % 2, rank % 2 + 2]
        assert mesh["dp_shard", "cp"].flatten("dp_shard_cp") is ours_flat
        # a 2-D slice of the 3-D mesh
        two = DeviceMesh.from_torch(theirs["dp_shard", "tp"])
        assert two.mesh.tolist() == theirs["dp_shard", "tp"].mesh.tolist() == [[0, 1], [2, 3]]
        assert two == mesh["dp_shard", "tp"] and two.get_group("tp") is theirs.get_group("tp")
    assert summed(rank, ours_flat.get_group()) == {0: 2, 1: 4, 2: 2, 3: 4}[rank]


@pytest.mark.distributed(world_size=4)
def test_unflattened_world_mesh(rank: int) -> None:
    clear_group_cache()
    world = torch_init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    theirs = world._unflatten(0, (2, 2), ("dp", "tp"))
    with no_new_groups():
        ours_world = DeviceMesh.from_torch(world)
        mesh = DeviceMesh.from_torch(theirs)
        assert ours_world.mesh.tolist() == [0, 1, 2, 3] and ours_world.get_group() is world.get_group()
        assert mesh.mesh.tolist() == theirs.mesh.tolist() == [[0, 1], [2, 3]]
        for dim in ("dp", "tp"):
            assert mesh.get_group(dim) is theirs.get_group(dim)
            assert DeviceMesh.from_torch(theirs[dim]).get_group() is theirs.get_group(dim)
        # the world mesh and its unflattening cut one rank list alike: they compose
        rebuilt = DeviceMesh.concatenate(
            [DeviceMesh.from_torch(theirs["dp"]), DeviceMesh.from_torch(theirs["tp"])]
        )
        assert rebuilt == mesh and rebuilt.flatten("world").mesh.tolist() == [0, 1, 2, 3]
    assert summed(rank, mesh.get_group("tp")) == {0: 1, 1: 1, 2: 5, 3: 5}[rank]


@pytest.mark.distributed(world_size=8)
def test_torchtitan_meshes_on_eight_ranks(rank: int) -> None:
    clear_group_cache()
    theirs = torch_init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
    dp_shard_cp = theirs["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_tp = theirs["dp_shard", "tp"]._flatten("dp_tp")  # dims that are not adjacent
    world = torch_init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
    three = world._unflatten(0, (2, 2, 2), ("pp", "dp", "tp"))
    two = world._unflatten(0, (2, 4), ("pp", "rest"))
    with no_new_groups():
        mesh = DeviceMesh.from_torch(theirs)
        for dim in ("dp_shard", "cp", "tp"):
            assert mesh.get_group(dim) is theirs.get_group(dim)
        for name, flat in (("dp_shard_cp", dp_shard_cp), ("dp_tp", dp_tp)):
            assert (
                mesh[name] is DeviceMesh.from_torch(flat) and mesh[name].mesh.tolist() == flat.mesh.tolist()
            )
            assert mesh[name].get_group() is flat.get_group()
        assert mesh["dp_shard", "cp"].flatten("dp_shard_cp") is mesh["dp_shard_cp"]
        fsdp_tp = DeviceMesh.concatenate([mesh["dp_shard_cp"], DeviceMesh.from_torch(theirs["tp"])])
        assert fsdp_tp.mesh.tolist() == theirs.mesh.reshape(4, 2).tolist()
        unflat = DeviceMesh.from_torch(three)
        # one group per set of ranks: the unflattened dims have the ranks of the first mesh's dims
        for dim, same in (("pp", "dp_shard"), ("dp", "cp"), ("tp", "tp")):
            assert ranks(unflat.get_group(dim)) == ranks(three.get_group(dim))
            assert unflat.get_group(dim) is theirs.get_group(same)
        # two unflattenings of one world mesh cut its rank list alike, so their dims compose
        rest = DeviceMesh.from_torch(two["rest"])
        assert rest.get_group() is two.get_group("rest")
        both = DeviceMesh.concatenate([DeviceMesh.from_torch(three["pp"]), rest])
        assert both.mesh.tolist() == two.mesh.tolist()
    assert summed(rank, mesh["dp_tp"].get_group()) == sum(mesh["dp_tp"].mesh.tolist())

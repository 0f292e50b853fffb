"""DeviceMesh on 1, 2, 4 and 8 ranks: layout, slicing, flattening, cached groups, torch interop, errors."""

from __future__ import annotations

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_core import DeviceMesh, StaleMeshError, init_device_mesh
from hp_core.mesh import cached_groups, clear_group_cache
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


# -- 1 and 2 ranks ----------------------------------------------------------------------------


@pytest.mark.distributed(world_size=1)
def test_one_rank_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert (mesh.shape, mesh.ndim, mesh.size(), mesh.mesh.tolist()) == ((1,), 1, 1, [0])
    assert mesh.get_coordinate() == (0,) and mesh.get_local_rank() == 0
    assert mesh.get_group() is dist.group.WORLD
    assert mesh.flatten() is mesh
    assert mesh.to_torch().mesh.tolist() == [0]


@pytest.mark.distributed(world_size=2)
def test_one_dim_mesh_on_two_ranks(rank, world_size):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    assert mesh.mesh_dim_names == ("dp",) and mesh.device_type == "cpu"
    assert mesh.get_local_rank() == rank == mesh.get_local_rank("dp") == mesh.get_local_rank(-1)
    assert group_ranks(mesh.get_group()) == [0, 1]
    assert mesh["dp"] is mesh
    tensor = torch.tensor([float(rank + 1)])
    hp_core.all_reduce(tensor, group=mesh)  # a 1-D mesh stands in for its group
    assert tensor.item() == 3.0
    assert repr(mesh) == "DeviceMesh('cpu', [0, 1], mesh_dim_names=('dp',))"


@pytest.mark.distributed(world_size=2)
def test_mesh_errors_name_values_and_fixes(rank, world_size):
    with pytest.raises(
        ValueError, match=r"mesh_shape=\(2, 2\) holds 4 ranks but the world size is 2.*e.g. \(2,\)"
    ):
        init_device_mesh("cpu", (2, 2))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    with pytest.raises(KeyError, match=r"unknown dim name\(s\) \['tp'\]; this mesh has dims \('pp', 'dp'\)"):
        mesh["tp"]
    with pytest.raises(
        ValueError, match=r"dims must be given in mesh order \('pp', 'dp'\); use mesh\[\('pp', 'dp'\)\]"
    ):
        mesh["dp", "pp"]
    with pytest.raises(ValueError, match="a dim name is repeated"):
        mesh["dp", "dp"]
    with pytest.raises(TypeError, match=r"index with a dim name or a tuple of names.*got 0"):
        mesh[0]  # type: ignore[index]
    with pytest.raises(
        ValueError, match=r"dim=None is only allowed for a 1-D mesh, but this mesh has 2 dims"
    ):
        mesh.get_group()
    with pytest.raises(ValueError, match=r"dim=None is only allowed for a 1-D mesh"):
        mesh.get_local_rank()
    with pytest.raises(IndexError, match=r"dim=2 is out of range for a 2-D mesh"):
        mesh.get_group(2)
    with pytest.raises(KeyError, match=r"no dim named 'tp'"):
        mesh.size("tp")
    with pytest.raises(TypeError, match="dim must be an int, a dim name or None, got float"):
        mesh.get_group(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"name 'dp' is already a dim of this mesh"):
        mesh.flatten("dp")
    with pytest.raises(ValueError, match=r"2-D mesh needs at least|has no dim names, which torch's"):
        init_device_mesh("cpu", (1, 2)).to_torch()
    with pytest.raises(KeyError, match="this mesh has no dim names"):
        init_device_mesh("cpu", (1, 2))["dp"]
    with pytest.raises(ValueError, match=r"holds ranks \[2\] outside the world \[0, 2\)"):
        DeviceMesh("cpu", [0, 2])
    with pytest.raises(ValueError, match=r"lists ranks \[1\] more than once"):
        DeviceMesh("cpu", [1, 1])
    with pytest.raises(TypeError, match=r"mesh must hold integer ranks, got dtype torch\.float32"):
        DeviceMesh("cpu", torch.tensor([0.0, 1.0]))
    with pytest.raises(hp_core.PlatformError, match=r"'tpu'"):
        init_device_mesh("tpu", (2,))


@pytest.mark.distributed(world_size=2)
def test_cleared_cache_makes_meshes_stale(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    assert mesh.get_group("tp") in cached_groups()
    clear_group_cache()
    assert cached_groups() == []
    for use in (lambda: mesh.get_group("dp"), mesh.to_torch, mesh.flatten, lambda: mesh["dp"]):
        with pytest.raises(StaleMeshError, match=r"build it again with init_device_mesh"):
            use()
    assert mesh.get_coordinate() == (rank, 0)  # pure layout questions still work
    fresh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    tensor = torch.tensor([rank + 1])
    hp_core.all_reduce(tensor, group=fresh.get_group("tp"))
    assert tensor.item() == rank + 1  # a one-rank group per row


# -- 4 ranks ---------------------------------------------------------------------------------


@pytest.mark.distributed(world_size=4)
def test_2x2_layout_slicing_and_groups(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row, col = divmod(rank, 2)
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert (mesh.shape, mesh.ndim, mesh.size(), mesh.size("tp"), mesh.size(0)) == ((2, 2), 2, 4, 2, 2)
    assert mesh.get_coordinate() == (row, col)
    assert (mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), mesh.get_local_rank(1)) == (row, col, col)

    tp, dp = mesh["tp"], mesh["dp"]
    assert tp.mesh.tolist() == [2 * row, 2 * row + 1] and tp.mesh_dim_names == ("tp",)
    assert dp.mesh.tolist() == [col, col + 2] and dp.get_coordinate() == (row,)
    assert group_ranks(mesh.get_group("tp")) == tp.mesh.tolist()
    assert group_ranks(mesh.get_group("dp")) == dp.mesh.tolist()
    assert dist.get_rank(mesh.get_group("dp")) == row
    assert mesh["dp", "tp"] is mesh
    assert mesh.get_all_groups() == [mesh.get_group("dp"), mesh.get_group("tp")]

    # Groups are created once per rank tuple: slices and a second mesh reuse them.
    assert tp.get_group() is mesh.get_group("tp")
    again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert again.get_group("tp") is mesh.get_group("tp") and again.get_group("dp") is mesh.get_group("dp")
    assert again == mesh and hash(again) == hash(mesh) and again != tp
    assert init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")) != mesh

    tensor = torch.tensor([float(rank)])
    hp_core.all_reduce(tensor, group=mesh.get_group("tp"))
    assert tensor.item() == 4 * row + 1  # 2*row + (2*row + 1)
    tensor = torch.tensor([float(rank)])
    hp_core.all_reduce(tensor, group=dp)
    assert tensor.item() == 2 * col + 2  # col + (col + 2)

    with pytest.raises(ValueError, match=r"use mesh\[\('dp', 'tp'\)\]"):
        mesh["tp", "dp"]


@pytest.mark.distributed(world_size=4)
def test_2x2_flatten(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = mesh.flatten()
    assert flat.mesh_dim_names == ("dp_tp",) and flat.mesh.tolist() == [0, 1, 2, 3]
    assert flat.get_local_rank() == rank and flat.get_group() is dist.group.WORLD
    assert mesh["dp_tp"] is flat and mesh.flatten() is flat
    named = mesh.flatten("world")
    assert named.mesh_dim_names == ("world",) and named.get_group() is flat.get_group()
    unnamed = init_device_mesh("cpu", (2, 2)).flatten()
    assert unnamed.mesh_dim_names is None and unnamed.shape == (4,)


@pytest.mark.distributed(world_size=4)
def test_2x2_to_torch_is_equivalent(rank, world_size):
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs = mesh.to_torch()
    assert isinstance(theirs, TorchDeviceMesh)
    assert mesh.to_torch() is theirs
    assert theirs.shape == (2, 2) and theirs.mesh_dim_names == ("dp", "tp")
    assert theirs.mesh.tolist() == mesh.mesh.tolist()
    assert tuple(theirs.get_coordinate()) == mesh.get_coordinate()
    for dim in ("dp", "tp"):
        assert theirs.get_group(dim) is mesh.get_group(dim)  # no new groups
        assert theirs.get_local_rank(dim) == mesh.get_local_rank(dim)
        assert theirs[dim].mesh.tolist() == mesh[dim].mesh.tolist()
    sub = mesh["tp"].to_torch()
    assert sub.get_group() is mesh.get_group("tp") and sub.mesh.tolist() == mesh["tp"].mesh.tolist()
    # torch's own DTensor can run collectives over our groups.
    local = torch.full((1, 3), float(rank))
    whole = DTensor.from_local(local, sub, [Shard(0)]).full_tensor()
    row = rank // 2
    assert whole.tolist() == [[2.0 * row] * 3, [2.0 * row + 1] * 3]


@pytest.mark.distributed(world_size=4)
def test_permuted_custom_mesh_keeps_coordinates_and_group_ranks_aligned(rank, world_size):
    mesh = DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("a", "b"))
    coordinate = {3: (0, 0), 2: (0, 1), 1: (1, 0), 0: (1, 1)}[rank]
    assert mesh.get_coordinate() == coordinate
    b_group = mesh.get_group("b")
    assert dist.get_rank(b_group) == mesh.get_local_rank("b")
    gathered = torch.empty(2, dtype=torch.int64)
    hp_core.all_gather_into_tensor(gathered, torch.tensor([rank]), group=b_group)
    assert gathered.tolist() == mesh["b"].mesh.tolist()  # gathered in coordinate order


# -- 8 ranks ---------------------------------------------------------------------------------


@pytest.mark.distributed(world_size=8)
def test_2x4_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    row, col = divmod(rank, 4)
    assert mesh.get_coordinate() == (row, col)
    assert mesh["tp"].mesh.tolist() == [4 * row + c for c in range(4)]
    assert mesh["dp"].mesh.tolist() == [col, col + 4]
    tensor = torch.tensor([float(rank)])
    hp_core.all_reduce(tensor, group=mesh.get_group("dp"))
    assert tensor.item() == 2 * col + 4
    # Uneven gather inside a row: column c contributes c + 1 rows.
    sizes = [c + 1 for c in range(4)]
    out = torch.empty(sum(sizes))
    hp_core.all_gather_into_tensor(out, torch.full((col + 1,), float(rank)), mesh["tp"], input_sizes=sizes)
    assert out.tolist() == [float(4 * row + c) for c in range(4) for _ in range(c + 1)]
    assert mesh.flatten().get_group() is dist.group.WORLD
    assert mesh.to_torch()["tp"].mesh.tolist() == mesh["tp"].mesh.tolist()


@pytest.mark.distributed(world_size=8)
def test_2x2x2_mesh(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    p, d, t = rank // 4, (rank // 2) % 2, rank % 2
    assert mesh.get_coordinate() == (p, d, t)
    assert [mesh.get_local_rank(n) for n in ("pp", "dp", "tp")] == [p, d, t]

    inner = mesh["dp", "tp"]
    assert inner.mesh.tolist() == [[4 * p, 4 * p + 1], [4 * p + 2, 4 * p + 3]]
    assert inner.get_coordinate() == (d, t)
    assert inner.get_group("tp") is mesh.get_group("tp") and inner["tp"].mesh.tolist() == [
        rank - t,
        rank - t + 1,
    ]

    outer = mesh["pp", "tp"]  # not adjacent: dp is pinned at this rank's coordinate
    assert outer.mesh.tolist() == [[2 * d, 2 * d + 1], [4 + 2 * d, 4 + 2 * d + 1]]
    assert outer.get_coordinate() == (p, t)

    flat = inner.flatten()
    assert flat.mesh_dim_names == ("dp_tp",) and flat.mesh.tolist() == [4 * p + i for i in range(4)]
    assert mesh["dp_tp"] is flat and flat.get_local_rank() == 2 * d + t
    tensor = torch.tensor([float(rank)])
    hp_core.all_reduce(tensor, group=flat)
    assert tensor.item() == 16 * p + 6

    pp_tp = outer.flatten()
    assert pp_tp.mesh.tolist() == [2 * d, 2 * d + 1, 4 + 2 * d, 5 + 2 * d]
    with pytest.raises(KeyError, match=r"flattened dim 'dp_tp' spans dims this mesh"):
        mesh["pp"]["dp_tp"]

    theirs = mesh.to_torch()
    assert theirs.shape == (2, 2, 2) and tuple(theirs.get_coordinate()) == (p, d, t)
    assert theirs["dp", "tp"].mesh.tolist() == inner.mesh.tolist()
    assert all(theirs.get_group(n) is mesh.get_group(n) for n in ("pp", "dp", "tp"))


@pytest.mark.distributed(world_size=4)
def test_2x2_concatenate_and_permute(rank, world_size, monkeypatch):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row, col = divmod(rank, 2)

    def no_new_group(*args, **kwargs):
        raise AssertionError("concatenate/permute must reuse cached groups, not create any")

    monkeypatch.setattr(dist, "new_group", no_new_group)
    both = DeviceMesh.concatenate([mesh["dp"], mesh["tp"]])
    assert both == mesh and both.mesh_dim_names == ("dp", "tp")
    swapped = DeviceMesh.concatenate([mesh["tp"], mesh["dp"]])
    assert swapped.mesh.tolist() == [[0, 2], [1, 3]] and swapped.mesh_dim_names == ("tp", "dp")
    assert swapped.get_coordinate() == (col, row)
    assert swapped.get_group("tp") is mesh.get_group("tp") and swapped.get_group("dp") is mesh.get_group("dp")
    assert mesh.permute("tp", "dp") == swapped and mesh.permute(1, 0) == swapped
    assert mesh.permute(("dp", "tp")) is mesh and swapped.permute("dp", "tp") == mesh
    renamed = DeviceMesh.concatenate([mesh["tp"], mesh["dp"]], mesh_dim_names=("a", "b"))
    assert renamed.mesh_dim_names == ("a", "b") and renamed.mesh.tolist() == swapped.mesh.tolist()
    unnamed = init_device_mesh("cpu", (2, 2))
    assert unnamed.permute(1, 0).mesh.tolist() == [[0, 2], [1, 3]]
    assert unnamed.permute(1, 0).mesh_dim_names is None
    # a flattened dim combines too: (dp_tp,) plus nothing else is the flattened mesh itself
    flat = mesh.flatten()
    assert DeviceMesh.concatenate([flat]) is flat

    with pytest.raises(ValueError, match=r"overlap \(they share dim\(s\) \[0\]"):
        DeviceMesh.concatenate([mesh["dp"], mesh])
    with pytest.raises(ValueError, match=r"overlap"):
        DeviceMesh.concatenate([flat, mesh["tp"]])
    other = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "y"))  # groups exist already
    with pytest.raises(ValueError, match=r"not sliced from the same mesh \(their parents are"):
        DeviceMesh.concatenate([mesh["dp"], other["y"]])
    with pytest.raises(TypeError, match=r"non-empty list of hp_core DeviceMeshes"):
        DeviceMesh.concatenate([])
    with pytest.raises(ValueError, match=r"mesh_dim_names=\(...\) with one distinct name"):
        clash = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "dp"))["dp"]
        DeviceMesh.concatenate([mesh["dp"], clash])
    with pytest.raises(ValueError, match=r"list every dim exactly once"):
        mesh.permute("dp", "dp")
    with pytest.raises(KeyError, match=r"no dim named 'pp'"):
        mesh.permute("pp", "dp")


@pytest.mark.distributed(world_size=2)
def test_a_mesh_is_built_under_the_meta_device(rank: int) -> None:
    """``fully_shard`` of a model built under ``with torch.device('meta')`` builds its default mesh there."""
    with torch.device("meta"):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        listed = DeviceMesh("cpu", [0, 1])
    assert mesh.size() == 2 and mesh.get_local_rank() == rank
    assert listed.size() == 2 and listed.get_local_rank() == rank

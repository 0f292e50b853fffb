"""torch.distributed.checkpoint (DCP) with hp DTensors, hp_dtensor alone (no hp_fsdp anywhere here).

DTensor carries DCP's protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), so a tensor-parallel model's state dict saves as shards and
loads under any other layout: the tests save on one layout, load on another, and
compare every value exactly.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Partial,
    Replicate,
    RowwiseParallel,
    Shard,
    distribute_tensor,
    parallelize_module,
)
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int, dim: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _shared_path(tmp_path: Any, name: str) -> str:
    """One directory for all ranks, also under plain torchrun where each process has its own tmp_path."""
    import hp_core

    out: str = hp_core.broadcast_object(str(tmp_path / name), src=0)
    return out


def _full(value: Any) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _assert_equal(got: Any, want: torch.Tensor, what: str) -> None:
    got = _full(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    assert torch.equal(got, want), f"{what}: {got} != {want}"


def _fake_step(model: nn.Module, opt: torch.optim.Optimizer, scale: float) -> None:
    """One AdamW step from made-up gradients laid out like each parameter (no forward needed).

    The uneven TP models below cannot run forward (the TP hooks assume even
    activations), but their parameters and optimizer state are what a
    checkpoint holds, and these give every state tensor distinct values.
    """
    for p in model.parameters():
        p.grad = p.detach() * scale + 1.0
    opt.step()
    opt.zero_grad()


def test_dtensor_class_carries_the_dcp_protocol() -> None:
    """The hooks are DTensor's own: a fresh interpreter that imports only hp_dtensor has them."""
    code = (
        "import sys, hp_dtensor\n"
        "names = ['__create_write_items__', '__create_chunk_list__', '__get_tensor_shard__']\n"
        "missing = [n for n in names if not hasattr(hp_dtensor.DTensor, n)]\n"
        "assert not missing, missing\n"
        "assert 'hp_fsdp' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.distributed(world_size=4)
def test_tp_model_save_load_and_reshard(rank: int, device_mesh_factory: Any, tmp_path: Any) -> None:
    """A TP-only model and its AdamW state through dcp.save / dcp.load, hidden sizes even and uneven.

    Saved at TP=4, loaded at TP=4, at TP=2 (the tp dim of a 2x2 mesh) and into a
    plain model; saved at TP=2 and loaded at TP=4. Hidden 7 and 6 do not divide
    by 4 (7 rows: 2, 2, 2, 1; 6 rows: 2, 2, 2, 0, an empty piece on rank 3), and 7
    not by 2 either (4, 3).
    """
    import torch.distributed.checkpoint as dcp

    line = device_mesh_factory((4,), ("tp",))
    tp2 = device_mesh_factory((2, 2), ("dp", "tp"))["tp"]
    for hidden in (16, 7, 6):
        for save_mesh, load_meshes in ((line, (line, tp2, None)), (tp2, (line,))):
            path = _shared_path(tmp_path, f"tp_{hidden}_{save_mesh.size()}")
            torch.manual_seed(0)
            ref = MLP(hidden)
            source = parallelize_module(copy.deepcopy(ref), save_mesh, PLAN)
            opt = torch.optim.AdamW(source.parameters(), lr=1e-2)
            _fake_step(source, opt, 0.5)
            assert source.up.weight.placements == (Shard(0),)
            assert source.down.weight.placements == (Shard(1),)
            assert source.down.bias.placements == (Replicate(),)
            want_model = {k: _full(v).clone() for k, v in source.state_dict().items()}
            want_optim = {
                (i, key): _full(value).clone()
                for i, state in opt.state_dict()["state"].items()
                for key, value in state.items()
            }
            dcp.save({"model": source.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)

            for mesh in load_meshes:
                what = f"hidden {hidden}, saved at TP={save_mesh.size()}, loaded at " + (
                    "no TP" if mesh is None else f"TP={mesh.size()}"
                )
                torch.manual_seed(1)  # other values everywhere, so nothing passes by accident
                target = MLP(hidden)
                if mesh is not None:
                    target = parallelize_module(target, mesh, PLAN)
                target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
                _fake_step(target, target_opt, 2.0)  # creates the optimizer state to load into
                state = {"model": target.state_dict(), "optim": target_opt.state_dict()}
                dcp.load(state, checkpoint_id=path)
                target.load_state_dict(state["model"])
                target_opt.load_state_dict(state["optim"])
                for key, value in target.state_dict().items():
                    _assert_equal(value, want_model[key], f"{what}: {key}")
                for i, entry in target_opt.state_dict()["state"].items():
                    for key, value in entry.items():
                        _assert_equal(value, want_optim[(i, key)], f"{what}: optimizer state {i}.{key}")
                if hidden % 4 == 0 and mesh is not None:  # even: the loaded TP model runs like the saved one
                    torch.manual_seed(2)
                    x = torch.randn(3, 8)
                    if mesh.size() == save_mesh.size():
                        assert torch.equal(target(x), source(x)), what
                    else:
                        torch.testing.assert_close(target(x), source(x), rtol=1e-5, atol=1e-6, msg=what)


def _cases(line: Any, grid: Any) -> dict[str, tuple[Any, list[Any], tuple[int, ...]]]:
    """Every placement combination hp-dtensor has, on 4 ranks, mostly uneven."""
    return {
        "s0": (line, [Shard(0)], (5, 3)),  # 2, 2, 1, 0 rows: rank 3 holds nothing
        "s1": (line, [Shard(1)], (3, 7)),
        "r": (line, [Replicate()], (3, 3)),
        "scalar": (line, [Replicate()], ()),
        "empty": (line, [Shard(0)], (0, 4)),  # no elements at all: still in the checkpoint
        "s0_s1": (grid, [Shard(0), Shard(1)], (7, 5)),
        "s1_s0": (grid, [Shard(1), Shard(0)], (3, 5)),
        "nested_s1": (grid, [Shard(1), Shard(1)], (3, 7)),  # 7 -> 4 | 3 -> 2, 2 | 2, 1
        "nested_s0": (grid, [Shard(0), Shard(0)], (3, 2)),  # 3 -> 2 | 1 -> 1, 1 | 1, 0
        "nested_gap": (grid, [Shard(0), Shard(0)], (2, 3)),  # 2 -> 1 | 1 -> 1, 0 | 1, 0: empty mid-tensor
        "s1_r": (grid, [Shard(1), Replicate()], (4, 5)),
        "r_s0": (grid, [Replicate(), Shard(0)], (5, 2)),
        "r_r": (grid, [Replicate(), Replicate()], (2, 3)),
        "3d": (grid, [Shard(2), Shard(0)], (3, 2, 5)),
    }


def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + seed / 8).reshape(shape)


RAGGED_ROWS = [3, 0, 1, 2]  # arbitrary per-rank sizes (from_local(shape=...)) of a (6, 4) tensor


def _ragged(rank: int, line: Any, full: torch.Tensor) -> DTensor:
    start = sum(RAGGED_ROWS[:rank])
    local = full[start : start + RAGGED_ROWS[rank]].clone()
    return DTensor.from_local(local, line, [Shard(0)], shape=full.shape)


@pytest.mark.distributed(world_size=4)
def test_plain_dtensor_state_dict_every_layout(rank: int, device_mesh_factory: Any, tmp_path: Any) -> None:
    """A state dict of plain DTensors, uneven, nested, 2-D and ragged, saved and loaded in place."""
    import torch.distributed.checkpoint as dcp

    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("a", "b"))
    path = _shared_path(tmp_path, "plain")
    cases = _cases(line, grid)
    want = {name: _values(shape, 1) for name, (_, _, shape) in cases.items()}
    want["ragged"] = _values((6, 4), 1)
    saved: dict[str, Any] = {
        name: distribute_tensor(want[name], mesh, placements) for name, (mesh, placements, _) in cases.items()
    }
    saved["ragged"] = _ragged(rank, line, want["ragged"])
    assert saved["ragged"].layout_spec.is_ragged()
    dcp.save(saved, checkpoint_id=path)

    # Each piece is written once: replicas share one chunk, empty pieces add none.
    chunks = {k: v.chunks for k, v in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()}
    assert set(chunks) == set(saved), sorted(chunks)
    for name, count in {"r": 1, "r_r": 1, "scalar": 1, "s0": 3, "s1_r": 2, "r_s0": 2, "s0_s1": 4}.items():
        assert len(chunks[name]) == count, (name, chunks[name])
    assert sorted(tuple(c.sizes) for c in chunks["ragged"]) == [(1, 4), (2, 4), (3, 4)]

    loaded: dict[str, Any] = {
        name: distribute_tensor(torch.zeros(shape, dtype=torch.float64), mesh, placements)
        for name, (mesh, placements, shape) in cases.items()
    }
    loaded["ragged"] = _ragged(rank, line, torch.zeros(6, 4, dtype=torch.float64))
    locals_before = {name: value.to_local().data_ptr() for name, value in loaded.items()}
    dcp.load(loaded, checkpoint_id=path)
    for name, value in loaded.items():
        assert value.to_local().data_ptr() == locals_before[name], f"{name}: not loaded in place"
        _assert_equal(value, want[name], name)


@pytest.mark.distributed(world_size=4)
def test_resharded_load(rank: int, device_mesh_factory: Any, tmp_path: Any) -> None:
    """Saved as Shard(0) over 4, nested Shard(1) over 2x2 and ragged; loaded under every other layout."""
    import torch.distributed.checkpoint as dcp

    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("a", "b"))
    path = _shared_path(tmp_path, "reshard")
    want = {"a": _values((7, 5), 2), "b": _values((5, 7), 3), "c": _values((6, 4), 4)}
    dcp.save(
        {
            "a": distribute_tensor(want["a"], line, [Shard(0)]),  # 2, 2, 2, 1 rows
            "b": distribute_tensor(want["b"], grid, [Shard(1), Shard(1)]),
            "c": _ragged(rank, line, want["c"]),
        },
        checkpoint_id=path,
    )
    targets: list[tuple[Any, list[Any]]] = [
        (line, [Shard(1)]),
        (line, [Replicate()]),
        (grid, [Shard(1), Shard(1)]),
        (grid, [Shard(0), Shard(1)]),
        (grid, [Shard(1), Shard(0)]),
        (grid, [Replicate(), Shard(1)]),
        (grid, [Shard(1), Replicate()]),
        (grid, [Shard(0), Shard(0)]),
        (grid, [Replicate(), Replicate()]),
    ]
    for mesh, placements in targets:
        state = {
            key: distribute_tensor(torch.zeros_like(value), mesh, placements) for key, value in want.items()
        }
        dcp.load(state, checkpoint_id=path)
        for key, value in state.items():
            _assert_equal(value, want[key], f"{key} loaded as {placements} on mesh {tuple(mesh.shape)}")
    plain = {key: torch.zeros_like(value) for key, value in want.items()}  # every rank reads everything
    dcp.load(plain, checkpoint_id=path)
    for key, value in plain.items():
        _assert_equal(value, want[key], f"{key} loaded as a plain tensor")


@pytest.mark.distributed(world_size=2)
def test_partial_is_refused_with_the_fix(rank: int, device_mesh_factory: Any, tmp_path: Any) -> None:
    """Partial terms are not the tensor: saving or loading them is an error that says to redistribute."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    mesh = device_mesh_factory((2,))
    partial = DTensor.from_local(torch.ones(2, 3), mesh, [Partial("sum")])
    with pytest.raises(ValueError, match=r"Partial\('sum'\).*redistribute.*Replicate"):
        partial.__create_write_items__("w", partial)
    with pytest.raises(ValueError, match=r"Partial\('sum'\).*redistribute.*Replicate"):
        partial.__create_chunk_list__()
    with pytest.raises(CheckpointException) as raised:  # DCP gathers every rank's error into one
        dcp.save({"w": partial}, checkpoint_id=_shared_path(tmp_path, "partial"))
    errors = [error for error, _ in raised.value.failures.values()]
    assert len(errors) == 2 and all(isinstance(e, ValueError) and "redistribute" in str(e) for e in errors)
    fixed = partial.redistribute(placements=[Replicate()])  # the fix the message names
    path = _shared_path(tmp_path, "fixed")
    dcp.save({"w": fixed}, checkpoint_id=path)
    out = {"w": torch.zeros(2, 3)}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["w"], torch.full((2, 3), 2.0))

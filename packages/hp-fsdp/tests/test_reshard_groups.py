"""``reshard_after_forward=N``: after forward each rank keeps a shard over a group of N ranks.

What each test checks ([Note: reshard to groups of N ranks] in ``hp_fsdp.post_forward``):

* parity with a single-process copy (3 AdamW steps, float64; 10 with ``HP_COMPOSITION=full``) on
  FSDP over 4 ranks and HSDP on a ``(1, 4)`` mesh with ``N = 2``, fused, unfused, shard dim 1, and
  through the setter;
* per step, by group and bytes (``hp_testing.record_collectives``): forward all-gathers run over
  the whole shard group, backward all-gathers over the rank's group of N, with the same payload
  (the unit's padded size) and so ``(N-1)/N`` instead of ``(S-1)/S`` of it moved per rank; the
  reduce-scatters stay on the shard group;
* between forward and backward each rank holds ``S/N`` padded chunks per parameter and the module
  holds its shard; afterwards nothing is held;
* ``1`` and ``S`` behave as False and True (``1`` with a warning, as in FSDP2);
* bad values are refused before anything changes, naming the value and the valid sizes.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Shard
from hp_fsdp import fully_shard
from hp_testing import CollectiveRecord, record_collectives
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build, global_batch, loss_fn, parity, ref_copy, shard_blocks

N_BLOCKS = 3

CONFIGS: dict[str, dict[str, Any]] = {
    "fused": {},
    "unfused": {"comm_fusion": False},
    "shard_dim1": {"shard_placement_fn": lambda p: Shard(p.dim() - 1)},
    "shard_dim1_unfused": {"shard_placement_fn": lambda p: Shard(p.dim() - 1), "comm_fusion": False},
}


# The two ends (fused on dim 0; dim 1 unfused) by default, all four with HP_COMPOSITION=full.
FULL = os.environ.get("HP_COMPOSITION") == "full"
PARITY_CONFIGS = sorted(CONFIGS) if FULL else ["fused", "shard_dim1_unfused"]
# Every step checks loss, gradients and parameters; the second already runs on the kept pieces of
# updated parameters, so a stale or misplaced piece fails by step 2 or 3. Ten with HP_COMPOSITION=full.
PARITY_STEPS = 10 if FULL else 3


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("config", PARITY_CONFIGS)
def test_fsdp_parity_groups_of_2(rank: int, world_size: int, config: str) -> None:
    model = build()
    ref = ref_copy(model)
    shard_blocks(model, reshard_after_forward=2, **CONFIGS[config])
    assert model.reshard_after_forward == 2  # type: ignore[attr-defined]
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=PARITY_STEPS)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("fusion", [True, False])
def test_hsdp_parity_groups_of_2(rank: int, world_size: int, device_mesh_factory: Any, fusion: bool) -> None:
    mesh = device_mesh_factory((1, 4), ("replicate", "shard"))
    model = build()
    ref = ref_copy(model)
    shard_blocks(model, mesh=mesh, reshard_after_forward=2, comm_fusion=fusion)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=PARITY_STEPS)


@pytest.mark.distributed(world_size=4)
def test_setter_parity_and_activation_checkpointing(rank: int, world_size: int) -> None:
    """The setter's int reaches every unit (the root too); a forward re-run in backward uses the pieces."""
    from torch.utils.checkpoint import checkpoint

    model = build()
    ref = ref_copy(model)
    shard_blocks(model)
    model.set_reshard_after_forward(2)  # type: ignore[attr-defined]
    assert all(b.reshard_after_forward == 2 for b in model.blocks)  # type: ignore[attr-defined]
    for blocks in (model.blocks, ref.blocks):
        for block in blocks:
            block.forward = _checkpointed(block.forward, checkpoint)  # type: ignore[method-assign]
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=4)


def _checkpointed(forward: Any, checkpoint: Any) -> Any:
    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)

    return run


# -- communication -------------------------------------------------------------------------------


def _unit_bytes(params: list[nn.Parameter], world: int) -> int:
    """A unit's padded size in bytes: every parameter padded to ``world`` equal chunks of its dim 0."""
    total = 0
    for p in params:
        rows = p.shape[0]
        total += world * -(-rows // world) * (p.numel() // rows) * p.element_size()
    return total


def _step(model: nn.Module, rank: int, world: int, step: int) -> tuple[list[CollectiveRecord], ...]:
    tokens, targets = global_batch(step, world)
    mine = slice(2 * rank, 2 * rank + 2)
    with record_collectives() as log:
        loss = loss_fn(model, tokens[mine], targets[mine])
        forward = list(log)
        held = _held_pieces(model)
        log.clear()
        loss.backward()
        backward = list(log)
    assert not _held_pieces(model), "pieces kept after forward must be used or dropped by backward"
    return forward, backward, held  # type: ignore[return-value]


def _held_pieces(model: nn.Module) -> list[tuple[str, int, int]]:
    """(param, kept elements, padded shard elements) for every param holding a post-forward piece."""
    from hp_fsdp.state import get_state

    out = []
    for module in model.modules():
        state = get_state(module)
        if state is None or state.group is None or state.modules[0] is not module:
            continue
        for p in state.group.params:
            if p.post_forward_data is not None:
                out.append((p.fqn, p.post_forward_data.numel(), p.padded_numel))
    return out


def _gathers(records: list[CollectiveRecord]) -> list[CollectiveRecord]:
    return [r for r in records if r.name == "all_gather_into_tensor"]


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("mesh_shape", [(4,), (1, 4)])
def test_counts_groups_and_bytes(
    rank: int, world_size: int, device_mesh_factory: Any, mesh_shape: tuple[int, ...]
) -> None:
    names = ("dp",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = device_mesh_factory(mesh_shape, names)
    model = build(n_blocks=N_BLOCKS)
    units = [list(block.parameters()) for block in model.blocks]
    in_blocks = {id(p) for unit in units for p in unit}
    units.append([p for p in model.parameters() if id(p) not in in_blocks])
    unit_bytes = sorted(_unit_bytes(unit, world_size) for unit in units)
    shard_blocks(model, mesh=mesh, reshard_after_forward=2)
    everyone = tuple(range(world_size))
    pair = (0, 1) if rank < 2 else (2, 3)
    for step in range(2):
        forward, backward, held = _step(model, rank, world_size, step)
        fwd, bwd = _gathers(forward), _gathers(backward)
        assert [r.group_ranks for r in fwd] == [everyone] * (N_BLOCKS + 1), fwd
        # an explicit int applies to the root too, as in FSDP2: every unit gathers in backward
        assert [r.group_ranks for r in bwd] == [pair] * (N_BLOCKS + 1), bwd
        assert sorted(r.nbytes for r in fwd) == unit_bytes
        assert sorted(r.nbytes for r in bwd) == unit_bytes  # the same payload: the whole padded unit
        moved_fwd = sum(r.nbytes * 3 / 4 for r in fwd)  # ring: (W-1)/W of the payload per rank
        moved_bwd = sum(r.nbytes * 1 / 2 for r in bwd)  # (N-1)/N
        assert moved_bwd == pytest.approx(moved_fwd * 2 / 3)
        reduces = [r for r in backward if r.name == "reduce_scatter_tensor"]
        assert [r.group_ranks for r in reduces] == [everyone] * (N_BLOCKS + 1)
        assert not [r for r in forward if r.name != "all_gather_into_tensor"]
        # between forward and backward: S/N = 2 padded chunks of every parameter, nothing else
        assert len(held) == sum(len(u) for u in units), held
        assert all(kept == 2 * padded for _, kept, padded in held), held
        model.zero_grad()


@pytest.mark.distributed(world_size=4)
def test_module_holds_its_shard_between_forward_and_backward(rank: int, world_size: int) -> None:
    model = build()
    shard_blocks(model, reshard_after_forward=2)
    tokens, targets = global_batch(0, world_size)
    loss = loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
    loss.backward()
    with torch.no_grad():  # no backward can follow: nothing is kept
        model(tokens[:2])
    assert not _held_pieces(model)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("how", ["setter_root_only", "one", "whole_group", "hsdp_2x2_one", "hsdp_2x2_two"])
def test_int_values_that_mean_true_or_false(
    rank: int, world_size: int, device_mesh_factory: Any, how: str
) -> None:
    """``N == S`` is True, ``N == 1`` is False (warned); the setter with ``recurse=False`` hits one unit."""
    mesh = device_mesh_factory((2, 2), ("replicate", "shard")) if how.startswith("hsdp") else None
    model = build(n_blocks=N_BLOCKS)
    everyone = tuple(range(world_size))
    pair = (0, 1) if rank < 2 else (2, 3)
    if how == "setter_root_only":
        shard_blocks(model)
        model.set_reshard_after_forward(2, recurse=False)  # type: ignore[attr-defined]
        expected = [pair] + [everyone] * N_BLOCKS  # the root first, then the blocks (True by default)
    elif how in ("one", "hsdp_2x2_one"):
        with pytest.warns(UserWarning, match=r"reshard_after_forward=1 .*like False"):
            shard_blocks(model, mesh=mesh, reshard_after_forward=1)
        expected = []
    elif how == "whole_group":
        shard_blocks(model, reshard_after_forward=4)
        expected = [everyone] * (N_BLOCKS + 1)
    else:  # HSDP 2x2: the shard dim has 2 ranks, so 2 is True; rows are (0, 1) and (2, 3)
        shard_blocks(model, mesh=mesh, reshard_after_forward=2)
        expected = [pair] * (N_BLOCKS + 1)
    _, backward, held = _step(model, rank, world_size, 0)
    assert [r.group_ranks for r in _gathers(backward)] == expected
    in_blocks = sum(len(list(block.parameters())) for block in model.blocks)
    expected_held = len(list(model.parameters())) - in_blocks if how == "setter_root_only" else 0
    assert len(held) == expected_held, held


# -- bad values ----------------------------------------------------------------------------------


def _untouched(model: nn.Module, before: dict[str, Any]) -> None:
    for name, p in model.named_parameters():
        assert p is before[name] and not isinstance(p, DTensor), name
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


BAD: list[tuple[Any, type[Exception], str]] = [
    (0, ValueError, r"reshard_after_forward=0 .*at least 1.*\[1, 2, 4\]"),
    (-2, ValueError, r"reshard_after_forward=-2 .*at least 1.*\[1, 2, 4\]"),
    (3, ValueError, r"reshard_after_forward=3 .*must divide the 4 ranks.*\[1, 2, 4\]"),
    (8, ValueError, r"reshard_after_forward=8 .*must divide the 4 ranks.*\[1, 2, 4\]"),
    (2.0, TypeError, r"reshard_after_forward=2\.0 is a float; pass True, False, None .* or an int N"),
    ("2", TypeError, r"reshard_after_forward='2' is a str"),
]


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("value,kind,message", BAD, ids=[repr(b[0]) for b in BAD])
def test_bad_values_refused_before_anything_changes(
    rank: int, world_size: int, value: Any, kind: type[Exception], message: str
) -> None:
    model = build()
    before = dict(model.named_parameters())
    with pytest.raises(kind, match=r"fully_shard: " + message):
        fully_shard(model.blocks[0], reshard_after_forward=value)
    _untouched(model, before)
    shard_blocks(model)
    with pytest.raises(kind, match=r"set_reshard_after_forward: " + message):
        model.set_reshard_after_forward(value)  # type: ignore[attr-defined]
    assert all(m.reshard_after_forward is None for m in [model, *model.blocks])  # type: ignore[attr-defined]


@pytest.mark.distributed(world_size=4)
def test_setter_checks_every_unit_before_changing_one(
    rank: int, world_size: int, device_mesh_factory: Any
) -> None:
    """4 suits the root's 4-rank shard dim but not the blocks' 2-rank one: no unit changes."""
    model = build()
    hsdp = device_mesh_factory((2, 2), ("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=hsdp)
    fully_shard(model)
    with pytest.raises(ValueError, match=re.escape("must divide the 2 ranks of the mesh's shard dim")):
        model.set_reshard_after_forward(4)  # type: ignore[attr-defined]
    assert all(m.reshard_after_forward is None for m in [model, *model.blocks])  # type: ignore[attr-defined]
    model.set_reshard_after_forward(2)  # type: ignore[attr-defined]
    assert all(m.reshard_after_forward == 2 for m in [model, *model.blocks])  # type: ignore[attr-defined]


@pytest.mark.distributed(world_size=8)
def test_hsdp_2x4_groups_of_2_and_slices_refused(
    rank: int, world_size: int, device_mesh_factory: Any
) -> None:
    """A real HSDP mesh (2 replicas of 4): groups of 2 inside each row; parity and groups per step.

    And a slice of a larger mesh (``mesh["dp"]`` beside ``tp``), where a rank cannot see the other
    lines to build their groups: refused before anything changes, naming the mesh and the fix.
    """
    mesh = device_mesh_factory((2, 4), ("replicate", "shard"))
    model = build()
    ref = ref_copy(model)
    shard_blocks(model, mesh=mesh, reshard_after_forward=2)
    pair = (rank - rank % 2, rank - rank % 2 + 1)
    row = tuple(range(rank - rank % 4, rank - rank % 4 + 4))
    _, backward, _ = _step(model, rank, world_size, 0)
    assert {r.group_ranks for r in _gathers(backward)} == {pair}
    assert {r.group_ranks for r in backward if r.name == "reduce_scatter_tensor"} == {row}
    model.zero_grad()
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=3)

    sliced = device_mesh_factory((2, 4), ("tp", "dp"))["dp"]
    other = build()
    before = dict(other.named_parameters())
    with pytest.raises(
        NotImplementedError, match=r"reshard_after_forward=2 needs new process groups.*spans 4 of"
    ):
        fully_shard(other, mesh=sliced, reshard_after_forward=2)
    _untouched(other, before)
    fully_shard(other, mesh=sliced, reshard_after_forward=4)  # True: no new group needed

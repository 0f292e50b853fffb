"""DCP checkpoints carried across world sizes: saved by 4 ranks, loaded by 2, and back.

The three tests run in separate worker pools (one per world size), so the loading side is a
different set of processes with a different default process group than the saving side, as on a
cluster that restarts a job on fewer or more nodes. They share one directory through a
module-scoped fixture and form a chain, in file order:

1. 4 ranks train two steps, save model and optimizer state with ``torch.distributed.checkpoint``
   (the ``get_state_dict`` helpers), write the full tensors they saved and then train two more
   steps, recording what the continuation produced;
2. 2 ranks load that checkpoint into a model built from another seed, check every parameter and
   every AdamW state tensor equals the saved full tensor exactly, train the same two steps on the
   same global batches and match the 4-rank continuation; then save from 2 ranks;
3. 4 ranks load the 2-rank checkpoint and check it the same way.

A later test finds the files of an earlier one in the shared directory; run the module whole
(``pytest test_dcp_reshard.py``), a selection that skips the saving test fails with a message
saying so. Under plain ``torchrun`` only one world size exists, so this chain needs the harness
(the library code it tests does not).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import SEQ, build, full, global_batch, loss_fn, shard_blocks

GLOBAL_ROWS = 8  # the same global batch at every world size: 2 rows a rank on 4, 4 rows a rank on 2
CONTINUE = 2  # steps trained after loading, compared with the saving run's own continuation


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: Any) -> str:
    """One directory for every test of the module (fixtures are resolved once, in the pytest process)."""
    return str(tmp_path_factory.mktemp("dcp_reshard"))


def _step(model: Any, opt: Any, step: int, rank: int, world: int) -> float:
    """One AdamW step on this rank's rows of the global batch; returns the mean loss over ranks."""
    import hp_core.collectives as hc

    rows = GLOBAL_ROWS // world
    tokens, targets = global_batch(step, world, per_rank=rows)
    assert tokens.shape == (GLOBAL_ROWS, SEQ)
    local = slice(rank * rows, (rank + 1) * rows)
    loss = loss_fn(model, tokens[local], targets[local])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(hc.all_reduce(loss.detach().clone(), "avg"))


def _fresh(seed: int) -> tuple[Any, Any]:
    model = shard_blocks(build(seed=seed))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full_state(model: Any, opt: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter and optimizer state tensor as a full tensor, keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    out: dict[str, dict[str, torch.Tensor]] = {"model": {k: full(v).clone() for k, v in model_sd.items()}}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            out.setdefault("optim", {})[f"{name}.{key}"] = full(value).clone()
    return out


def _save(model: Any, opt: Any, path: str, rank: int, world: int, first_step: int) -> None:
    """Save a DCP checkpoint, then the full tensors it holds and a recorded continuation (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/ckpt")
    expected: dict[str, Any] = {"saved": _full_state(model, opt), "world": world, "next_step": first_step}
    expected["losses"] = [_step(model, opt, first_step + i, rank, world) for i in range(CONTINUE)]
    expected["after"] = _full_state(model, opt)["model"]
    if rank == 0:
        torch.save(expected, f"{path}/expected.pt")
    dist.barrier()


def _load_and_check(path: str, rank: int, world: int, *, saved_by: int) -> tuple[Any, Any, int]:
    """Load ``path`` into a model built from another seed; check the state and the continuation."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    expected_file = Path(path) / "expected.pt"
    assert expected_file.exists(), (
        f"{expected_file} is missing: the {saved_by}-rank test that saves it did not run first. "
        "Run the whole module: pytest packages/hp-fsdp/tests/test_dcp_reshard.py"
    )
    expected = torch.load(expected_file, weights_only=True)
    assert expected["world"] == saved_by and saved_by != world
    model, opt = _fresh(seed=7)
    before = _full_state(model, opt)["model"]
    assert any(not torch.equal(before[k], v) for k, v in expected["saved"]["model"].items())
    model_sd, optim_sd = get_state_dict(model, opt)  # initialises the optimizer state to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{path}/ckpt")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(model, opt)
    assert loaded["model"].keys() == expected["saved"]["model"].keys()
    assert loaded["optim"].keys() == expected["saved"]["optim"].keys()
    for part in ("model", "optim"):
        for key, value in loaded[part].items():
            wanted = expected["saved"][part][key]
            torch.testing.assert_close(value, wanted, rtol=0, atol=0, msg=f"{part} {key}")
    # Training continues as it did in the saving run: same global batches, a different split over
    # ranks, so only the order of fp64 reductions differs.
    step = expected["next_step"]
    for i, wanted in enumerate(expected["losses"]):
        got = _step(model, opt, step + i, rank, world)
        assert abs(got - wanted) <= 1e-10 * abs(wanted), f"loss of step {step + i}: {got} vs {wanted}"
    for key, value in _full_state(model, opt)["model"].items():
        torch.testing.assert_close(value, expected["after"][key], rtol=1e-9, atol=1e-12, msg=key)
    return model, opt, step + CONTINUE


@pytest.mark.distributed(world_size=4)
def test_1_save_from_4_ranks(rank: int, world_size: int, shared_dir: str) -> None:
    model, opt = _fresh(seed=1)
    for step in range(2):
        _step(model, opt, step, rank, world_size)
    _save(model, opt, f"{shared_dir}/from4", rank, world_size, first_step=2)


@pytest.mark.distributed(world_size=2)
def test_2_load_into_2_ranks_then_save(rank: int, world_size: int, shared_dir: str) -> None:
    model, opt, next_step = _load_and_check(f"{shared_dir}/from4", rank, world_size, saved_by=4)
    _save(model, opt, f"{shared_dir}/from2", rank, world_size, first_step=next_step)


@pytest.mark.distributed(world_size=4)
def test_3_load_into_4_ranks(rank: int, world_size: int, shared_dir: str) -> None:
    _load_and_check(f"{shared_dir}/from2", rank, world_size, saved_by=2)

"""The backend contract in local mode: gloo's rules by default, NCCL's / HCCL's under ``emulate``.

Each body runs in the multi-process mode (the marker's ``backend=``) and in
local mode (``run_local(..., emulate=...)``, which the marker reaches once the
plugin passes its backend on), and plants a mistake the backend's contract
catches: both modes must catch it, with the same error from the same rule.
"""

from __future__ import annotations

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_testing import BackendRuleError
from hp_testing.local import LocalModeFailed, run_local, run_local_outcomes

WORLD = 4


def _nccl_body(rank: int) -> None:
    assert hp_core.get_platform().device_type == "cuda"  # the GPU branch, on CPU tensors
    t = torch.ones(4, dtype=torch.int32)
    with pytest.raises(BackendRuleError, match="reduce op BAND is not supported by nccl"):
        dist.all_reduce(t, op=dist.ReduceOp.BAND)  # planted: refused before anything is sent
    with pytest.raises(BackendRuleError, match="monitored_barrier does not exist on nccl"):
        dist.monitored_barrier()
    # what gloo lacks, emulated with NCCL's result: premul_sum, uneven all_gather
    x = torch.full((3,), float(rank + 1), dtype=torch.float64)
    hp_core.all_reduce(x, op="premul_sum", scale=0.5)
    torch.testing.assert_close(x, torch.full((3,), 0.5 * sum(range(1, WORLD + 1)), dtype=torch.float64))
    pieces = [torch.empty(r + 1) for r in range(WORLD)]
    dist.all_gather(pieces, torch.full((rank + 1,), float(rank)))
    for r, piece in enumerate(pieces):
        torch.testing.assert_close(piece, torch.full((r + 1,), float(r)), rtol=0, atol=0)
    # tags ignored: messages between a pair match in issue order, as on NCCL
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(torch.full((2,), 7.0), peer, tag=0)
    else:
        got = torch.empty(2)
        dist.recv(got, peer, tag=0)
        torch.testing.assert_close(got, torch.full((2,), 7.0), rtol=0, atol=0)


@pytest.mark.distributed(world_size=WORLD, backend="nccl-emu")
def test_nccl_contract_in_the_process_mode(rank: int) -> None:
    _nccl_body(rank)


@pytest.mark.distributed(world_size=WORLD, backend="nccl-emu", mode="local")
def test_nccl_contract_through_the_marker_in_local_mode(rank: int) -> None:
    _nccl_body(rank)


@pytest.mark.distributed(world_size=WORLD, backend="hccl-emu", mode="local")
def test_hccl_contract_through_the_marker_in_local_mode(rank: int) -> None:
    _hccl_body(rank)


def test_nccl_contract_in_local_mode() -> None:
    run_local(_nccl_body, WORLD, emulate="nccl")
    # the layer is gone after the run: torch's own functions and hp_core's own platform again
    assert not hasattr(dist.all_reduce, "__hp_original__")
    assert hp_core.get_platform().device_type == "cpu"


def _hccl_body(rank: int) -> None:
    assert hp_core.get_platform().device_type == "npu"
    with pytest.raises(BackendRuleError, match="reduce op AVG is not supported by hccl"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.AVG)
    t = torch.ones(2)
    hp_core.all_reduce(t, op="avg")  # hp_core emulates it as sum-then-divide, as on a real NPU
    torch.testing.assert_close(t, torch.ones(2))


@pytest.mark.distributed(world_size=WORLD, backend="hccl-emu")
def test_hccl_contract_in_the_process_mode(rank: int) -> None:
    _hccl_body(rank)


def test_hccl_contract_in_local_mode() -> None:
    run_local(_hccl_body, WORLD, emulate="hccl")


def _gloo_body(rank: int) -> None:
    base = torch.ones(4, 4)
    with pytest.raises(BackendRuleError, match="is not contiguous"):
        dist.all_reduce(base[:, 0])  # planted: gloo corrupts the base; refused in both modes
    column = base[:, 0].contiguous()
    dist.all_reduce(column)
    torch.testing.assert_close(column, torch.full((4,), float(WORLD)))


@pytest.mark.distributed(world_size=WORLD)
def test_gloo_rules_in_the_process_mode(rank: int) -> None:
    _gloo_body(rank)


def test_gloo_rules_in_local_mode() -> None:
    run_local(_gloo_body, WORLD)


def test_ranks_disagreeing_in_dtype_fail_every_rank_under_nccl_in_local_mode() -> None:
    def body(rank: int) -> None:
        dist.all_reduce(torch.ones(2, dtype=torch.float64 if rank == 1 else torch.float32))

    outcomes = run_local_outcomes(body, WORLD, emulate="nccl")
    assert not any(o.ok for o in outcomes)
    assert "rank 0: all_reduce(float32(2,), sum); rank 1: all_reduce(float64(2,), sum)" in outcomes[0].error


def test_unknown_emulation_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"emulate must be None, 'nccl' or 'hccl', got 'gloo-emu'"):
        run_local(lambda rank: None, 2, emulate="gloo-emu")
    with pytest.raises(LocalModeFailed, match="BackendRuleError"):
        run_local(lambda rank: dist.recv(torch.empty(1)), 2, emulate="hccl")  # recv without src

"""Checks that need no peers: argument errors, init/teardown on one rank, Work, capabilities, logging."""

from __future__ import annotations

import datetime
import logging
import os
import socket

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_core import (
    BackendCapabilities,
    NotInitializedError,
    StaleMeshError,
    Work,
    get_capabilities,
    init_device_mesh,
    use_capabilities,
)
from hp_core.logging import get_logger, rank_prefix

# Under torchrun every process is a rank whose environment and default group these tests would clobber.
needs_no_group = pytest.mark.skipif(
    dist.is_initialized() or "RANK" in os.environ,
    reason="these tests own the default group and the rank environment; run them without torchrun",
)


def _clear_dist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HP_DEVICE_TYPE"):
        monkeypatch.delenv(name, raising=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- before initialisation --------------------------------------------------------------


@needs_no_group
def test_init_distributed_names_missing_environment(monkeypatch):
    _clear_dist_env(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        RuntimeError, match=r"\['WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\] are not set.*torchrun"
    ):
        hp_core.init_distributed()


@needs_no_group
def test_init_distributed_rejects_inconsistent_rank(monkeypatch):
    _clear_dist_env(monkeypatch)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match=r"RANK=2 and WORLD_SIZE=2 are inconsistent"):
        hp_core.init_distributed()


def test_init_distributed_argument_types():
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta, got int \(30\)"):
        hp_core.init_distributed(timeout=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be a non-empty string"):
        hp_core.init_distributed("")


@needs_no_group
def test_rank_helpers_fall_back_to_environment(monkeypatch):
    _clear_dist_env(monkeypatch)
    assert (hp_core.get_rank(), hp_core.get_world_size(), hp_core.get_local_rank()) == (0, 1, 0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (hp_core.get_rank(), hp_core.get_world_size(), hp_core.get_local_rank()) == (3, 8, 1)


@needs_no_group
def test_mesh_before_init_is_a_clear_error():
    with pytest.raises(
        NotInitializedError, match=r"init_device_mesh needs the default process group.*init_distributed"
    ):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(NotInitializedError, match=r"DeviceMesh needs the default process group"):
        hp_core.DeviceMesh("cpu", [0, 1])


@needs_no_group
def test_collectives_before_init_are_clear_errors():
    with pytest.raises(NotInitializedError, match=r"all_reduce\(\) needs the default process group"):
        hp_core.all_reduce(torch.ones(2))
    with pytest.raises(NotInitializedError, match=r"isend\(\) needs"):
        hp_core.isend(torch.ones(2), 1)


@pytest.mark.parametrize(
    ("shape", "names", "error", "message"),
    [
        (
            (2, 2),
            ("dp",),
            ValueError,
            r"mesh_dim_names=\('dp',\) has 1 name\(s\) but the mesh has 2 dim\(s\)",
        ),
        ((2, 2), ("dp", "dp"), ValueError, r"repeats \['dp'\]"),
        ((4,), "dp", TypeError, r"mesh_dim_names='dp' is a string; pass a tuple of names, e.g. \('dp',\)"),
        ((2, 0), None, ValueError, r"mesh_shape=\(2, 0\) must be a non-empty tuple of positive ints"),
        ((), None, ValueError, r"mesh_shape=\(\) must be"),
        ((2, 2), ("dp", ""), TypeError, "must be non-empty strings"),
    ],
)
def test_init_device_mesh_argument_errors(shape, names, error, message):
    # Argument errors come before the initialisation check, so they need no group.
    with pytest.raises(error, match=message):
        init_device_mesh("cpu", shape, mesh_dim_names=names)


# -- one rank, initialised here ------------------------------------------------------------


@needs_no_group
def test_init_and_destroy_on_one_rank(monkeypatch):
    _clear_dist_env(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    hp_core.init_distributed(timeout=datetime.timedelta(seconds=60))
    try:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        hp_core.init_distributed()  # a second call is a no-op, not an error
        assert hp_core.is_initialized()
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        assert mesh.get_group() is dist.group.WORLD  # the world-spanning line reuses the default group
        t = torch.tensor([2.0])
        assert hp_core.all_reduce(t, "avg") is t and t.item() == 2.0
    finally:
        hp_core.destroy_distributed()
    assert not dist.is_initialized()
    with pytest.raises(StaleMeshError, match=r"build it again with init_device_mesh"):
        mesh.get_group()
    hp_core.destroy_distributed()  # nothing left to destroy: still fine


# -- Work --------------------------------------------------------------------------------


class _Handle:
    def __init__(self) -> None:
        self.waits: list[object] = []

    def wait(self, timeout: object = None) -> bool:
        self.waits.append(timeout)
        return True


def test_work_waits_every_handle_then_post_processes_once():
    handles, calls = [_Handle(), _Handle()], []
    work = Work(handles, lambda: calls.append("post"), "result")
    assert not work.is_completed()
    assert work.wait() == "result"
    assert work.wait() == "result"
    assert calls == ["post"]
    assert [h.waits for h in handles] == [[None], [None]]
    assert work.is_completed()
    assert "done" in repr(work)


def test_work_passes_the_timeout_on():
    handle = _Handle()
    limit = datetime.timedelta(seconds=5)
    Work([handle]).wait(limit)
    assert handle.waits == [limit]


def test_completed_work():
    work = Work.completed(7)
    assert work.is_completed() and work.wait() == 7


# -- capabilities -------------------------------------------------------------------------


def test_capability_table():
    gloo = get_capabilities("gloo")
    assert "premul_sum" not in gloo.reduce_ops and "avg" in gloo.reduce_ops
    assert gloo.all_gather_into_tensor and gloo.reduce_scatter_tensor and gloo.all_to_all_single
    assert "premul_sum" in get_capabilities("NCCL").reduce_ops
    assert "avg" not in get_capabilities("hccl").reduce_ops


def test_unknown_backend_gets_conservative_capabilities():
    caps = get_capabilities("my-backend")
    assert caps.reduce_ops == frozenset({"sum", "max", "min", "product"})
    assert not (caps.all_gather_into_tensor or caps.reduce_scatter_tensor or caps.all_to_all_single)


def test_use_capabilities_restores_the_entry():
    original = get_capabilities("gloo")
    with use_capabilities(BackendCapabilities("gloo")):
        assert not get_capabilities("gloo").reduce_scatter_tensor
    assert get_capabilities("gloo") is original
    with use_capabilities(BackendCapabilities("brand-new")):
        assert get_capabilities("brand-new").backend == "brand-new"
    assert get_capabilities("brand-new") == BackendCapabilities("brand-new")


def test_capabilities_validate_ops():
    with pytest.raises(ValueError, match=r"unknown reduce ops \['mean'\]"):
        BackendCapabilities("x", frozenset({"sum", "mean"}))
    with pytest.raises(ValueError, match="lacks 'sum'"):
        BackendCapabilities("x", frozenset({"max"}))


# -- logging -----------------------------------------------------------------------------


@needs_no_group
def test_logger_prefixes_the_rank(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_prefix() == "[rank 2/4]"
    log = get_logger("hp_core.test")
    with caplog.at_level(logging.INFO, logger="hp_core.test"):
        log.info("step %d", 5)
    assert caplog.messages == ["[rank 2/4] step 5"]


@needs_no_group
def test_logger_restricted_to_ranks(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="hp_core.test"):
        get_logger("hp_core.test", ranks=0).info("only rank 0")
        get_logger("hp_core.test", ranks=[1, 3]).info("ranks 1 and 3")
    assert caplog.messages == ["[rank 1] ranks 1 and 3"]


@needs_no_group
def test_rank_prefix_without_any_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert rank_prefix() == "[rank ?]"

"""Debug logs: one line per redistribution plan built, op rule chosen and fallback taken; none when off.

The tests count calls into torch.distributed or read process-wide loggers, so their ranks
run as processes (``mode="process"``), not as threads of one process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import hp_core
import pytest
import torch
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_dtensor import redistribute as R
from hp_dtensor.ops import dispatch as D


@torch.library.custom_op("hp_debug_log_test::row_max", mutates_args=())
def _row_max(x: torch.Tensor) -> torch.Tensor:
    return x.amax(1)


@_row_max.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0])


@contextmanager
def dtensor_log(level: int) -> Iterator[list[str]]:
    """hp_dtensor's lines at ``level``, from no cached decision or plan (they are logged when made)."""
    D.clear_caches()
    R._PROGRAMS.clear()
    try:
        with hp_core.collect_log_lines("hp_dtensor", level) as lines:
            yield lines
    finally:
        D.clear_caches()


def _work(mesh):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64)
    xd = distribute_tensor(x, mesh, [Shard(0)])
    torch.testing.assert_close((xd * 2).full_tensor(), x * 2)  # a rule; full_tensor: S(0) -> R plan
    with fallback_policy("allow"):
        torch.testing.assert_close(torch.ops.hp_debug_log_test.row_max(xd).full_tensor(), x.amax(1))
    assert xd.redistribute(placements=[Replicate()]).placements == (Replicate(),)


@pytest.mark.distributed(world_size=2, mode="process")
def test_debug_lines_name_plans_rules_and_fallbacks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    with dtensor_log(logging.DEBUG) as lines:
        _work(mesh)
    prefix = f"[rank {rank}/2] "
    assert all(line.startswith(prefix) for line in lines), lines
    plans = [line for line in lines if "redistribute plan (Shard(dim=0),) -> (Replicate(),)" in line]
    assert len(plans) == 1, lines  # built once, then reused: one line
    assert any("aten.mul.Tensor: rule" in line and "chose" in line for line in lines), lines
    fallbacks = [line for line in lines if line.startswith(prefix + "fallback: hp_debug_log_test.row_max")]
    assert len(fallbacks) == 1 and "runs replicated, gathering (6, 4) [S(0)] (96 bytes)" in fallbacks[0], (
        lines
    )


@pytest.mark.distributed(world_size=2, mode="process")
def test_nothing_is_logged_above_debug(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    with dtensor_log(logging.INFO) as lines:
        _work(mesh)
    assert lines == []

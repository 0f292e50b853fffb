"""torch's profiler on a local rank: refused on every rank that starts one, before it starts.

Started on two local ranks at once, torch's profiler killed the process with a
segmentation fault (one Kineto session per process). Each rank that starts
one now gets :class:`hp_testing.ConcurrencyNeededError` naming the
multi-process mode, torch's profiler state is untouched, and the launching
thread profiles as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.autograd.profiler as autograd_profiler
import torch.autograd.profiler_legacy as legacy_profiler
import torch.distributed as dist
from hp_testing import ConcurrencyNeededError, LocalHangError
from hp_testing.local import run_local, run_local_outcomes

PROFILERS: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "torch.profiler.profile": lambda: torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ),
    "scheduled": lambda: torch.profiler.profile(schedule=torch.profiler.schedule(wait=1, warmup=1, active=1)),
    "torch.autograd.profiler.profile": lambda: autograd_profiler.profile(),
    "legacy": lambda: legacy_profiler.profile(),
    "emit_itt": lambda: autograd_profiler.emit_itt(),
}
ENTRIES = (
    (torch.profiler.profile, "start"),
    (autograd_profiler, "_prepare_profiler"),
    (autograd_profiler, "_enable_profiler"),
    (legacy_profiler, "_enable_profiler_legacy"),
)


def _profiled_all_reduce(make: Callable[[], AbstractContextManager[Any]], rank: int) -> torch.Tensor:
    total = torch.tensor([rank + 1.0])
    with make():
        dist.all_reduce(total)
    return total


@pytest.mark.parametrize("name", sorted(PROFILERS))
def test_every_rank_that_starts_a_profiler_is_refused_with_the_process_mode(name: str) -> None:
    originals = [getattr(owner, attr) for owner, attr in ENTRIES]
    outcomes = run_local_outcomes(lambda rank: _profiled_all_reduce(PROFILERS[name], rank), 2)
    for outcome in outcomes:
        assert isinstance(outcome.exception, ConcurrencyNeededError), outcome.error
        text = str(outcome.exception)
        assert 'mode="process"' in text and "hp-run without --local" in text
    # refused before the profiler changed the process's state, and the guards are gone after
    assert not torch.autograd._profiler_enabled() and not autograd_profiler._is_profiler_enabled
    assert [getattr(owner, attr) for owner, attr in ENTRIES] == originals
    with torch.profiler.profile() as prof:  # the launching thread profiles as before
        torch.ones(3).add_(1)
    assert any(event.name == "aten::add_" for event in prof.events())


def test_one_rank_profiling_fails_the_run_without_a_hang() -> None:
    # rank 1 waits in the all_reduce rank 0 never reached: told at once which rank ended, and why
    outcomes = run_local_outcomes(
        lambda rank: (
            _profiled_all_reduce(PROFILERS["torch.profiler.profile"], rank)
            if rank == 0
            else _profiled_all_reduce(contextlib.nullcontext, rank)
        ),
        2,
    )
    assert isinstance(outcomes[0].exception, ConcurrencyNeededError)
    assert isinstance(outcomes[1].exception, LocalHangError)
    assert "rank 0 raised ConcurrencyNeededError" in str(outcomes[1].exception)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.profiler.record_function("step"),  # marks a range only when a profiler runs
        lambda: autograd_profiler.profile(enabled=False),  # ``profile(enabled=args.profile)`` off
    ],
    ids=["record_function", "disabled_profile"],
)
def test_what_starts_no_profiler_runs_on_local_ranks(make: Callable[[], AbstractContextManager[Any]]) -> None:
    totals = run_local(lambda rank: _profiled_all_reduce(make, rank), 4)
    expected = torch.tensor([1.0, 2.0, 3.0, 4.0]).sum(0, keepdim=True)
    for total in totals:
        torch.testing.assert_close(total, expected, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2, mode="local")
def test_the_marker_refuses_a_profiler_on_each_rank(rank: int) -> None:
    with pytest.raises(ConcurrencyNeededError, match='mode="process" on the test\'s marker'):
        _profiled_all_reduce(PROFILERS["torch.profiler.profile"], rank)
    # the refusal left the rank able to go on communicating
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == 1.0

"""Activation swap under MPipe: the MPipe parity test, run with ``swap_policy`` on.

``test_mpipe_distributed.test_mpipe_matches_single_process`` builds its
schedule through the module's ``schedule_for``; here that name is replaced by
a wrapper that adds ``swap_policy=SwapPolicy(min_bytes=0)`` and checks that
the order swaps, so the same model, data and single-process reference (losses,
every gradient, the tower's, the parameters after AdamW) judge the swapped run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hp_pipeline import SwapPolicy

sys.path.insert(0, str(Path(__file__).parent))

import test_mpipe_distributed as mpipe  # a sibling test module, found through sys.path

CASES = ["p4-m6-recompute-load", "p2x2-interleaved-load", "p2-zbv-m5-accumulate-load", "p2-zbh1-m4-load"]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.distributed(world_size=mpipe.CASES[n].p, timeout=90), id=n)
        for n in CASES
    ],
)
def test_mpipe_with_swap_matches_single_process(
    rank: int, world_size: int, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = mpipe.schedule_for

    def with_swap(*args: Any, **kwargs: Any) -> Any:
        schedule = plain(*args, swap_policy=SwapPolicy(min_bytes=0), **kwargs)
        swaps = [s for steps in schedule.order.values() for s in steps if s.type.name == "SWAP_OUT"]
        assert swaps, f"{name}: the order swaps nothing"
        return schedule

    monkeypatch.setattr(mpipe, "schedule_for", with_swap)
    mpipe.test_mpipe_matches_single_process(rank, world_size, name, monkeypatch)

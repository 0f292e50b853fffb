"""The main job's multimodal variant (``examples/multimodal_mpipe.py``, ``bash scripts/demo.sh --mpipe``)
at tiny size on 4 ranks under emulated NCCL.

A vision tower and a text decoder trained under ``ScheduleMPipe`` (in-schedule loading) and
under ``Schedule1F1B`` with the tower on stage 0: both must match one process (float64: to
rounding) at every step and in every parameter at the end, both must have run every step,
MPipe must read each sample once in all while the anchor reads the whole batch on every rank,
and the MPipe timeline must be written.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from multimodal_mpipe import SCHEDULES, Args, ImageCaptions, Sizes, report, train, worst_difference

FLOAT64 = 1e-9  # the runs agree to ~1e-15; a wrong gradient scale or a missed step is far above
STEPS, BATCH, MICRO = 2, 8, 4


@pytest.mark.distributed(world_size=4, backend="nccl-emu", timeout=300)
def test_mpipe_and_1f1b_match_one_process(rank: int, world_size: int, tmp_path: Path) -> None:
    result = train(Args(steps=STEPS, batch=BATCH, microbatches=MICRO, out=str(tmp_path)))
    reference = result["reference"]
    assert len(reference) == STEPS and all(math.isfinite(v) for v in reference), reference
    for name in SCHEDULES:
        run = result[name]
        assert len(run["loss"]) == len(run["step_s"]) == STEPS, (name, run)
        for step, (ours, want) in enumerate(zip(run["loss"], reference, strict=True)):
            assert abs(ours - want) <= FLOAT64, (name, step, ours, want)
        assert run["max_param_diff"] <= FLOAT64, (name, run["max_param_diff"])
    assert worst_difference(result) <= FLOAT64
    assert reference[0] != reference[1], "the model did not train: the parity above would prove nothing"

    # the dataset bytes: each sample read once in all under MPipe, the whole batch per rank by 1F1B
    one_sample = ImageCaptions(1, Sizes()).__getitem__(0)
    sample_bytes = sum(t.numel() * t.element_size() for t in one_sample.values())
    every_sample = STEPS * BATCH * sample_bytes
    mpipe, anchor = result["MPipe"]["bytes_read"], result["1F1B"]["bytes_read"]
    assert anchor == [every_sample] * world_size, anchor
    assert sum(mpipe) == every_sample and all(b == every_sample // world_size for b in mpipe), mpipe
    assert sorted(k for owned in result["owners"] for k in owned) == list(range(MICRO)), result["owners"]
    if rank == 0:
        assert (tmp_path / "timeline-mpipe.svg").read_text().lstrip().startswith("<"), "no SVG timeline"
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            report(result)
        for row in ("step time, median (ms)", f"dataset bytes read, rank {world_size - 1}", "all ranks"):
            assert row in table.getvalue(), table.getvalue()


def test_a_nan_or_a_difference_fails_the_parity_verdict() -> None:
    """``worst_difference`` decides the script's exit code: a NaN anywhere must not read as a pass."""
    clean = {name: {"max_loss_diff": 1e-16, "max_param_diff": 2e-16} for name in SCHEDULES}
    assert worst_difference(clean) == 2e-16
    off = {**clean, "1F1B": {"max_loss_diff": 1e-16, "max_param_diff": 3e-3}}
    assert worst_difference(off) == 3e-3
    nan = {**clean, "MPipe": {"max_loss_diff": float("nan"), "max_param_diff": 0.0}}
    assert not worst_difference(nan) <= FLOAT64

"""The main job (``examples/llama_3d.py``, run by ``bash scripts/demo.sh``) at tiny size on 8 ranks.

Pipeline x FSDP x TP on ``(pp=2, dp=2, tp=2)`` against the same model trained in one process
(rank 0): every step's loss and, at the end, every parameter agree to bf16's precision. Then
the checkpoint saved mid-run is loaded on another layout, ``(pp=2, dp=4, tp=1)``, which must
continue with the uninterrupted run's losses.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from llama_3d import Args, train

BF16 = 2e-2  # bf16 compute on both sides, different reduction orders
STEPS, SAVE_AT = 3, 2


def _args(layout: tuple[int, int, int], out: Path, **kwargs: Any) -> Args:
    return Args(
        layout=layout,
        steps=STEPS,
        global_batch=16,
        per_micro=2,
        lr=3e-3,
        max_norm=1.0,
        save_at=kwargs.get("save_at", 0),
        resume=kwargs.get("resume"),
        out=str(out),
        reference=kwargs.get("reference", False),
    )


@pytest.mark.distributed(world_size=8, timeout=300)
def test_main_job_matches_one_process_and_resumes_on_another_layout(rank: int, tmp_path: Path) -> None:
    first = train(_args((2, 2, 2), tmp_path, save_at=SAVE_AT, reference=True))
    if rank == 0:
        for step, loss in first["loss"].items():
            assert abs(loss - first["reference"][step]) <= BF16, (step, loss, first["reference"][step])
        assert first["max_param_diff"] <= BF16, first["max_param_diff"]
    resumed = train(_args((2, 4, 1), tmp_path, resume=str(tmp_path / "checkpoint")))
    assert sorted(resumed["loss"]) == list(range(SAVE_AT, STEPS)), resumed["loss"]
    for step, loss in resumed["loss"].items():
        assert abs(loss - first["loss"][step]) <= 1e-3, (step, loss, first["loss"][step])

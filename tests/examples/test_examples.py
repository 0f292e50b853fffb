"""Every script in ``examples/`` runs at small size through ``hp-run`` and passes its own parity check.

Each script trains a tiny model a few steps on local CPU ranks, compares itself with a
single-process copy and exits non-zero beyond its tolerance; here we assert the exit code
and the parity lines it prints. The downstream pytest example runs through ``pytester``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HP_RUN = Path(sys.executable).parent / "hp-run"
TIMEOUT_S = 180  # a launch takes 5-40 s on 2 busy cores; a hang must not stall the suite

ALL_SCHEDULES = "GPipe,1F1B,Interleaved1F1B,LoopedBFS,InterleavedZeroBubble,ZBVZeroBubble,DualPipeV"

# script, ranks, extra arguments
CASES = [
    ("fsdp.py", 2, []),
    ("hsdp.py", 4, []),
    ("tensor_parallel.py", 2, []),
    ("fsdp_tp.py", 4, []),
    ("pipeline.py", 2, ["--schedule", ALL_SCHEDULES]),  # every schedule in one launch
    ("pp_fsdp.py", 4, []),
    ("mpipe.py", 2, []),
    ("dcp_reshard.py", 2, []),
]


def run_example(script: str, ranks: int, extra: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        # bare ranks, as under torchrun: the harness's cross-rank checks are tested in hp-testing
        [str(HP_RUN), "-n", str(ranks), "--no-checks", str(EXAMPLES / script), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize(("script", "ranks", "extra"), CASES, ids=[c[0] for c in CASES])
def test_example_runs_and_matches_one_process(script: str, ranks: int, extra: list[str]) -> None:
    result = run_example(script, ranks, extra)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{output[-4000:]}"
    assert "largest difference to one process" in result.stdout, output[-4000:]
    assert "parity: OK" in result.stdout, output[-4000:]


def test_a_wrong_result_fails_loudly() -> None:
    """A tolerance no run can meet must make the launch fail, not print OK."""
    result = run_example("tensor_parallel.py", 2, ["--steps", "1", "--tolerance", "-1"])
    assert result.returncode != 0, result.stdout
    assert "parity: FAILED" in result.stdout, result.stdout + result.stderr


def test_downstream_example_passes_under_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_downstream=(EXAMPLES / "downstream_test_example.py").read_text())
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)

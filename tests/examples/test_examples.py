"""Every script in ``examples/`` runs at small size through ``hp-run`` and passes its own parity check.

Each script trains a tiny model a few steps on local CPU ranks, compares itself with a
single-process copy and exits non-zero beyond its tolerance; here we assert the exit code
and the parity lines it prints. The downstream pytest example runs through ``pytester``.
The launches are independent: they start together when the module does (hp-testing's
``tests/hp_run_jobs.py``), beside the pytester session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "packages" / "hp-testing" / "tests"))
from hp_run_jobs import Job, Jobs, module_jobs  # noqa: E402

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


WRONG_RESULT = ("tensor_parallel.py", 2, ["--steps", "1", "--tolerance", "-1"])


def example_job(script: str, ranks: int, extra: list[str], test: str) -> Job:
    """The launch of one example, as a user types it."""
    return Job(
        # bare ranks, as under torchrun: the harness's cross-rank checks are tested in hp-testing
        [str(HP_RUN), "-n", str(ranks), "--no-checks", str(EXAMPLES / script), *extra],
        (test,),
        ranks=ranks,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest) -> Iterator[Jobs]:
    """Every example launch of this module, started at once (hp-testing's ``tests/hp_run_jobs.py``)."""
    jobs = {
        script: example_job(script, ranks, extra, "test_example_runs_and_matches_one_process")
        for script, ranks, extra in CASES
    }
    jobs["wrong-result"] = example_job(*WRONG_RESULT, "test_a_wrong_result_fails_loudly")
    with module_jobs(request, jobs) as running:
        yield running


def test_downstream_example_passes_under_pytest(pytester: pytest.Pytester, launches: Jobs) -> None:
    del launches  # started first, so the example launches run beside this inner session
    pytester.makepyfile(test_downstream=(EXAMPLES / "downstream_test_example.py").read_text())
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize(("script", "ranks", "extra"), CASES, ids=[c[0] for c in CASES])
def test_example_runs_and_matches_one_process(
    launches: Jobs, script: str, ranks: int, extra: list[str]
) -> None:
    result: subprocess.CompletedProcess[str] = launches.result(script)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{output[-4000:]}"
    assert "largest difference to one process" in result.stdout, output[-4000:]
    assert "parity: OK" in result.stdout, output[-4000:]


def test_a_wrong_result_fails_loudly(launches: Jobs) -> None:
    """A tolerance no run can meet must make the launch fail, not print OK."""
    result = launches.result("wrong-result")
    assert result.returncode != 0, result.stdout
    assert "parity: FAILED" in result.stdout, result.stdout + result.stderr

"""hp-run: the torchrun-style environment, and failure handling that never hangs.

The module's launches are independent: they start together when the module
does (:mod:`hp_run_jobs`), and each test asserts on its own.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hp_testing.launcher import main, rank_env

sys.path.insert(0, str(Path(__file__).parent))
from hp_run_jobs import Job, Jobs, module_jobs

ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://, exactly as under torchrun
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
env = os.environ
print(f"rank={env['RANK']} local={env['LOCAL_RANK']} world={env['WORLD_SIZE']} sum={t.item():g}")
dist.destroy_process_group()
"""


# one write per line (a short pipe write is atomic), so the two ranks' lines cannot interleave
ARGUMENTS = "import sys, os\nsys.stdout.write(f\"{os.environ['RANK']} {sys.argv[1:]}\\n\")\n"

FAILING = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(4)
time.sleep(600)  # rank 0 would wait forever for rank 1
"""


def _script(tmp_path: Path, body: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _hp_run(*args: str, timeout: float = 120, tests: tuple[str, ...] = ()) -> Job:
    n = int(args[args.index("-n") + 1])
    return Job([sys.executable, "-m", "hp_testing.launcher", *args], tests, ranks=n, timeout=timeout)


def test_rank_env_matches_torchrun_names() -> None:
    env = rank_env(2, 4, 29511, base={})
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "2",
        "2",
        "4",
        "4",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29511")
    assert env["OMP_NUM_THREADS"] == "1"
    assert rank_env(0, 1, 1, base={"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


def test_script_runs_on_every_rank(launches: Jobs) -> None:
    proc = launches.result("every-rank")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if "sum=" in line)
    assert lines == [f"[rank{r}]: rank={r} local={r} world=3 sum=6" for r in range(3)]


def test_script_arguments_are_passed_through(launches: Jobs) -> None:
    proc = launches.result("arguments")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["0 ['--lr', '0.1']", "1 ['--lr', '0.1']"]


# What a --no-checks rank has imported when the script starts: nothing of hp-testing or torch.
BARE = """
import os, sys
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"hp_testing", "torch"})
sys.stdout.write(f"{os.environ['RANK']} {sys.argv[1:]} {os.path.basename(sys.path[0])} {loaded}\\n")
"""


def test_a_bare_rank_imports_nothing_it_does_not_need(launches: Jobs) -> None:
    """[Note: a bare rank imports nothing of hp-testing]: a script, and a module run with -m."""
    script = launches.result("bare-script")
    assert script.returncode == 0, script.stderr
    assert sorted(script.stdout.splitlines()) == [f"{r} ['--lr', '0.1'] sub []" for r in (0, 1)]
    module = launches.result("bare-module")
    assert module.returncode == 0, module.stderr
    # -m puts the working directory first on sys.path: the module is found there
    assert sorted(module.stdout.splitlines()) == [f"{r} ['x'] bare []" for r in (0, 1)]


def test_failing_rank_stops_the_others_and_is_named(launches: Jobs) -> None:
    proc = launches.result("failing")
    assert proc.returncode == 4
    assert "rank 1 exited with code 4" in proc.stderr
    assert "stopping ranks [0]" in proc.stderr


def test_bad_arguments_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["-n", "0", str(_script(tmp_path, "pass\n"))])
    assert "-n must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-n", "2", str(tmp_path / "missing.py")])
    assert "does not exist" in capsys.readouterr().err


EMULATED = """
import sys, torch, torch.distributed as dist, hp_core
hp_core.init_distributed()  # asks for nccl: the layer runs it over gloo
platform = hp_core.get_platform()
t = torch.full((2,), float(dist.get_rank() + 1))
dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
print(f"rank={dist.get_rank()} {platform.device_type}/{platform.backend} t={t.tolist()}")
if "bug" in sys.argv and dist.get_rank() == 1:
    dist.broadcast(torch.ones(2), src=0)
else:
    dist.all_reduce(torch.ones(2))
hp_core.destroy_distributed()
"""


def test_emulate_nccl_runs_the_script_on_a_spoofed_platform(launches: Jobs) -> None:
    proc = launches.result("emulate-nccl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank={rank} cuda/nccl t=[1.5, 1.5]" in proc.stdout


def test_emulate_reports_a_mismatch_instead_of_hanging(launches: Jobs) -> None:
    proc = launches.result("emulate-mismatch")
    assert proc.returncode == 1
    assert "CollectiveMismatchError: the ranks of group [0, 1] disagree on collective #1" in proc.stderr
    assert "rank 1: broadcast(tensor 2 torch.float32, root 0)" in proc.stderr


def test_emulate_hccl_applies_hccls_rules(launches: Jobs) -> None:
    proc = launches.result("emulate-hccl")
    assert proc.returncode == 1
    assert "reduce op PREMUL_SUM is not supported by hccl" in proc.stderr


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """Every hp-run launch of this module, started at once (:mod:`hp_run_jobs`)."""
    tmp = tmp_path_factory.mktemp("launcher")
    emulated = str(_script(tmp, EMULATED, "emulated.py"))
    bare = tmp / "bare"
    (bare / "sub").mkdir(parents=True)
    _script(bare / "sub", BARE, "job.py")
    _script(bare, BARE, "jobmod.py")
    bare_test = ("test_a_bare_rank_imports_nothing_it_does_not_need",)
    jobs = {
        "bare-script": replace(
            _hp_run("-n", "2", "--no-checks", "sub/job.py", "--lr", "0.1", tests=bare_test), cwd=bare
        ),
        "bare-module": replace(
            _hp_run("-n", "2", "--no-checks", "-m", "jobmod", "x", tests=bare_test), cwd=bare
        ),
        "every-rank": _hp_run(
            "-n",
            "3",
            "--tag-output",
            str(_script(tmp, ALL_REDUCE, "all_reduce.py")),
            tests=("test_script_runs_on_every_rank",),
        ),
        "arguments": _hp_run(
            "-n",
            "2",
            str(_script(tmp, ARGUMENTS, "arguments.py")),
            "--lr",
            "0.1",
            tests=("test_script_arguments_are_passed_through",),
        ),
        "failing": _hp_run(
            "-n",
            "2",
            "--grace",
            "1",
            str(_script(tmp, FAILING, "failing.py")),
            timeout=60,
            tests=("test_failing_rank_stops_the_others_and_is_named",),
        ),
        "emulate-nccl": _hp_run(
            "-n",
            "2",
            "--emulate",
            "nccl",
            emulated,
            tests=("test_emulate_nccl_runs_the_script_on_a_spoofed_platform",),
        ),
        "emulate-mismatch": _hp_run(
            "-n",
            "2",
            "--emulate",
            "nccl",
            emulated,
            "bug",
            tests=("test_emulate_reports_a_mismatch_instead_of_hanging",),
        ),
        "emulate-hccl": _hp_run(
            "-n", "2", "--emulate", "hccl", emulated, tests=("test_emulate_hccl_applies_hccls_rules",)
        ),
    }
    with module_jobs(request, jobs) as running:
        yield running

"""hp-run: the torchrun-style environment, and failure handling that never hangs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hp_testing.launcher import main, rank_env

ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://, exactly as under torchrun
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
env = os.environ
print(f"rank={env['RANK']} local={env['LOCAL_RANK']} world={env['WORLD_SIZE']} sum={t.item():g}")
dist.destroy_process_group()
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _hp_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hp_testing.launcher", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


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


def test_script_runs_on_every_rank(tmp_path: Path) -> None:
    proc = _hp_run("-n", "3", "--tag-output", str(_script(tmp_path, ALL_REDUCE)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if "sum=" in line)
    assert lines == [f"[rank{r}]: rank={r} local={r} world=3 sum=6" for r in range(3)]


def test_script_arguments_are_passed_through(tmp_path: Path) -> None:
    # one write per line (a short pipe write is atomic), so the two ranks' lines cannot interleave
    body = "import sys, os\nsys.stdout.write(f\"{os.environ['RANK']} {sys.argv[1:]}\\n\")\n"
    script = _script(tmp_path, body)
    proc = _hp_run("-n", "2", str(script), "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["0 ['--lr', '0.1']", "1 ['--lr', '0.1']"]


def test_failing_rank_stops_the_others_and_is_named(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(4)
        time.sleep(600)  # rank 0 would wait forever for rank 1
        """,
    )
    proc = _hp_run("-n", "2", "--grace", "1", str(script), timeout=60)
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


def test_emulate_nccl_runs_the_script_on_a_spoofed_platform(tmp_path: Path) -> None:
    script = _script(tmp_path, EMULATED)
    proc = _hp_run("-n", "2", "--emulate", "nccl", str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank={rank} cuda/nccl t=[1.5, 1.5]" in proc.stdout


def test_emulate_reports_a_mismatch_instead_of_hanging(tmp_path: Path) -> None:
    script = _script(tmp_path, EMULATED)
    proc = _hp_run("-n", "2", "--emulate", "nccl", str(script), "bug")
    assert proc.returncode == 1
    assert "CollectiveMismatchError: the ranks of group [0, 1] disagree on collective #1" in proc.stderr
    assert "rank 1: broadcast(tensor 2 torch.float32, root 0)" in proc.stderr


def test_emulate_hccl_applies_hccls_rules(tmp_path: Path) -> None:
    script = _script(tmp_path, EMULATED)
    proc = _hp_run("-n", "2", "--emulate", "hccl", str(script))
    assert proc.returncode == 1
    assert "reduce op PREMUL_SUM is not supported by hccl" in proc.stderr

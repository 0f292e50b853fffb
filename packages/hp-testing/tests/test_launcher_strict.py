"""hp-run's strict mode: async hazards that plain gloo lets through fail under --emulate.

Each planted bug exits 0 under plain ``hp-run`` (gloo finishes the all-reduce
before anyone looks, or nobody looks at all) and must fail under
``hp-run --emulate nccl``, where strict mode is on by default, with the
collective and its line named.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hp_testing.launcher import _parser, _strict, main

PLANTED = """
import sys, torch, torch.distributed as dist, hp_core
hp_core.init_distributed()
t = torch.ones(2)
work = dist.all_reduce(t, async_op=True)
if sys.argv[1] == "written-early":
    t.zero_()  # reuses the buffer before wait(): on a GPU this races with the all-reduce
    work.wait()
# "never-waited": the work handle is dropped
dist.barrier()
hp_core.destroy_distributed()
print(f"rank {dist.get_rank() if dist.is_initialized() else '-'} finished")
"""

WRITTEN_EARLY = (
    "AsyncHazardError: aten.zero_ at {name}:7 in <module> wrote to the output tensor before its wait(): "
    "all_reduce(tensor 2 torch.float32, op SUM) was issued at {name}:5 in <module> and is still pending"
)
NEVER_WAITED = (
    "AsyncHazardError: async work issued with async_op=True was never waited:\n"
    "  all_reduce(tensor 2 torch.float32, op SUM) at {name}:5 in <module>"
)


def _hp_run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "planted.py"
    script.write_text(textwrap.dedent(PLANTED))
    cmd = [sys.executable, "-m", "hp_testing.launcher", "-n", "2", *args[:-1], str(script), args[-1]]
    full_env = {k: v for k, v in os.environ.items() if k != "HP_RUN_STRICT"}
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=full_env)


def _site_name(tmp_path: Path) -> str:
    return f"{tmp_path.name}/planted.py"


@pytest.mark.parametrize(
    ("bug", "expected"), [("written-early", WRITTEN_EARLY), ("never-waited", NEVER_WAITED)]
)
def test_planted_async_bug_passes_plain_gloo_and_fails_emulated_nccl(
    tmp_path: Path, bug: str, expected: str
) -> None:
    plain = _hp_run(tmp_path, bug)
    assert plain.returncode == 0, plain.stdout + plain.stderr  # gloo hides the bug
    emulated = _hp_run(tmp_path, "--emulate", "nccl", bug)
    assert emulated.returncode == 1, emulated.stdout + emulated.stderr
    assert expected.format(name=_site_name(tmp_path)) in emulated.stderr


@pytest.mark.parametrize(
    ("flag", "emulate", "env", "strict"),
    [
        (None, "nccl", None, True),  # on by default under emulation
        (None, None, None, False),  # plain hp-run stays a torchrun look-alike
        (False, "nccl", None, False),  # --no-strict
        (None, "hccl", "0", False),
        (None, None, "yes", True),
        (True, None, "0", True),  # the flag wins over the environment
    ],
)
def test_strict_flag_environment_and_default(
    monkeypatch: pytest.MonkeyPatch, flag: bool | None, emulate: str | None, env: str | None, strict: bool
) -> None:
    if env is None:
        monkeypatch.delenv("HP_RUN_STRICT", raising=False)
    else:
        monkeypatch.setenv("HP_RUN_STRICT", env)
    assert _strict(flag, emulate, _parser()) is strict


def test_strict_by_environment_reaches_the_ranks(tmp_path: Path) -> None:
    off = _hp_run(tmp_path, "--emulate", "nccl", "--no-strict", "never-waited")
    assert off.returncode == 0, off.stdout + off.stderr
    # Without --emulate: the layer under gloo's own rules, strict because it was asked for.
    on_by_env = _hp_run(tmp_path, "never-waited", env={"HP_RUN_STRICT": "1"})
    assert on_by_env.returncode == 1, on_by_env.stdout + on_by_env.stderr
    assert NEVER_WAITED.format(name=_site_name(tmp_path)) in on_by_env.stderr


def test_a_bad_strict_environment_value_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    monkeypatch.setenv("HP_RUN_STRICT", "maybe")
    with pytest.raises(SystemExit):
        main(["-n", "1", "--emulate", "nccl", str(script)])
    assert "HP_RUN_STRICT='maybe' is neither yes nor no; set it to 1 or 0" in capsys.readouterr().err

"""hp-run's strict mode: async hazards that plain gloo lets through fail under --emulate.

Each planted bug exits 0 under plain ``hp-run`` (gloo finishes the all-reduce
before anyone looks, or nobody looks at all) and must fail under
``hp-run --emulate nccl``, where strict mode is on by default, with the
collective and its line named. The module's launches are independent: they
start together when the module does (:mod:`hp_run_jobs`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hp_testing.launcher import _parser, _strict, main

sys.path.insert(0, str(Path(__file__).parent))
from hp_run_jobs import Job, Launched, launcher_job, module_jobs, planted_script

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


def _hp_run(script: Path, test: str, *args: str, env: dict[str, str] | None = None) -> Job:
    return launcher_job(2, *args[:-1], str(script), args[-1], tests=(test,), env=env)


BUGS = ("written-early", "never-waited")


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    """Every hp-run launch of this module, started at once (:mod:`hp_run_jobs`)."""
    script, name = planted_script(tmp_path_factory, "strict", PLANTED)
    planted = "test_planted_async_bug_passes_plain_gloo_and_fails_emulated_nccl"
    by_env = "test_strict_by_environment_reaches_the_ranks"
    jobs = {}
    for bug in BUGS:
        jobs[f"plain-{bug}"] = _hp_run(script, planted, bug)
        jobs[f"emulated-{bug}"] = _hp_run(script, planted, "--emulate", "nccl", bug)
    jobs["off"] = _hp_run(script, by_env, "--emulate", "nccl", "--no-strict", "never-waited")
    jobs["on-by-env"] = _hp_run(script, by_env, "never-waited", env={"HP_RUN_STRICT": "1"})
    with module_jobs(request, jobs) as running:
        yield running, name


@pytest.mark.parametrize(("bug", "expected"), list(zip(BUGS, [WRITTEN_EARLY, NEVER_WAITED], strict=True)))
def test_planted_async_bug_passes_plain_gloo_and_fails_emulated_nccl(
    launches: Launched, bug: str, expected: str
) -> None:
    jobs, name = launches
    plain = jobs.result(f"plain-{bug}")
    assert plain.returncode == 0, plain.stdout + plain.stderr  # gloo hides the bug
    emulated = jobs.result(f"emulated-{bug}")
    assert emulated.returncode == 1, emulated.stdout + emulated.stderr
    assert expected.format(name=name) in emulated.stderr


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


def test_strict_by_environment_reaches_the_ranks(launches: Launched) -> None:
    jobs, name = launches
    off = jobs.result("off")
    assert off.returncode == 0, off.stdout + off.stderr
    # Without --emulate: the layer under gloo's own rules, strict because it was asked for.
    on_by_env = jobs.result("on-by-env")
    assert on_by_env.returncode == 1, on_by_env.stdout + on_by_env.stderr
    assert NEVER_WAITED.format(name=name) in on_by_env.stderr


def test_a_bad_strict_environment_value_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    monkeypatch.setenv("HP_RUN_STRICT", "maybe")
    with pytest.raises(SystemExit):
        main(["-n", "1", "--emulate", "nccl", str(script)])
    assert "HP_RUN_STRICT='maybe' is neither yes nor no; set it to 1 or 0" in capsys.readouterr().err

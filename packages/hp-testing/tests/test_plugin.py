"""The distributed marker end to end: inner pytest sessions with planted bugs.

Each test runs a small pytest session in this process (``pytester``) whose
tests use ``@pytest.mark.distributed`` and checks what a user would see.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import pytest

HEADER = "import os\nimport pytest\nimport torch\nimport torch.distributed as dist\n"


def _write(pytester: pytest.Pytester, body: str, name: str = "test_inner") -> None:
    pytester.makepyfile(**{name: HEADER + textwrap.dedent(body)})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collective_passes_on_every_world_size(pytester: pytest.Pytester, world: int) -> None:
    _write(
        pytester,
        f"""
        @pytest.mark.distributed(world_size={world})
        def test_sum(rank, world_size):
            assert world_size == {world}
            assert dist.get_rank() == rank and dist.get_world_size() == {world}
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == {world} * ({world} + 1) / 2
        """,
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_failing_rank_is_named_with_its_traceback(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2)
        def test_bad(rank):
            print(f"hello from {rank}")
            assert rank == 0, f"rank {rank} disagrees"

        @pytest.mark.distributed(world_size=2)
        def test_next_is_clean(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*failed on rank(s) [[]1[]]*",
            "*rank 1 failed*",
            "*assert rank == 0*",
            "*rank 1 disagrees*",
            "*Captured stdout rank 1*",
            "hello from 1",
        ]
    )
    assert "rank 0 failed" not in result.stdout.str()


def test_hang_prints_stack_then_pool_recovers(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2, timeout=2, checks=False)
        def test_hangs(rank):
            if rank == 1:
                dist.all_reduce(torch.ones(1))  # rank 0 never joins

        @pytest.mark.distributed(world_size=2)
        def test_after_hang(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank(s) [[]1[]] still running after the 2 s timeout*",
            "*rank 1 hung; its Python stack*",
            "*test_inner.py*line 9 in test_hangs*",
        ]
    )


def test_rank_failure_stops_blocked_peers_within_seconds(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2, timeout=600, checks=False)
        def test_raises_while_peer_waits(rank):
            if rank == 0:
                raise ValueError("boom on rank 0")
            dist.all_reduce(torch.ones(1))

        @pytest.mark.distributed(world_size=2)
        def test_after(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "ValueError: boom on rank 0" in out
    assert "rank(s) [1] stopped answering after the failure" in out
    assert "still running after the 600 s timeout" not in out


def test_dead_rank_is_reported_with_exit_code(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2)
        def test_exits(rank):
            if rank == 1:
                os._exit(7)

        @pytest.mark.distributed(world_size=2)
        def test_after(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank(s) [[]1[]] died*", "*exited with code 7*"])


def test_fixtures_and_parametrize_reach_the_ranks(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.fixture
        def scale():
            return 3

        @pytest.mark.distributed(world_size=2)
        @pytest.mark.parametrize("k", [1, 5])
        def test_params(rank, world_size, k, scale, tmp_path):
            (tmp_path / f"rank{rank}").write_text(str(k * scale))
            dist.barrier()
            seen = sorted(p.read_text() for p in tmp_path.iterdir())
            assert seen == [str(k * scale)] * world_size

        class TestInClass:
            @pytest.mark.distributed(world_size=2)
            def test_method(self, rank):
                t = torch.tensor([float(rank)])
                dist.broadcast(t, src=1)
                assert t.item() == 1.0
        """,
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=3)


def test_state_does_not_leak_between_tests(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        import torch.distributed.distributed_c10d as c10d

        HERE = os.path.dirname(os.path.abspath(__file__))

        @pytest.mark.distributed(world_size=2)
        def test_a_dirty(rank, monkeypatch):
            monkeypatch.setattr(dist, "new_group", None)  # undone in the rank, not only in pytest
            monkeypatch.setenv("HP_PATCHED", "1")
            with open(os.path.join(HERE, f"rng{rank}"), "w") as f:
                f.write(repr(torch.rand(1).item()))
            torch.rand(100)
            os.environ["HP_LEAK"] = "1"
            torch.set_default_dtype(torch.float64)
            monkeypatch.undo()
            dist.new_group([0, 1])
            monkeypatch.setattr(dist, "new_group", None)

        @pytest.mark.distributed(world_size=2)
        def test_b_clean(rank):
            assert dist.new_group is not None, "test_a's monkeypatch is still applied in the rank"
            assert "HP_PATCHED" not in os.environ
            assert "HP_LEAK" not in os.environ
            assert torch.get_default_dtype() == torch.float32
            assert len(c10d._world.pg_map) == 1, "the group test_a made is still alive"
            with open(os.path.join(HERE, f"rng{rank}")) as f:
                first_draw_of_a = f.read()
            assert repr(torch.rand(1).item()) == first_draw_of_a, "RNG state leaked from test_a"
        """,
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_destroyed_default_group_is_rebuilt(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2)
        def test_destroys(rank):
            dist.destroy_process_group()

        @pytest.mark.distributed(world_size=2)
        def test_after(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """,
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_usage_errors_are_clear(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        def test_rank_without_marker(rank):
            pass

        @pytest.mark.distributed(world_size=0)
        def test_zero(rank):
            pass

        @pytest.mark.distributed(world_size=2, backend="mpi")
        def test_backend(rank):
            pass

        @pytest.mark.distributed(world_size=2)
        def test_unpicklable(rank, lock):
            pass

        @pytest.fixture
        def lock():
            import threading
            return threading.Lock()
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    out = result.stdout.str()
    assert result.ret != 0
    assert "only exists in tests marked @pytest.mark.distributed" in out
    assert "world_size must be an int >= 1, got 0" in out
    assert "unknown backend 'mpi'" in out


def test_unpicklable_fixture_names_the_fixture(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.fixture
        def lock():
            import threading
            return threading.Lock()

        @pytest.mark.distributed(world_size=2)
        def test_unpicklable(rank, lock):
            pass
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*fixture 'lock' returned lock, which cannot be sent to the ranks*"])


def test_exitfirst_stops_after_first_failure(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2)
        def test_1(rank):
            assert False

        @pytest.mark.distributed(world_size=2)
        def test_2(rank):
            pass
        """,
    )
    pytester.runpytest("-x", "-p", "no:cacheprovider").assert_outcomes(failed=1)


def test_no_rank_process_outlives_the_session(
    pytester: pytest.Pytester, rank_processes: Callable[[], list[int]]
) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=4, timeout=2, checks=False)
        def test_hang(rank):
            if rank == 3:
                dist.all_reduce(torch.ones(1))

        @pytest.mark.distributed(world_size=2)
        def test_ok(rank):
            pass
        """,
    )
    before = set(rank_processes())  # the outer session's own pools, if any
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, failed=1)
    left = set(rank_processes()) - before
    assert left == set(), f"rank processes {sorted(left)} outlived the inner session"


def test_forked_mode_runs_each_test_in_its_own_pool(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2)
        def test_sum(rank):
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == 3

        @pytest.mark.distributed(world_size=2)
        def test_fails(rank):
            assert rank == 1
        """,
    )
    result = pytester.runpytest_subprocess("--forked", "-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 0 failed*"])


def test_same_tests_run_under_plain_torchrun(pytester: pytest.Pytester) -> None:
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=2)
        def test_sum(rank, world_size, device_mesh_factory):
            assert rank == int(os.environ["RANK"]) and world_size == 2
            mesh = device_mesh_factory((2,), ("dp",))
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t, group=mesh.get_group("dp"))
            assert t.item() == 3

        @pytest.mark.distributed(world_size=4)
        def test_needs_four(rank):
            pass
        """,
    )
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        str(pytester.path / "test_inner.py"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=pytester.path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("1 passed, 1 skipped") == 2, out
    assert "needs world_size=4; this launch has WORLD_SIZE=2" in out


def test_backend_from_the_environment(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(
        pytester,
        """
        import hp_core

        @pytest.mark.distributed(world_size=2)
        def test_default_backend(rank):
            assert hp_core.get_platform().device_type == "npu"

        @pytest.mark.distributed(world_size=2, backend="gloo")
        def test_marker_wins(rank):
            assert hp_core.get_platform().device_type == "cpu"
        """,
    )
    monkeypatch.setenv("HP_TEST_BACKEND", "hccl-emu")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    monkeypatch.setenv("HP_TEST_BACKEND", "tpu-emu")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*unknown backend 'tpu-emu' (from $HP_TEST_BACKEND)*"])


def test_backend_semantics_seam_in_hp_core() -> None:
    from hp_core.capabilities import set_backend_semantics

    assert set_backend_semantics("gloo", "nccl") is None
    try:
        assert set_backend_semantics("gloo", "hccl") == "nccl"
    finally:
        assert set_backend_semantics("gloo", None) == "hccl"
    assert set_backend_semantics("gloo", None) is None


def test_pools_fork_in_the_order_the_tests_use_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first test waits only for its own pool: forked first, its ranks are not queued behind
    # a larger pool's at the forkserver (the largest pool used to fork first, whatever ran first).
    from hp_testing.pool import WorkerPool

    started: list[int] = []
    start = WorkerPool.start

    def recording_start(self: WorkerPool) -> None:
        started.append(self.world_size)
        start(self)

    monkeypatch.setattr(WorkerPool, "start", recording_start)
    _write(
        pytester,
        """
        @pytest.mark.distributed(world_size=1)
        def test_first(rank):
            pass

        @pytest.mark.distributed(world_size=2)
        def test_second(rank):
            pass
        """,
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    assert started == [1, 2]


def test_session_end_stops_every_pool_before_waiting_for_any() -> None:
    # Ranks wind down (destroying their groups) side by side, not one pool after another.
    from hp_testing.plugin import HarnessSession

    events: list[tuple[str, int]] = []

    class Pool:
        def __init__(self, world: int) -> None:
            self.world = world

        def request_stop(self) -> None:
            events.append(("stop", self.world))

        def shutdown(self) -> None:
            events.append(("wait", self.world))

    session = HarnessSession(config=None)  # type: ignore[arg-type]
    session.pools = {(2, "gloo"): Pool(2), (4, "gloo"): Pool(4)}  # type: ignore[dict-item]
    session.shutdown()
    assert events == [("stop", 2), ("stop", 4), ("wait", 2), ("wait", 4)]
    assert session.pools == {}


def test_collection_runs_with_older_objects_frozen_and_unfreezes_them(pytester: pytest.Pytester) -> None:
    # [Note: collecting beside torch's heap]: imports during collection skip walking torch's objects;
    # the tests run with nothing frozen (so nothing is kept alive), and a freeze of the user's stays.
    import gc

    pytester.makepyfile(
        test_inner="""
        import gc

        FROZEN_WHILE_COLLECTED = gc.get_freeze_count() > 0

        def test_frozen_only_while_collecting():
            assert FROZEN_WHILE_COLLECTED
            assert gc.get_freeze_count() == 0
        """
    )
    assert gc.get_freeze_count() == 0
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)

    pytester.makeconftest("import gc\n\ngc.freeze()  # the user's own, before collection\n")
    pytester.makepyfile(
        test_inner="""
        import gc

        def test_the_users_freeze_stays():
            assert gc.get_freeze_count() > 0
        """
    )
    try:
        pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    finally:
        gc.unfreeze()  # the inner conftest froze this very process

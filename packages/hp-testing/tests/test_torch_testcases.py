"""torch's own multi-process test classes, unchanged, run on hp-testing's pool (inner pytest sessions).

The inner files are written as downstream repositories write them: subclasses of
``MultiProcessTestCase``, ``DTensorTestBase`` and ``MultiProcContinuousTest``
with ``init_process_group`` on a file store, ``@with_comms``, ``self.rank``,
``self.assertEqual``, ``@skip_if_lt_x_gpu``, ``instantiate_parametrized_tests``
and subtests. Each rank records its pid, which tells pooled ranks (the same
processes test after test) from torch's (spawned per test).

Three inner sessions keep this file cheap: every session forks fresh ranks (from
a forkserver that has torch's test harness imported, or else imports it).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

# Imported here, before any inner session: pytester forgets the modules an inner session imported,
# and torch's harness cannot be imported twice in one process (it registers torch libraries).
import torch.testing._internal.common_distributed
import torch.testing._internal.distributed._tensor.common_dtensor  # noqa: F401
from hp_testing import pool

HEADER = """
import gc
import sys

# True in a rank forked from a forkserver that preloaded torch's harness (before this module imports it).
PRELOADED = "torch.testing._internal.common_distributed" in sys.modules

import os
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    MultiProcessTestCase,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

PIDS = {pids!r}


def record(test, rank):
    # a spawned forkserver runs "python -c 'from multiprocessing.forkserver import main...'"
    with open(f"/proc/{{os.getppid()}}/cmdline") as f:
        server = "spawned" if "forkserver import main" in f.read() else "forked"
    frozen = gc.get_freeze_count() > 0  # what the forkserver froze before forking this rank
    with open(PIDS, "a") as f:
        f.write(f"{{test}} {{rank}} {{os.getpid()}} {{PRELOADED}} {{server}} {{frozen}}\\n")
"""

SPAWNED = """
class Spawned(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        os.environ["SET_IN_SETUP"] = "yes"  # spawned ranks inherit it; so do pooled ones
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        if os.path.exists(self.file_name):  # a FileStore removes its file once every rank is done
            os.remove(self.file_name)

    def _init(self):
        dist.init_process_group(
            "gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=self.world_size
        )

    def test_all_reduce(self):
        self._init()
        record("all_reduce", self.rank)
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        self.assertEqual(t, torch.tensor([3.0]))
        self.assertEqual(os.environ["SET_IN_SETUP"], "yes")
        dist.destroy_process_group()

    def test_store_and_subtests(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        record("subtests", self.rank)
        for scale in (1.0, 2.0):
            with self.subTest(scale=scale):
                t = torch.full((3,), scale * (self.rank + 1))
                dist.all_reduce(t)
                self.assertEqual(t, torch.full((3,), 3.0 * scale))

    def test_fails_on_rank_1(self):
        self._init()
        self.assertEqual(self.rank, 0, msg=f"rank {self.rank} disagrees")

    def test_subtest_fails_on_rank_1(self):
        self._init()
        for scale in (1.0, 2.0, 3.0):
            with self.subTest("scaled", scale=scale):
                t = torch.full((2,), scale)
                dist.all_reduce(t)
                got = t[0].item() - (self.rank == 1 and scale == 2.0)  # wrong on one rank, one subtest
                self.assertEqual(got, 2.0 * scale, msg=f"rank {self.rank} summed {got}")

    @skip_if_lt_x_gpu(2)
    def test_needs_two_gpus(self):
        raise AssertionError("runs only with 2 GPUs")

    def test_asks_for_nccl(self):
        dist.init_process_group("nccl", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)

    @parametrize("k", [1, 3])
    def test_parametrized(self, k):
        self._init()
        t = torch.full((2,), float(k))
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((2,), 2.0 * k))


instantiate_parametrized_tests(Spawned)


class Continuous(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"

    def test_sum(self):
        record("continuous", self.rank)
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 3.0)
        self.assertIs(self.pg, dist.distributed_c10d._get_default_group())

    def test_subtest_fails_on_rank_0(self):
        for k in (1, 2):
            with self.subTest(k=k):
                self.assertNotEqual((self.rank, k), (0, 2))


class NcclContinuous(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "nccl"

    def test_skipped_without_nccl(self):
        raise AssertionError("needs NCCL")
"""

DTENSOR = """
import hp_dtensor
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


def reference():
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    (x @ w).sin().sum().backward()
    return x, w


class TorchDTensor(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_sharded_matmul_matches_one_process(self):
        record("dtensor", self.rank)
        x, w = reference()
        mesh = self.build_device_mesh()
        dx = distribute_tensor(x.detach().clone(), mesh, [Shard(0)]).requires_grad_()
        dw = distribute_tensor(w.detach().clone(), mesh, [Shard(1)]).requires_grad_()
        out = dx @ dw
        out.sin().sum().backward()
        self.assertEqual(out.full_tensor(), x.detach() @ w.detach(), rtol=0, atol=1e-12)
        self.assertEqual(dx.grad.full_tensor(), x.grad, rtol=0, atol=1e-12)
        self.assertEqual(dw.grad.full_tensor(), w.grad, rtol=0, atol=1e-12)


class HpDTensor(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_hp_dtensor_on_the_torch_mesh(self):
        x, w = reference()
        mesh = self.build_device_mesh()
        dx = hp_dtensor.distribute_tensor(x.detach().clone(), mesh, [hp_dtensor.Shard(0)]).requires_grad_()
        dw = hp_dtensor.distribute_tensor(w.detach().clone(), mesh, [hp_dtensor.Replicate()]).requires_grad_()
        out = dx @ dw
        out.sin().sum().backward()
        self.assertEqual(out.full_tensor(), x.detach() @ w.detach(), rtol=0, atol=1e-12)
        self.assertEqual(dx.grad.full_tensor(), x.grad, rtol=0, atol=1e-12)
        self.assertEqual(dw.grad.full_tensor(), w.grad, rtol=0, atol=1e-12)
"""

HAZARD = """
class NcclHazard(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_bitwise_and(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2)
        flags = torch.tensor([3, 5], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.BAND)  # gloo has it; NCCL has no bitwise reductions
        self.assertEqual(flags, torch.tensor([3, 5]))
"""

# The user's conftest chooses the backend per class from outside it: the class stays unchanged.
HAZARD_CONFTEST = """
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.cls is not None and item.cls.__name__ == "NcclHazard":
            item.add_marker(pytest.mark.distributed(backend="nccl-emu"))
"""


def _pids(path: Path) -> tuple[dict[str, dict[int, int]], set[str], set[str], set[str]]:
    """test -> rank -> pid; whether each rank found torch's harness preloaded; how its forkserver
    began; whether the objects it inherited were frozen."""
    seen: dict[str, dict[int, int]] = {}
    preloaded, servers, frozen = set(), set(), set()
    for line in path.read_text().splitlines():
        test, rank, pid, loaded, server, froze = line.split()
        seen.setdefault(test, {})[int(rank)] = int(pid)
        preloaded.add(loaded)
        servers.add(server)
        frozen.add(froze)
    return seen, preloaded, servers, frozen


def test_torch_classes_run_unchanged_on_pooled_ranks(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pids = tmp_path / "pids.txt"
    header = HEADER.format(pids=str(pids))
    pytester.makepyfile(
        test_classes=header + textwrap.dedent(SPAWNED) + textwrap.dedent(DTENSOR),
        test_hazard=header + textwrap.dedent(HAZARD),
    )
    pytester.makeconftest(HAZARD_CONFTEST)
    outer_pools = bool(pool._LIVE_POOLS)  # this outer session's own pools, in a full suite run
    # An earlier test's pool left its store's thread in this process: a fork could copy a held lock,
    # so the forkserver is spawned (with the harness preloaded all the same).
    forkable = not outer_pools and pool._os_threads() == pool._THREADS_AT_IMPORT
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=7, failed=5, skipped=2)
    out = result.stdout.str()

    # Pooled: every test ran on the same two rank processes, forked with torch's harness imported.
    seen, preloaded, servers, frozen = _pids(pids)
    assert set(seen) == {"all_reduce", "subtests", "continuous", "dtensor"}
    assert all(sorted(ranks) == [0, 1] for ranks in seen.values())
    for rank in (0, 1):
        assert len({ranks[rank] for ranks in seen.values()}) == 1, seen
    # The forkserver restarts with torch's harness preloaded unless a pool has live ranks (they
    # would die with it): then each rank imports the harness itself.
    assert preloaded == ({"False"} if outer_pools else {"True"})
    # ... forked from this process's image, which has imported the harness already, instead of a new
    # interpreter importing torch and it again ([Note: a forkserver forked from the pytest process]).
    assert servers == ({"forked"} if forkable else {"spawned"})
    # ... which froze what it inherited, so the ranks' collections never walk (and copy) torch's heap.
    assert frozen == ({"True"} if forkable else {"False"})
    result.stdout.fnmatch_lines(["*hp-testing: 6 torch test class(es) ran on pooled ranks*"])

    # Joining a group the pool cannot serve says so, with the way out; a class whose backend
    # is missing is skipped as torch skips it, with the emulation that would run it.
    result.stdout.fnmatch_lines(
        [
            "*init_process_group(backend='nccl') in a test pooled by hp-testing: its ranks run gloo*"
            "HP_TEST_BACKEND=nccl-emu runs it over emulated NCCL on CPU*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["SKIPPED*Backend 'nccl' is not available (HP_TEST_BACKEND=nccl-emu runs it on CPU)*"]
    )

    # A failing assertion names its rank, with the rank's traceback and message.
    result.stdout.fnmatch_lines(
        [
            "*Spawned.test_fails_on_rank_1*",
            "*failed on rank(s) [[]1[]]*",
            "*rank 1 failed*",
            "*self.assertEqual(self.rank, 0*",
            "*rank 1 disagrees*",
        ]
    )
    failing = out.split("Spawned.test_fails_on_rank_1 _")[1].split("\n____")[0]
    assert "rank 1 failed" in failing and "rank 0 failed" not in failing
    # A failing subTest is named in the rank's report, and the rank stops there, as under torch.
    failing = out.split("Spawned.test_subtest_fails_on_rank_1 _")[1].split("\n____")[0]
    rank1 = failing.split("-- rank 1 failed --")[-1]
    assert "rank 1 summed 3.0" in rank1, failing
    assert "(in subTest [scaled] (scale=2.0) of test_subtest_fails_on_rank_1)" in rank1, failing
    assert "rank 1 failed while rank 0 waited for it in all_reduce" in failing  # scale=3.0's
    failing = out.split("Continuous.test_subtest_fails_on_rank_0 _")[1].split("\n____")[0]
    assert "rank 0 failed" in failing and "(in subTest (k=2) of test_subtest_fails_on_rank_0)" in failing
    # @skip_if_lt_x_gpu exits with torch's skip code in the rank: a skip, with torch's reason.
    result.stdout.fnmatch_lines(["SKIPPED*Need at least 2 CUDA devices (exit code 77)*"])

    # The planted NCCL hazard: gloo would run BAND; the emulated NCCL backend refuses it.
    result.stdout.fnmatch_lines(
        [
            "*NcclHazard.test_bitwise_and*",
            "*over nccl-emu: failed on rank(s) [[]0, 1[]]*",
            "*reduce op BAND is not supported by nccl*",
        ]
    )


UNPOOLABLE = """
import os
import pytest
import torch
from torch.testing._internal.common_distributed import MultiProcessTestCase


class InProcess(MultiProcessTestCase):
    # Runs the body in the parent, as torch's LocalDTensorTestBase does: nothing to pool.
    def join_or_run(self, fn):
        return fn

    def test_runs_in_pytest_process(self):
        self.assertEqual(self.rank, self.MAIN_PROCESS_RANK)
        self.assertEqual(os.getpid(), {pytest_pid})


class ExitCodes(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self.special_return_code_checks[self.test_never_spawns] = 0

    def test_never_spawns(self):
        pass


@pytest.mark.torch_harness  # kept on torch's harness: the plugin says nothing about it
class Marked(MultiProcessTestCase):
    def test_torch_way(self):
        raise AssertionError("torch runs no rank: setUp never spawns")


class NoSpawn(MultiProcessTestCase):
    # setUp never spawns: torch runs no rank and passes; the pool does the same and says so.
    @property
    def world_size(self):
        return 2

    def test_body_runs_nowhere(self):
        raise AssertionError("no rank runs this")
"""


def test_classes_the_pool_cannot_run_say_why_and_run_the_torch_way(pytester: pytest.Pytester) -> None:
    import os

    pytester.makepyfile(test_unpoolable=UNPOOLABLE.format(pytest_pid=os.getpid()))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    assert "Marked" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*hp-testing runs test_unpoolable.InProcess with torch's own harness: InProcess overrides "
            "join_or_run, part of MultiProcessTestCase's process spawn and join*",
            "*hp-testing runs test_unpoolable.ExitCodes with torch's own harness: ExitCodes uses "
            "special_return_code_checks*pooled ranks do not exit*",
            "*NoSpawn.setUp never called _spawn_processes: no rank ran test_body_runs_nowhere*",
        ]
    )
    result.stdout.fnmatch_lines(["*hp-testing: 1 torch test class(es) ran on pooled ranks*"])

    # Turned off: every class runs with torch's harness and the plugin says nothing about them.
    off = pytester.runpytest("-p", "no:cacheprovider", "--hp-torch-testcases=torch")
    off.assert_outcomes(passed=4)
    assert "hp-testing runs" not in off.stdout.str() and "pooled ranks" not in off.stdout.str()

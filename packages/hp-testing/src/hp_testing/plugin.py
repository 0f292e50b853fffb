"""The pytest plugin: ``@pytest.mark.distributed(world_size=N)``.

A marked test's body runs on N ranks of a pooled process group (see
``hp_testing.pool``) and is reported once: passed when every rank passed, or
failed with each failing rank's traceback labelled by rank, plus the Python
stack of every rank that hung. Fixtures are pickled to the ranks over the
pool's pipes ([Note: fixtures travel to the ranks]); under plain ``torchrun``
the plugin steps aside ([Note: the plugin under torchrun]); torch's
multi-process test classes run on the same pools ([Note: torch's test
classes on the pools]).
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import types
import unittest
from typing import Any

import pytest

from hp_testing._torch_cases import (
    TorchCase,
    bare_instance,
    classify,
    harness_modules,
    take_over,
    world_size_of,
)
from hp_testing._worker import RANK_LOCAL_FIXTURES, RunOptions, Task
from hp_testing.faults import Fault
from hp_testing.fixtures import DeviceMeshFactory, make_device_mesh_factory
from hp_testing.pool import Outcome, WorkerPool, preload

MARKER = "distributed"
BACKENDS = ("gloo", "nccl-emu", "hccl-emu")
ENV_BACKEND = "HP_TEST_BACKEND"
ENV_STRICT = "HP_TEST_STRICT"
ENV_CHECKS = "HP_TEST_CHECKS"
ENV_MODE = "HP_TEST_MODE"
TORCH_HARNESS_MARKER = "torch_harness"
TORCH_TESTCASES = ("pool", "torch")
_DEFAULT_TIMEOUT_S = 60.0
_SESSION_KEY = "hp-testing-session"


class MarkerError(Exception):
    """A ``distributed`` marker or fixture that cannot work; reported on its test."""


# [Note: fixtures travel to the ranks]
# Fixtures, resolved in the pytest process as usual, are pickled to the ranks;
# ``rank``, ``world_size`` and ``device_mesh_factory`` are the exceptions: each
# rank computes its own value. The pickles go over the pool's pipes (socketpairs
# between the pytest process and the ranks it forked), never over the network:
# what the ranks share through the TCPStore is JSON (:mod:`hp_testing._wire`).
class _RankLocal:
    """Stands in for a rank-local fixture in the pytest process; each rank swaps in its value."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: differs per rank>"


# [Note: the plugin under torchrun]
# Under plain ``torchrun -m pytest`` (RANK and WORLD_SIZE already set and no pool
# involved) the plugin steps aside: the test body runs in the calling process on
# the default group that ``hp_core.init_distributed`` creates. This is what makes
# every harness test also a ``torchrun`` test.
def _inline() -> bool:
    """True when this process is itself one rank of a torchrun-style launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _marker(request: pytest.FixtureRequest, fixture: str) -> pytest.Mark:
    marker = request.node.get_closest_marker(MARKER)
    if marker is None:
        pytest.fail(
            f"fixture {fixture!r} of {request.node.nodeid} only exists in tests marked "
            f"@pytest.mark.{MARKER}(world_size=N); add the marker",
            pytrace=False,
        )
    return marker


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> Any:
    """This rank's index in the default group (0 .. world_size-1)."""
    _marker(request, "rank")
    return int(os.environ["RANK"]) if _inline() else _RankLocal("rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> Any:
    """The number of ranks running the test."""
    _marker(request, "world_size")
    return int(os.environ["WORLD_SIZE"]) if _inline() else _RankLocal("world_size")


@pytest.fixture
def device_mesh_factory(request: pytest.FixtureRequest) -> DeviceMeshFactory | _RankLocal:
    """``factory(mesh_shape, mesh_dim_names=None)`` -> ``hp_core.DeviceMesh`` on this rank."""
    _marker(request, "device_mesh_factory")
    return make_device_mesh_factory() if _inline() else _RankLocal("device_mesh_factory")


def _flag(value: Any, name: str, item: pytest.Item) -> bool:
    if not isinstance(value, bool):
        raise MarkerError(f"{item.nodeid}: {name} must be True or False, got {value!r}")
    return value


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    return raw not in ("0", "false", "no", "off")


def _run_options(item: pytest.Item, marker: pytest.Mark) -> RunOptions:
    """The emulation layer's settings for this test: checks, strict mode, faults."""
    checks = _flag(marker.kwargs.get("checks", _env_flag(ENV_CHECKS, True)), "checks", item)
    strict = _flag(marker.kwargs.get("strict", _env_flag(ENV_STRICT, False)), "strict", item)
    faults = marker.kwargs.get("faults", ())
    if isinstance(faults, Fault):
        faults = (faults,)
    faults = tuple(faults)
    bad = [f for f in faults if not isinstance(f, Fault)]
    if bad:
        raise MarkerError(
            f"{item.nodeid}: faults must be hp_testing.faults.Fault values (faults.fail(rank=1, at=0), ...), "
            f"got {bad!r}"
        )
    if faults and not checks:
        raise MarkerError(f"{item.nodeid}: faults need checks=True (the peers learn of a fault through them)")
    return RunOptions(checks=checks, strict=strict, faults=faults)


def _options(item: pytest.Item, marker: pytest.Mark, config: pytest.Config) -> tuple[int, str, float]:
    """Validate the marker's arguments; a bad marker is a usage error, not a test failure."""
    allowed = {"world_size", "backend", "timeout", "checks", "strict", "faults", "mode"}
    unknown = set(marker.kwargs) - allowed
    if marker.args or unknown:
        raise MarkerError(
            f"{item.nodeid}: @pytest.mark.{MARKER} takes keyword arguments {sorted(allowed)}, "
            f"got positional {list(marker.args)} and unknown {sorted(unknown)}; "
            f"write @pytest.mark.{MARKER}(world_size=2)"
        )
    world = marker.kwargs.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise MarkerError(
            f"{item.nodeid}: world_size must be an int >= 1, got {world!r}; "
            f"write @pytest.mark.{MARKER}(world_size=2)"
        )
    backend = marker.kwargs.get("backend", os.environ.get(ENV_BACKEND, "gloo") or "gloo")
    if backend not in BACKENDS:
        origin = "" if "backend" in marker.kwargs else f" (from ${ENV_BACKEND})"
        raise MarkerError(
            f"{item.nodeid}: unknown backend {backend!r}{origin}; choose one of {list(BACKENDS)}"
        )
    timeout = marker.kwargs.get("timeout")
    if timeout is None:
        cli = config.getoption("hp_timeout")
        timeout = cli if cli is not None else float(config.getini("hp_timeout") or _DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise MarkerError(f"{item.nodeid}: timeout must be a positive number, got {timeout!r}")
    return world, backend, float(timeout)


def _mode(item: pytest.Item, marker: pytest.Mark, backend: str, options: RunOptions) -> str:
    """``"process"`` (the pool) or ``"local"`` (every rank a thread of this process)."""
    from hp_testing._local_pytest import MODES

    mode = marker.kwargs.get("mode", os.environ.get(ENV_MODE, "process") or "process")
    if mode not in MODES:
        origin = "" if "mode" in marker.kwargs else f" (from ${ENV_MODE})"
        raise MarkerError(f"{item.nodeid}: unknown mode {mode!r}{origin}; choose one of {list(MODES)}")
    if mode == "local":
        wanted = []
        if options.strict:
            wanted.append("strict=True (async hazards)")
        if options.faults:
            wanted.append("faults=[...] (fault injection)")
        # timeout= is accepted and has nothing to do: a hang is reported at once in local mode,
        # so a suite whose markers carry timeouts runs unchanged under HP_TEST_MODE=local.
        if wanted:
            raise MarkerError(
                f"{item.nodeid}: mode='local' runs the ranks one at a time in one process and cannot "
                f"honour {', '.join(wanted)}; use the multi-process mode for it: "
                f"@pytest.mark.{MARKER}(world_size=N, mode='process', ...)"
            )
    return str(mode)


# [Note: torch's test classes on the pools]
# Test classes derived from torch's ``MultiProcessTestCase`` (``DTensorTestBase``,
# ``DistributedTestBase``) and ``MultiProcContinuousTest`` run on the same pools,
# unchanged, by default (:mod:`hp_testing._torch_cases`): a user who installs the
# plugin for speed gets it for the tests they already have, a class that cannot be
# pooled says why and runs the torch way, and ``--hp-torch-testcases=torch`` (or
# ``@pytest.mark.torch_harness``) keeps torch's own harness.
def _torch_case(item: pytest.Item, config: pytest.Config) -> TorchCase | None:
    """The torch test class ``item`` belongs to, unless torch's harness is asked for (or none)."""
    cls = getattr(item, "cls", None)
    if cls is None or not issubclass(cls, unittest.TestCase) or _inline():
        return None
    case = classify(cls)
    if case is None:
        return None
    choice = config.getoption("hp_torch_testcases") or config.getini("hp_torch_testcases") or "pool"
    if choice not in TORCH_TESTCASES:
        raise pytest.UsageError(
            f"--hp-torch-testcases / hp_torch_testcases must be one of {TORCH_TESTCASES}, got {choice!r}"
        )
    if choice == "torch" or item.get_closest_marker(TORCH_HARNESS_MARKER) is not None:
        return None
    return case


# [Note: torch's test classes and local mode]
# Local mode runs every rank as a thread of one process. torch's classes are
# written for a process per rank: a TestCase instance per rank, ``self.rank``,
# ``init_process_group`` on a file store, c10d's state (default group, group
# names) per process. So they always run as processes: ``mode='local'`` on one
# is an error, and ``HP_TEST_MODE=local`` (a whole-run default) leaves them on
# the process pool with one warning per session saying so.
_WHY_NOT_LOCAL = (
    "torch's test classes run each rank as a process (a TestCase per rank, self.rank, "
    "init_process_group on a file store, c10d state per process), and local mode's ranks share "
    "one process"
)


def _torch_marker(item: pytest.Item, world: int) -> Any:
    """The ``distributed`` marker's options for a torch class: its world size is the class's own."""
    marker = item.get_closest_marker(MARKER)
    kwargs = dict(marker.kwargs) if marker is not None else {}
    given = kwargs.get("world_size")
    if given is not None and given != world:
        raise MarkerError(
            f"{item.nodeid}: @pytest.mark.{MARKER}(world_size={given!r}) on a torch test class whose "
            f"world_size is {world}; the class decides its world size: drop world_size from the marker"
        )
    mode = kwargs.pop("mode", "process")
    if mode != "process":
        raise MarkerError(
            f"{item.nodeid}: @pytest.mark.{MARKER}(mode={mode!r}) on a torch test class; {_WHY_NOT_LOCAL}: "
            f"drop mode= from the marker (the class runs on hp-testing's process pool), or write the test "
            f"as a function marked @pytest.mark.{MARKER}(world_size=N, mode='local') taking the rank / "
            f"device_mesh_factory fixtures"
        )
    kwargs["world_size"] = world
    return types.SimpleNamespace(args=tuple(marker.args) if marker is not None else (), kwargs=kwargs)


def _torch_task(item: pytest.Item, case: TorchCase, extra: dict[str, Any]) -> Task:
    import sys

    module = getattr(item, "module", None)
    assert module is not None and getattr(item, "cls", None) is not None
    return Task(
        nodeid=item.nodeid,
        module_name=module.__name__,
        module_file=str(module.__file__),
        class_name=item.cls.__qualname__,  # type: ignore[attr-defined]
        function_name=item.name,
        kwargs={},
        sys_path=list(sys.path),
        kind=case.family,
        extra=extra,
    )


class HarnessSession:
    """Owns the pools of one pytest process; a pytest-forked child gets private pools."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.owner_pid = os.getpid()
        self.pools: dict[tuple[int, str], WorkerPool] = {}
        self.pooled_classes: set[str] = set()
        self.torch_way: dict[str, str] = {}  # class -> why it ran with torch's harness
        self.warned_local_env = False  # [Note: torch's test classes and local mode]

    def pool(self, world_size: int, backend: str) -> WorkerPool:
        key = (world_size, backend)
        pool = self.pools.get(key)
        if pool is None:
            pool = WorkerPool(world_size, backend=backend)
            pool.start()
            self.pools[key] = pool
            _leave_without_sweeping()
        return pool

    def shutdown(self) -> None:
        """Stop every pool's ranks at once, then wait for them: the pools wind down side by side."""
        for pool in self.pools.values():
            pool.request_stop()
        for pool in self.pools.values():
            pool.shutdown()
        self.pools.clear()

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Any:
        """Collect with what the process holds already frozen: [Note: collecting beside torch's heap]."""
        if gc.get_freeze_count():
            return (yield)  # someone froze objects on purpose: leave their choice alone
        gc.freeze()
        try:
            return (yield)
        finally:
            gc.unfreeze()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Fork every pool the selected tests need now, so they start while tests run."""
        if _inline() or self.config.getoption("forked", False):
            return
        needed: dict[tuple[int, str], None] = {}  # ordered: the first test's pool forks first
        torch_cases = False
        for item in session.items:
            case = _torch_case(item, self.config)
            if case is not None and case.reason is None:
                torch_cases = True
                try:
                    world = world_size_of(item.cls, bare_instance(item.cls))  # type: ignore[attr-defined]
                    needed[world, _options(item, _torch_marker(item, world), self.config)[1]] = None
                except Exception:
                    pass  # reported when the test runs
                continue
            marker = item.get_closest_marker(MARKER)
            if marker is not None:
                try:
                    world, backend, _ = _options(item, marker, self.config)
                    if _mode(item, marker, backend, _run_options(item, marker)) == "local":
                        continue  # no pool: the ranks run in this process
                except MarkerError:
                    continue  # reported when the test runs
                needed[world, backend] = None
        if torch_cases:
            preload(harness_modules())  # [Note: preloading torch's harness]
        for world, backend in needed:  # in the tests' order: the first test waits for its pool only
            self.pool(world, backend)

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        marker = pyfuncitem.get_closest_marker(MARKER)
        if marker is None:
            return None
        bad: str | None = None
        try:
            world, backend, timeout = _options(pyfuncitem, marker, self.config)
            options = _run_options(pyfuncitem, marker)
            mode = _mode(pyfuncitem, marker, backend, options)
            task = None if _inline() else _task(pyfuncitem)
        except MarkerError as exc:
            bad = str(exc)
        if bad is not None:  # failed outside the except block: one message, no chained traceback
            pytest.fail(bad, pytrace=False)
        if task is None:
            _run_inline(world)
            return None  # pytest calls the function itself, in this process
        if mode == "local":
            from hp_testing._local_pytest import run_local_test

            outcome = run_local_test(pyfuncitem, world, backend)
            rules = "" if backend == "gloo" else f", {backend} rules"
            _report(pyfuncitem, outcome, f"hplocal (local mode{rules})", options)
            return True
        _report(pyfuncitem, self._outcome(world, backend, task, timeout, options), backend, options)
        return True

    def _outcome(self, world: int, backend: str, task: Task, timeout: float, options: RunOptions) -> Outcome:
        if os.getpid() == self.owner_pid:
            return self.pool(world, backend).run(task, timeout, options)
        # A pytest-forked child: the parent's pools belong to the parent.
        pool = WorkerPool(world, backend=backend)
        pool.start()
        try:
            return pool.run(task, timeout, options)
        finally:
            pool.shutdown()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        """A torch test class's method: let unittest run it, with the ranks on the pool."""
        case = _torch_case(item, self.config)
        if case is None:
            return
        name = f"{item.cls.__module__}.{item.cls.__qualname__}"  # type: ignore[attr-defined]
        self._warn_local_env(item)
        if case.reason is not None:
            if name not in self.torch_way:
                self.torch_way[name] = case.reason
                warning = f"hp-testing runs {name} with torch's own harness: {case.reason}"
                item.warn(pytest.PytestWarning(warning))
            return
        bad: str | None = None
        try:
            world = world_size_of(item.cls, item.instance)  # type: ignore[attr-defined]
            marker = _torch_marker(item, world)
            _, backend, timeout = _options(item, marker, self.config)
            options = _run_options(item, marker)
        except unittest.SkipTest as exc:
            pytest.skip(str(exc))
        except MarkerError as exc:
            bad = str(exc)
        if bad is not None:  # failed outside the except block: one message, no chained traceback
            pytest.fail(bad, pytrace=False)
        self.pooled_classes.add(name)

        def run_on_pool(extra: dict[str, Any]) -> None:
            outcome = self._outcome(world, backend, _torch_task(item, case, extra), timeout, options)
            _report(item, outcome, backend, options)  # type: ignore[arg-type]
            first = outcome.results.get(0)
            if first is not None and first.skipped:  # torch too decides a skip by rank 0's exit code
                raise unittest.SkipTest(first.skipped)

        take_over(item, case, backend, run_on_pool)

    def _warn_local_env(self, item: pytest.Item) -> None:
        """Say once that ``HP_TEST_MODE=local`` leaves torch's classes on processes."""
        if self.warned_local_env or os.environ.get(ENV_MODE, "").strip() != "local":
            return
        self.warned_local_env = True
        item.warn(
            pytest.PytestWarning(
                f"${ENV_MODE}=local does not apply to torch test classes ({item.cls.__qualname__} "  # type: ignore[attr-defined]
                f"and the rest): {_WHY_NOT_LOCAL}; they run on hp-testing's process pool anyway. "
                f"Only functions marked @pytest.mark.{MARKER}(world_size=N) run in local mode; "
                f"unset ${ENV_MODE} to silence this"
            )
        )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.pooled_classes and not self.torch_way:
            return
        terminalreporter.write_line(
            f"hp-testing: {len(self.pooled_classes)} torch test class(es) ran on pooled ranks"
            + (" (--hp-torch-testcases=torch runs them with torch's harness)" if self.pooled_classes else "")
        )
        for name, reason in sorted(self.torch_way.items()):
            terminalreporter.write_line(f"hp-testing: {name} ran with torch's harness: {reason}")

    def pytest_sessionfinish(self) -> None:
        if os.getpid() == self.owner_pid:
            self.shutdown()


# [Note: collecting beside torch's heap]
# Collection imports the test modules, and with torch's test classes their
# harness and torch._dynamo: the collector runs its full collections meanwhile,
# each walking the 250,000 objects torch brought, none of which the imports
# free. Frozen for the length of collection (``gc.freeze()``, then
# ``gc.unfreeze()`` puts them back into the oldest generation), those are
# skipped: importing the harness takes 1.0 s of CPU instead of 1.2-1.3 s on the
# 2-core machine. Nothing is kept alive by it: whatever of them died meanwhile
# is collected by the next full collection, as it would have been.


# [Note: leaving without sweeping torch's heap]
# A pytest process that pooled ranks holds torch, often torch's harness and
# dynamo: some 300,000 objects the cyclic garbage collector tracks. Interpreter
# teardown collects several times while it clears the modules, 1.0-1.2 s of CPU
# on the 2-core machine (3-5 s of wall time at load 15), longer than the 40 pooled
# tests of benchmarks/harness_overhead.py together. pytest has already collected
# in full while it unconfigured (its unraisable-exception check), so garbage the
# tests left is finalized as before (``__del__``, files flushed). At exit (after
# the atexit handlers registered later than this one) the process collects the
# young generations, which hold whatever died since, and freezes the rest:
# teardown's collections then skip the modules' own objects, whose deallocation
# nothing can observe. Exit costs about 0.2 s of CPU instead.
_SWEEP_SKIPPED_BY: int | None = None  # pid that registered the exit hook


def _leave_without_sweeping() -> None:
    """Register, once per process, the exit hook of [Note: leaving without sweeping torch's heap]."""
    global _SWEEP_SKIPPED_BY
    if os.getpid() == _SWEEP_SKIPPED_BY:
        return
    _SWEEP_SKIPPED_BY = os.getpid()
    atexit.register(_collect_then_freeze)


def _collect_then_freeze() -> None:
    gc.collect(1)
    gc.freeze()


def _run_inline(world: int) -> None:
    from hp_core import init_distributed

    actual = int(os.environ["WORLD_SIZE"])
    if actual != world:
        pytest.skip(f"needs world_size={world}; this launch has WORLD_SIZE={actual}")
    init_distributed()


def _task(item: pytest.Function) -> Task:
    import sys

    kwargs: dict[str, Any] = {}
    for name in item._fixtureinfo.argnames:
        value = item.funcargs[name]
        if name in RANK_LOCAL_FIXTURES:
            kwargs[name] = None
            continue
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise MarkerError(
                f"{item.nodeid}: fixture {name!r} returned {type(value).__name__}, which cannot be "
                f"sent to the ranks ({exc}); distributed tests take only picklable fixtures: "
                f"build the object inside the test instead"
            ) from None
        kwargs[name] = value
    module = item.module
    assert module is not None
    return Task(
        nodeid=item.nodeid,
        module_name=module.__name__,
        module_file=str(module.__file__),
        class_name=item.cls.__name__ if item.cls is not None else None,
        function_name=item.originalname,
        kwargs=kwargs,
        sys_path=list(sys.path),
    )


def _report(item: pytest.Function, outcome: Outcome, backend: str, options: RunOptions | None = None) -> None:
    for rank, result in sorted(outcome.results.items()):
        if result.stdout:
            item.add_report_section("call", f"stdout rank {rank}", result.stdout)
        if result.stderr:
            item.add_report_section("call", f"stderr rank {rank}", result.stderr)
    injected = _fault_lines(outcome, options)
    if injected:
        item.add_report_section("call", "injected faults", injected)
    if outcome.ok:
        return
    parts = [_headline(outcome, backend)]
    for rank in outcome.failed_ranks():
        parts.append(f"{'-' * 20} rank {rank} failed {'-' * 20}\n{outcome.results[rank].error.rstrip()}")
    for rank, code in sorted(outcome.died.items()):
        parts.append(f"{'-' * 20} rank {rank} died {'-' * 20}\nthe process exited with code {code}")
    for rank, stack in sorted(outcome.hung.items()):
        parts.append(f"{'-' * 20} rank {rank} hung; its Python stack {'-' * 20}\n{stack}")
    if injected:
        parts.append(f"{'-' * 20} injected faults {'-' * 20}\n{injected}")
    pytest.fail("\n".join(parts), pytrace=False)


def _fault_lines(outcome: Outcome, options: RunOptions | None) -> str:
    lines: list[str] = []
    for rank, result in sorted(outcome.results.items()):
        lines.extend(f"rank {rank}: {text}" for text in result.faults)
    for fault in options.faults if options is not None else ():
        code = outcome.died.get(fault.rank)
        if fault.kind == "kill" and fault.rank in outcome.died and code == fault.exit_code:
            lines.append(f"rank {fault.rank}: {fault.describe()} (the process exited with code {code})")
    return "\n".join(sorted(lines))


def _headline(outcome: Outcome, backend: str) -> str:
    what = []
    if outcome.failed_ranks():
        what.append(f"failed on rank(s) {outcome.failed_ranks()}")
    if outcome.died:
        what.append(f"rank(s) {sorted(outcome.died)} died")
    if outcome.hung:
        if outcome.timed_out:
            what.append(
                f"rank(s) {sorted(outcome.hung)} still running after the {outcome.timeout_s:g} s "
                f"timeout (raise it with @pytest.mark.{MARKER}(..., timeout=S) or --hp-timeout)"
            )
        else:
            what.append(f"rank(s) {sorted(outcome.hung)} stopped answering after the failure")
    return f"distributed test on {outcome.world_size} rank(s) over {backend}: " + "; ".join(what)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hp-testing", "multi-process tests (hp-testing)")
    group.addoption(
        "--hp-timeout",
        dest="hp_timeout",
        type=float,
        default=None,
        help="seconds before a distributed test counts as hung (default: ini hp_timeout, 60)",
    )
    parser.addini("hp_timeout", "default per-test timeout in seconds for distributed tests", default="60")
    group.addoption(
        "--hp-torch-testcases",
        dest="hp_torch_testcases",
        choices=TORCH_TESTCASES,
        default=None,
        help="torch MultiProcessTestCase / DTensorTestBase / MultiProcContinuousTest classes: 'pool' runs "
        "their ranks on hp-testing's pool (default, ini hp_torch_testcases), 'torch' with torch's harness",
    )
    parser.addini(
        "hp_torch_testcases",
        "'pool' (default) or 'torch': who runs torch's multi-process test classes",
        default="pool",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size=N, backend='gloo'|'nccl-emu'|'hccl-emu', timeout=60, checks=True, "
        "strict=False, faults=[], mode='process'|'local'): run the test body on N ranks of a pooled "
        "process group (mode='local': N threads of this process) and report it once",
    )
    config.addinivalue_line(
        "markers",
        f"{TORCH_HARNESS_MARKER}: run this torch MultiProcessTestCase / MultiProcContinuousTest class with "
        "torch's own harness (spawned ranks) instead of hp-testing's pool",
    )
    if not config.pluginmanager.has_plugin(_SESSION_KEY):
        config.pluginmanager.register(HarnessSession(config), _SESSION_KEY)


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.pluginmanager.get_plugin(_SESSION_KEY)
    if isinstance(session, HarnessSession) and os.getpid() == session.owner_pid:
        session.shutdown()

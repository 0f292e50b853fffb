"""The body of one pooled rank process.

A worker is forked once per pytest session (from a forkserver that has already
imported torch, so a fork costs milliseconds rather than a second of imports),
joins the default process group, and then runs test bodies it is sent over a
pipe until it is told to stop. Keeping the process and its process group alive
between tests is what makes the harness fast; resetting per-test state (groups
the test created, environment, RNG, default dtype) is what keeps one test from
leaking into the next.

[Note: stack dumps of hung ranks]
``faulthandler`` is registered on SIGUSR1 and writes to a file the pool owns.
Its handler runs at C level, so it prints the Python stack even while the main
thread is blocked inside a gloo collective, which is exactly the case we need.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import faulthandler
import importlib.util
import io
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_testing import _test_groups
from hp_testing._lifetime import die_with_parent
from hp_testing._torch_rank import RankSkip, install_adoption, rank_body

# Fixtures whose value differs per rank: computed inside the worker, never sent.
#: Fixtures each rank builds itself instead of receiving a pickled copy. ``monkeypatch`` is one:
#: a copy pickled from the pytest process would patch the rank but be undone only in the pytest
#: process, leaving the patch in the pooled rank for every later test.
RANK_LOCAL_FIXTURES = ("rank", "world_size", "device_mesh_factory", "monkeypatch")
EMULATED_BACKENDS = ("nccl-emu", "hccl-emu")


@dataclass(frozen=True)
class WorkerConfig:
    """What a rank needs to join its pool's process group."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    pool_key: str
    backend: str
    pg_timeout_s: float
    stack_file: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """One test body to run on every rank of a pool."""

    nodeid: str
    module_name: str
    module_file: str
    class_name: str | None
    function_name: str
    kwargs: dict[str, Any]
    sys_path: list[str]
    #: "function" (a marked test), or a torch test-case method (:mod:`hp_testing._torch_rank`).
    kind: str = "function"
    #: What a torch test-case method needs besides its name: ``file_name``, ``env``.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunOptions:
    """How the emulation layer treats one task (see ``hp_testing.emulation``)."""

    prefix: str = ""  # store prefix of this run's cross-rank checks
    checks: bool = True
    strict: bool = False
    faults: tuple[Any, ...] = ()
    #: Where the group-name counter restarts before this task (the previous one made groups):
    #: [Note: group names across pooled tests] in hp_testing._test_groups.
    names_from: int | None = None


@dataclass
class TaskResult:
    """What one rank reports back about one task."""

    rank: int
    ok: bool
    error: str = ""
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    # The test destroyed the default group or left it unusable: re-init needed.
    needs_reinit: bool = False
    # Injected faults that fired on this rank (and planned ones that did not).
    faults: list[str] = field(default_factory=list)
    # Why the test skipped itself on this rank (a torch test's SkipTest or skip exit code).
    skipped: str = ""
    # The group-name counter this rank's next test may start from (None: the test made no group).
    names_from: int | None = None


def _init_group(cfg: WorkerConfig, generation: int) -> None:
    store = dist.TCPStore(
        cfg.store_host,
        cfg.store_port,
        cfg.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
    )
    prefixed = dist.PrefixStore(f"hp/{cfg.pool_key}/{generation}", store)
    dist.init_process_group(
        "gloo",  # the emulated backends run real traffic over gloo
        store=prefixed,
        rank=cfg.rank,
        world_size=cfg.world_size,
        timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
    )


def _clear_hp_caches() -> None:
    """Forget groups cached by hp_core: they die with the default group."""
    mesh_mod = sys.modules.get("hp_core.mesh")
    clear = getattr(mesh_mod, "clear_group_cache", None)
    if clear is not None:
        with contextlib.suppress(Exception):
            clear()


# [Note: torch's mesh caches across pooled tests]
# torch's DTensor caches compare device meshes by ranks, layout and dimension
# names, not by the names of their groups: the sharding propagation cache, the
# redistribution transforms and planners and the mesh topology hand a later,
# equal mesh the specs of an earlier one (the C++ dispatch fast path keeps its
# own copy), whose group names then resolve. After
# the counter rewind ([Note: group names across pooled tests] in
# hp_testing._test_groups) an identical test names its groups alike, but a test
# that made another group first has shifted names: the earlier mesh's names
# meant nothing or other ranks ("Could not resolve the process group registered
# under the name 3"). So whenever the counter is rewound (the previous test made
# groups) these caches are cleared too, as a fresh process would start them.
# Caches local to torch's functions (an lru_cache made per strategy
# expansion) live and die with their call and need nothing.
_MESH_CACHES = (
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos", "cache_clear"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache", None),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo", "build_from_mesh.cache_clear"),
)


def _forget_cached_meshes() -> None:
    """Empty torch's mesh-keyed caches ([Note: torch's mesh caches across pooled tests])."""
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None:
        return  # no DTensor imported: nothing cached
    with contextlib.suppress(Exception):
        torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's own
    with contextlib.suppress(Exception):
        tensor.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    for module_name, name, method in _MESH_CACHES:
        target: Any = getattr(sys.modules.get(module_name), name, None)
        for part in (method or "").split("."):
            target = getattr(target, part, None) if part else target
        if callable(target):
            with contextlib.suppress(Exception):
                target()


def _destroy_group() -> None:
    _clear_hp_caches()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _import_test_module(name: str, path: str) -> ModuleType:
    """Import a test module the way pytest would, asserts rewritten for readable failures."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load test module {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        source = open(path, "rb").read()  # noqa: SIM115
        tree = ast.parse(source, filename=path)
        try:
            from _pytest.assertion.rewrite import rewrite_asserts

            rewrite_asserts(tree, source, path)
        except Exception:  # pytest internals moved: plain asserts still work
            tree = ast.parse(source, filename=path)
        exec(compile(tree, path, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(value)`` gives a process: 0 for None, 1 for a message, else the int."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _format_error(exc: BaseException) -> str:
    """The traceback from the test's own frames on, without the harness's (the checks' included)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_PACKAGE_DIR)]
    text = "Traceback (most recent call last):\n" if frames else ""
    text += "".join(traceback.format_list(frames))
    text += "".join(traceback.format_exception_only(type(exc), exc))
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
        link = "direct cause" if exc.__cause__ is not None else "exception while handling"
        text = _format_error(cause) + f"\n(the {link} of:)\n\n" + text
    return text


def _load_module(task: Task) -> ModuleType:
    for entry in reversed(task.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    module = sys.modules.get(task.module_name)
    if module is None or os.path.abspath(getattr(module, "__file__", "") or "") != os.path.abspath(
        task.module_file
    ):
        module = _import_test_module(task.module_name, task.module_file)
    return module


def _load_function(task: Task, cfg: WorkerConfig) -> Callable[..., Any]:
    module = _load_module(task)
    if task.kind != "function":
        return rank_body(task, module, cfg.rank, cfg.world_size, cfg.backend)
    if task.class_name is None:
        fn: Callable[..., Any] = getattr(module, task.function_name)
        return fn
    instance = getattr(module, task.class_name)()
    setup = getattr(instance, "setup_method", None)
    method: Callable[..., Any] = getattr(instance, task.function_name)
    if setup is not None:
        setup(method)
    return method


def _rank_local_value(name: str, cfg: WorkerConfig) -> Any:
    if name == "rank":
        return cfg.rank
    if name == "world_size":
        return cfg.world_size
    if name == "device_mesh_factory":
        from hp_testing.fixtures import make_device_mesh_factory

        return make_device_mesh_factory()
    if name == "monkeypatch":
        return pytest.MonkeyPatch()
    raise KeyError(name)


class _StateGuard:
    """Restore per-process state a test may change, so the next test sees a fresh rank."""

    def __init__(self, initial_rng: torch.Tensor) -> None:
        self._initial_rng = initial_rng

    @contextlib.contextmanager
    def around_test(self) -> Any:
        env = dict(os.environ)
        dtype = torch.get_default_dtype()
        grad = torch.is_grad_enabled()
        threads = torch.get_num_threads()
        cwd = os.getcwd()
        # A fresh process starts from torch's fixed default seed; so does each test.
        torch.random.default_generator.set_state(self._initial_rng)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(env)
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(grad)
            torch.set_num_threads(threads)
            with contextlib.suppress(OSError):
                os.chdir(cwd)


def _run_task(
    task: Task, cfg: WorkerConfig, guard: _StateGuard, options: RunOptions, check_store: Any
) -> TaskResult:
    from hp_testing import emulation

    out, err = io.StringIO(), io.StringIO()
    if options.names_from is not None:
        _test_groups.rewind(options.names_from, options.prefix or task.nodeid)  # the same on every rank
        _forget_cached_meshes()  # [Note: torch's mesh caches across pooled tests]
    before = _test_groups.mark()
    start = time.perf_counter()
    result = TaskResult(rank=cfg.rank, ok=True)
    layer = emulation.active_layer()
    kwargs: dict[str, Any] = {}
    with guard.around_test(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if layer is not None and dist.is_initialized():
                layer.begin_test(
                    check_store if options.prefix else None,
                    options.prefix,
                    checks=options.checks,
                    strict=options.strict,
                    faults=options.faults,
                )
            fn = _load_function(task, cfg)
            kwargs = dict(task.kwargs)
            for name in RANK_LOCAL_FIXTURES:
                if name in kwargs:
                    kwargs[name] = _rank_local_value(name, cfg)
            fn(**kwargs)
            if layer is not None and dist.is_initialized():
                layer.finish_test()
        except RankSkip as exc:
            result.skipped = str(exc) or "skipped"
            if layer is not None and dist.is_initialized():
                layer.finish_test()
        except BaseException as exc:
            result.ok = False
            result.error = _format_error(exc)
            if layer is not None and isinstance(exc, SystemExit):
                layer.post_exit(_exit_code(exc))  # sys.exit() in a test body: the peers hear "exited"
            elif layer is not None:
                layer.post_failure(result.error)
        finally:
            for value in kwargs.values():
                if isinstance(value, pytest.MonkeyPatch):
                    value.undo()
            if layer is not None:
                result.faults = layer.end_test()
                emulation.reinject()
    if result.faults:
        result.needs_reinit = True
    result.duration_s = time.perf_counter() - start
    result.stdout, result.stderr = out.getvalue(), err.getvalue()
    if not dist.is_initialized():
        result.needs_reinit = True
    else:
        # Groups the test made itself would pile up sockets test after test, and their names
        # must not outlive them: [Note: group names across pooled tests].
        result.names_from = _test_groups.release(before)
    return result


def worker_main(cfg: WorkerConfig, conn: Connection) -> None:
    """Entry point of a pooled rank: join the group, then serve tasks until told to stop."""
    die_with_parent()  # the forkserver is our parent: [Note: dying with the parent]
    os.environ.update(cfg.env)
    torch.set_num_threads(1)
    stack_file = open(cfg.stack_file, "a", buffering=1)  # noqa: SIM115 - lives as long as we do
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    guard = _StateGuard(torch.random.default_generator.get_state())
    generation = 0
    try:
        from hp_testing import emulation

        emulation.install(cfg.backend)
        install_adoption()  # torch test classes join the pool's group: [Note: adopting the pool's group]
        check_store = dist.TCPStore(
            cfg.store_host,
            cfg.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
        )
        _init_group(cfg, generation)
        conn.send(("ready", cfg.rank))
    except BaseException as exc:
        conn.send(("init-failed", "".join(traceback.format_exception(exc))))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # the pool went away: nothing left to serve
        kind = message[0]
        if kind == "run":
            options = message[2] if len(message) > 2 else RunOptions()
            conn.send(("result", _run_task(message[1], cfg, guard, options, check_store)))
        elif kind == "reinit":
            generation = message[1]
            os.environ["TORCHELASTIC_RESTART_COUNT"] = str(generation)
            _destroy_group()
            try:
                _init_group(cfg, generation)
                conn.send(("ready", cfg.rank))
            except BaseException as exc:
                conn.send(("init-failed", "".join(traceback.format_exception(exc))))
                return
        elif kind == "stop":
            break
    _destroy_group()

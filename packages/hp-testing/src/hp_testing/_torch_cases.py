"""In the pytest process: recognise torch's multi-process test classes and hand their methods to the pool.

pytest collects ``MultiProcessTestCase`` / ``DTensorTestBase`` /
``MultiProcContinuousTest`` subclasses as ordinary unittest classes and runs each
method through ``unittest``'s own ``run`` (``setUp``, the method, ``tearDown``,
skip decorators, ``expectedFailure``, subtests reported by pytest). torch's
classes make the method itself the parent's half of the harness: it spawns
ranks in ``setUp`` (or per class) and joins them in the method. The plugin keeps
unittest's run as it is and swaps exactly those two points on the instance
pytest built, never on the user's class (see [Note: what the plugin swaps]);
a class that customises those points runs the torch way ([Note: classes that
run the torch way]).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import tempfile
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from hp_testing._torch_rank import CONTINUOUS, SPAWN

COMMON = "torch.testing._internal.common_distributed"
#: torch's harness modules worth importing once in the forkserver ([Note: preloading torch's harness]).
_HARNESS_MODULES = (COMMON, "torch.testing._internal.distributed._tensor.common_dtensor")

#: The methods the plugin replaces or relies on being torch's, per family.
_SPAWN_HOOKS = (
    "_spawn_processes",
    "_start_processes",
    "_run",
    "run_test",
    "join_or_run",
    "_join_processes",
    "_check_return_codes",
)
_CONTINUOUS_HOOKS = (
    "_spawn_processes",
    "_ensure_processes_spawned",
    "_worker_loop",
    "_run_test_given_id",
    "_worker_run_main_wait",
)
#: Source text that means the class looks at its ranks as processes.
_EXIT_CODE_USES = ("special_return_code_checks", "skip_return_code_checks", "self.processes", ".exitcode")


@dataclass(frozen=True)
class TorchCase:
    """One torch test class as the plugin sees it."""

    family: str  # _torch_rank.SPAWN or _torch_rank.CONTINUOUS
    reason: str | None  # why it runs the torch way; None when it is pooled


def _torch_owned(klass: type) -> bool:
    return klass.__module__.startswith("torch.")


def _defined_by(cls: type, name: str) -> type | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


# [Note: classes that run the torch way]
# A class that customises what is swapped (its own ``_spawn_processes``, ``_run``,
# ``run_test``, ``join_or_run``, ...) or that checks the ranks' exit codes
# (``special_return_code_checks``, ``skip_return_code_checks``, ``self.processes``)
# cannot keep its meaning on ranks that never exit; it runs the torch way and
# :func:`classify` says why.
@functools.cache
def classify(cls: type) -> TorchCase | None:
    """The family of a torch multi-process test class and why it cannot be pooled, or None."""
    common = sys.modules.get(COMMON)
    if common is None or not isinstance(cls, type):
        return None  # nothing imported torch's harness, so no class derives from it
    hooks: tuple[str, ...]
    if issubclass(cls, common.MultiProcessTestCase):
        family, base, hooks = SPAWN, common.MultiProcessTestCase, _SPAWN_HOOKS
    elif issubclass(cls, common.MultiProcContinuousTest):
        family, base, hooks = CONTINUOUS, common.MultiProcContinuousTest, _CONTINUOUS_HOOKS
    else:
        return None
    for name in hooks:
        owner = _defined_by(cls, name)
        if owner is not None and owner is not base and issubclass(owner, base):
            return TorchCase(
                family,
                f"{owner.__qualname__} overrides {name}, part of {base.__name__}'s process spawn and join "
                f"that hp-testing replaces with its pooled ranks",
            )
    if family == CONTINUOUS:
        for name in ("setUp", "tearDown"):
            owner = _defined_by(cls, name)
            if owner is not None and not _torch_owned(owner):
                return TorchCase(
                    family,
                    f"{owner.__qualname__}.{name} runs in {base.__name__}'s dispatcher process, once per "
                    f"test, around ranks spawned per class; pooled ranks would not see what it does",
                )
    for klass in cls.__mro__:
        if _torch_owned(klass) or klass is object or klass.__module__ == "unittest.case":
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        used = [word for word in _EXIT_CODE_USES if word in source]
        if used:
            return TorchCase(
                family,
                f"{klass.__qualname__} uses {', '.join(used)}: it checks its ranks as processes (exit "
                f"codes), and pooled ranks do not exit after a test",
            )
    return TorchCase(family, None)


def harness_modules() -> list[str]:
    """The harness modules this pytest process imported for its test classes."""
    return [name for name in _HARNESS_MODULES if name in sys.modules]


def world_size_of(cls: type, instance: Any) -> int:
    """The number of ranks torch would start for this class (``world_size`` property or attribute)."""
    case = classify(cls)
    if case is not None and case.family == CONTINUOUS:
        static = inspect.getattr_static(cls, "world_size", None)
        read: Any = static.fget if isinstance(static, property) else None
        world = read(instance) if read is not None else cls.world_size  # type: ignore[attr-defined]
        if world == -2:  # unset: torch uses the device count
            world = cls._get_world_size(_continuous_device_type(cls))  # type: ignore[attr-defined]
        return int(world)
    return int(instance.world_size)


def _continuous_device_type(cls: type) -> str:
    raw = inspect.getattr_static(cls, "device_type", None)
    if isinstance(raw, classmethod):
        return str(raw.__func__(cls))
    if isinstance(raw, property):
        return str(raw.fget(cls))  # type: ignore[misc]
    if isinstance(raw, str):
        return raw
    return str(cls.device_type())  # type: ignore[attr-defined]


def bare_instance(cls: type) -> Any:
    """An instance for reading properties, without ``__init__`` (as torch reads ``world_size``)."""
    return object.__new__(cls)


_TWINS: dict[type, type] = {}


def _continuous_twin(cls: type) -> type:
    """``cls`` without its per-class spawn ([Note: what the plugin swaps])."""
    twin = _TWINS.get(cls)
    if twin is None:
        twin = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_ensure_processes_spawned": classmethod(lambda klass: None),
                "processes": [],
                "task_queues": [],
                "completion_queues": [],
                "poison_pill": False,
            },
        )
        _TWINS[cls] = twin
    return twin


def _skip_if_backend_missing(cls: type, profile: str) -> None:
    """torch skips a continuous class whose backend is not built in; emulation can stand in for it."""
    backend = cls.backend_str()  # type: ignore[attr-defined]
    if backend in (None, "gloo"):
        return
    if (backend, profile) in (("nccl", "nccl-emu"), ("hccl", "hccl-emu")):
        return
    import torch.distributed as dist

    available = {"nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available, "xccl": dist.is_xccl_available}
    check = available.get(backend)
    if check is not None and check():
        return
    hint = f" (HP_TEST_BACKEND={backend}-emu runs it on CPU)" if backend in ("nccl", "hccl") else ""
    raise unittest.SkipTest(f"Backend '{backend}' is not available{hint}")


Runner = Callable[[dict[str, Any]], None]


# [Note: what the plugin swaps]
# - ``MultiProcessTestCase`` family: the instance's ``_spawn_processes`` becomes a
#   no-op, so ``setUp`` (the class's own, whatever it does besides spawning) and
#   ``tearDown`` run in the pytest process as torch runs them in its parent; the
#   test method becomes a call to the pool, which runs
#   [Note: how torch drives a rank] on each pooled rank with ``setUp``'s
#   ``file_name`` and the environment variables ``setUp`` set (spawned ranks inherit
#   them too).
# - ``MultiProcContinuousTest`` family: its ``setUp`` only spawns (once per class)
#   and queues the test for its ranks, in the parent; the instance gets a twin
#   class (a subclass made here, same name) whose ``_ensure_processes_spawned`` does
#   nothing and whose queues are empty, so ``setUp`` runs and queues nothing, and
#   the method becomes a call to the pool. No test poisons the rest of its class:
#   the pool gives the next test a fresh group after a failure.
def take_over(item: Any, case: TorchCase, profile: str, run_on_pool: Runner) -> None:
    """Make ``item``'s unittest run send the method to the pool ([Note: what the plugin swaps]).

    ``run_on_pool(extra)`` runs the method on every rank with ``extra`` (``file_name``,
    ``env``) and raises on failure or skip; it is called from inside the unittest run.
    """
    instance = item.instance
    env_before = dict(os.environ)
    spawned: list[bool] = []
    if case.family == SPAWN:
        instance._spawn_processes = lambda: spawned.append(True)
        instance._start_processes = lambda proc: spawned.append(True)
    else:
        instance.__class__ = _continuous_twin(type(instance))
    original = item.obj

    @functools.wraps(original)
    def pooled(*args: Any, **kwargs: Any) -> None:
        env = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
        if case.family == SPAWN:
            if not spawned:
                # torch joins no process and passes; so do we, but say so.
                item.warn(
                    pytest.PytestWarning(
                        f"{type(instance).__qualname__}.setUp never called _spawn_processes: "
                        f"no rank ran {item.name}, under torch's harness or hp-testing's pool"
                    )
                )
                return
            run_on_pool({"file_name": instance.file_name, "env": env})
            return
        _skip_if_backend_missing(type(instance), profile)
        with tempfile.TemporaryDirectory(prefix="hp-torch-") as folder:
            run_on_pool({"file_name": os.path.join(folder, "rdvz"), "env": env})

    item.obj = pooled

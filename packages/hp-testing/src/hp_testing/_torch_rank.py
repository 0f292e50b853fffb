"""Inside a pooled rank: run one method of a torch ``MultiProcessTestCase`` / ``MultiProcContinuousTest``.

torch's harnesses start ranks that build the test instance, set ``rank``, join a
process group and call the method (see [Note: how torch drives a rank]). A
pooled rank does the same steps on a process whose default group is already up,
so the only thing that changes for the test is that joining and leaving the
group cost nothing: see [Note: adopting the pool's group].
"""

from __future__ import annotations

import contextlib
import functools
import os
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: Task.kind of a MultiProcessTestCase method and of a MultiProcContinuousTest method.
SPAWN = "torch-spawn"
CONTINUOUS = "torch-continuous"


class RankSkip(Exception):
    """The test skipped itself in this rank (``SkipTest`` or a ``TEST_SKIPS`` exit code)."""


# [Note: adopting the pool's group]
# Test bodies (or ``@with_comms``'s ``init_pg``, ``_init_pg``, ``create_pg``) call
# ``init_process_group`` with a file store or ``init_method=file://...``, and
# ``destroy_process_group()`` at the end. While a pooled torch test runs, the first
# is answered by adopting the pool's default group when its world size and rank
# agree with the pool's and its backend is one the pool runs (gloo, or nccl / hccl
# under the matching emulation); anything else raises, naming the value and the way
# out. ``destroy_process_group()`` of the default group is a no-op: the pool keeps
# the group for the next test (groups the test made itself are destroyed by the
# worker as for every test). Outside a torch test both calls are torch's own.
@dataclass
class _Adoption:
    rank: int
    world_size: int
    profile: str  # "gloo", "nccl-emu" or "hccl-emu"


_ADOPTING: _Adoption | None = None
_INSTALLED = False


def _backend_names(backend: Any) -> list[str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``["gloo", "nccl"]``; ``"gloo"`` -> ``["gloo"]``."""
    text = str(backend).lower()
    return [part.split(":")[-1].strip() for part in text.split(",") if part.strip()]


def _check_backend(backend: Any, adoption: _Adoption) -> None:
    if backend is None:
        return
    names = _backend_names(backend)
    runnable = {"gloo", *(("nccl",) if adoption.profile == "nccl-emu" else ())}
    runnable |= {"hccl"} if adoption.profile == "hccl-emu" else set()
    # A device map such as "cpu:gloo,cuda:nccl" runs CPU tensors over gloo: fine on CPU ranks.
    if "cpu:gloo" in str(backend).lower().replace(" ", "") or all(n in runnable for n in names):
        return
    hint = {"nccl": "HP_TEST_BACKEND=nccl-emu", "hccl": "HP_TEST_BACKEND=hccl-emu"}
    fixes = [f"{hint[n]} runs it over emulated {n.upper()} on CPU" for n in names if n in hint]
    fixes.append("--hp-torch-testcases=torch runs the class with torch's own harness")
    raise RuntimeError(
        f"init_process_group(backend={backend!r}) in a test pooled by hp-testing: its ranks run "
        f"{adoption.profile}, which cannot serve {names}; " + "; ".join(fixes)
    )


def _adopting_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        adoption = _ADOPTING
        if adoption is None or not dist.is_initialized():
            return orig(*args, **kwargs)
        backend = kwargs.get("backend", args[0] if args else None)
        world = kwargs.get("world_size", -1)
        rank = kwargs.get("rank", -1)
        store = kwargs.get("store")
        if store is not None and world == -1:
            world = adoption.world_size
        if world not in (-1, adoption.world_size) or rank not in (-1, adoption.rank):
            raise RuntimeError(
                f"init_process_group(world_size={world}, rank={rank}) in a test pooled by hp-testing on "
                f"{adoption.world_size} ranks (this is rank {adoption.rank}): the pool adopts a group of "
                f"the class's world_size only; run this class the torch way with --hp-torch-testcases=torch "
                f"or @pytest.mark.torch_harness"
            )
        _check_backend(backend, adoption)
        return None  # the pool's default group is the test's group ([Note: adopting the pool's group])

    init_process_group.__hp_original__ = orig  # type: ignore[attr-defined]
    return init_process_group


def _keeping_destroy(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def destroy_process_group(group: Any = None) -> Any:
        if _ADOPTING is not None and (group is None or group is dist.GroupMember.WORLD):
            return None  # the pool keeps its group ([Note: adopting the pool's group])
        return orig(group)

    destroy_process_group.__hp_original__ = orig  # type: ignore[attr-defined]
    return destroy_process_group


def install_adoption() -> None:
    """Wrap ``init_process_group`` / ``destroy_process_group`` once per rank (inactive until a torch test)."""
    global _INSTALLED
    if _INSTALLED:
        return
    init, destroy = _adopting_init(dist.init_process_group), _keeping_destroy(dist.destroy_process_group)
    for module in (dist, c10d):
        module.init_process_group = init  # type: ignore[attr-defined]
        module.destroy_process_group = destroy  # type: ignore[attr-defined]
    _INSTALLED = True


@contextlib.contextmanager
def _adopting(rank: int, world_size: int, profile: str) -> Iterator[None]:
    global _ADOPTING
    _ADOPTING = _Adoption(rank, world_size, profile)
    try:
        yield
    finally:
        _ADOPTING = None


def _skip_message(code: object) -> str | None:
    """torch's message for an exit code in ``TEST_SKIPS`` (``@skip_if_lt_x_gpu`` exits 75-85)."""
    from torch.testing._internal.common_distributed import TEST_SKIPS

    for entry in TEST_SKIPS.values():
        if entry.exit_code == code:
            return f"{entry.message} (exit code {code})"
    return None


@contextlib.contextmanager
def _skips_as_torch_sees_them() -> Iterator[None]:
    try:
        yield
    except unittest.SkipTest as exc:
        raise RankSkip(str(exc)) from None
    except SystemExit as exc:
        message = _skip_message(exc.code)
        if message is None:
            raise
        raise RankSkip(message) from None


# [Note: subtests in a pooled rank]
# A rank calls the test method directly, outside unittest's run, so
# ``self.subTest(...)`` has no outcome to report to and a failure inside it
# surfaces as the bare assertion, with nothing saying which subtest failed.
# Each rank's instance gets an outcome whose result re-raises a subtest's
# failure at once, with a note naming the subtest (``subTest(scale=2.0)``), so
# the rank stops there as it does under torch's harness (the other ranks would
# otherwise wait in the subtest's collectives) and pytest's report names it; a
# skip inside a subtest skips the test, as it does in torch's spawned ranks.
class _SubTestReport:
    """The result a rank's instance reports its subtests to ([Note: subtests in a pooled rank])."""

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:  # unittest's name
        if err is None:
            return
        exc = err[1]
        exc.add_note(f"(in subTest {subtest._subDescription()} of {test._testMethodName})")
        raise exc

    def addSkip(self, test: Any, reason: str) -> None:  # unittest's name
        raise unittest.SkipTest(reason)


def _reporting_subtests(instance: Any) -> Any:
    """``instance`` with an outcome that names a failing subtest ([Note: subtests in a pooled rank])."""
    # typeshed leaves out unittest's private _Outcome, which exists at runtime (3.11+)
    instance._outcome = unittest.case._Outcome(_SubTestReport())  # type: ignore[attr-defined]
    return instance


def _class(module: Any, qualname: str) -> Any:
    """The class by its qualified name; generated classes (``instantiate_device_type_tests``) by name."""
    obj: Any = module
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        obj = getattr(module, qualname.rsplit(".", 1)[-1])
    return obj


# [Note: how torch drives a rank]
# ``MultiProcessTestCase`` (and ``DTensorTestBase``, ``DistributedTestBase``): the
# parent runs ``setUp`` (which spawns) and ``tearDown``; each rank runs
# ``cls._run``: ``cls(name)``, ``rank`` and ``file_name`` set, the RNG seeded,
# ``getattr(self, name)()``; a ``SkipTest`` or an exit code of ``TEST_SKIPS``
# (``@skip_if_lt_x_gpu``) skips the test as seen from rank 0. ``setUp`` and
# ``tearDown`` never run in a rank. ``MultiProcContinuousTest``: each rank sets the
# class's ``rank`` / ``world_size``, calls ``cls._init_pg`` once, then
# ``cls._run_test_given_id`` per test (its steps, here), again without ``setUp``.
def rank_body(task: Any, module: Any, rank: int, world_size: int, profile: str) -> Callable[[], None]:
    """What this rank runs for ``task`` ([Note: how torch drives a rank]); raises :class:`RankSkip`."""
    from torch.testing._internal import common_utils

    assert task.class_name is not None
    cls = _class(module, task.class_name)
    name = task.function_name
    extra = task.extra

    def spawn_family() -> None:
        os.environ.update(extra.get("env", {}))
        os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"
        with _adopting(rank, world_size, profile), _skips_as_torch_sees_them():
            instance = _reporting_subtests(cls(name))
            instance.rank = rank
            instance.file_name = extra["file_name"]
            common_utils.set_rng_seed()
            getattr(instance, name)()

    def continuous_family() -> None:
        os.environ.update(extra.get("env", {}))
        with _adopting(rank, world_size, profile), _skips_as_torch_sees_them():
            cls.rank = rank
            cls.world_size = world_size
            cls._init_pg(rank, world_size, extra["file_name"])
            # torch's _run_test_given_id, with the instance reporting its subtests
            instance = _reporting_subtests(cls(name))
            instance.rank, instance.world_size = cls.rank, cls.world_size
            method = getattr(instance, name)
            common_utils.set_rng_seed()
            method()

    return spawn_family if task.kind == SPAWN else continuous_family

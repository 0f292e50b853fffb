"""What one rank of a local-mode world owns: the process state a real rank would have to itself.

Why it is swapped at each switch between ranks, and what is (module globals,
RNG, default dtype, stdio, torchrun variables):
[Note: one process, many ranks' state] (above :class:`RankState`).
"""

from __future__ import annotations

import io
import os
import sys
import types
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__: list[str] = []

# Packages whose module globals are per rank; hp_testing's own stay shared (they run the world).
_PER_RANK_PREFIXES = ("hp_core", "hp_dtensor", "hp_fsdp", "hp_pipeline", "hp_torchtitan")
# hp_testing's record_collectives keeps each rank's open logs in a global, as a pool rank would.
_PER_RANK_MODULES = ("hp_testing.collectives",)
# The warnings machinery's process state: the filters, the "once" registry and where a warning
# goes (``pytest.warns`` / ``catch_warnings(record=True)`` point the last two at a list):
# [Note: each rank's warnings].
_WARNING_STATE = ("filters", "defaultaction", "onceregistry", "showwarning", "_showwarnmsg_impl")
# Modules whose functions tests patch (``mock.patch.object(dist, "new_group", ...)``):
# [Note: patched torch.distributed functions].
_PATCHED_MODULES = (dist, c10d)
_ABSENT = object()
_CONTAINERS = (dict, list, set)
_PLAIN = (int, float, str, bool, bytes, tuple, frozenset, type(None))


def _per_rank_globals(module: types.ModuleType) -> list[str]:
    """Names of ``module``'s data globals: the values a process would own privately.

    Globals the module declared rank-independent (:func:`hp_core.share_across_ranks`)
    are left out: every rank then sees the one object (see [Note: state shared
    by a process's ranks] in :mod:`hp_core.rank_shared`).
    """
    from hp_core import shared_across_ranks

    shared = shared_across_ranks(module.__name__)
    names = []
    for name, value in vars(module).items():
        if name.startswith("__") or name in shared:
            continue
        kind = type(value)  # not isinstance: it would touch deprecated module attributes that warn
        if kind in _CONTAINERS or kind in _PLAIN or issubclass(kind, (c10d._World, c10d.ProcessGroup)):
            names.append(name)
    return names


def _modules(packages: tuple[str, ...]) -> list[types.ModuleType]:
    found = [c10d]
    for name, module in list(sys.modules.items()):
        if module is not None and (name.split(".")[0] in packages or name in _PER_RANK_MODULES):
            found.append(module)
    return found


def _fork_value(value: Any) -> Any:
    """A rank's starting copy of a global: containers one level deep, a fresh c10d world."""
    kind = type(value)
    if issubclass(kind, c10d._World):
        return c10d._World()
    if kind in _CONTAINERS:
        return kind(value)
    return value


def _fork_all(values: Iterable[Any], memo: dict[int, Any]) -> list[Any]:
    """Fork ``values`` keeping aliases: one object under several names stays one object per rank.

    ``from hp_dtensor.ops.dispatch import RULES`` binds the same dict in two
    modules; a copy per (module, name) would split it, and a rule one module
    registers would be missing from the other's table. ``memo`` maps the id
    of an object the process holds to this rank's copy of it.
    """
    out = []
    for value in values:
        kind = type(value)
        if kind in _CONTAINERS or issubclass(kind, c10d._World):
            mine = memo.get(id(value))
            if mine is None:
                mine = memo[id(value)] = _fork_value(value)
            out.append(mine)
        else:
            out.append(value)
    return out


class Slots:
    """The (module, global name) pairs every rank owns a copy of.

    The packages are imported before the ranks start (see
    :func:`hp_testing.local.run_local_outcomes`), so each rank copies their
    globals as the import left them. A submodule first imported while the
    world runs joins at the next switch, and the other ranks then copy what
    the importing rank had left in it by then.
    """

    def __init__(self, packages: Iterable[str] = ()) -> None:
        self.packages = (*_PER_RANK_PREFIXES, *packages)
        self.pairs: list[tuple[types.ModuleType, str]] = []
        # (module namespace, name) per pair: a module's globals are its ``__dict__``, and indexing it
        # costs a third of getattr / setattr (see [Note: cheap switches]).
        self._slots: list[tuple[dict[str, Any], str]] = []
        self._known: set[str] = set()
        self._seen: tuple[int, str | None] = (-1, None)
        self._known.add(warnings.__name__)
        self.pairs.extend((warnings, name) for name in _WARNING_STATE)
        self._slots.extend((vars(warnings), name) for name in _WARNING_STATE)
        # [Note: patched torch.distributed functions]: the process's functions, to tell a rank's patch
        self.functions = [
            (vars(module), {k: v for k, v in vars(module).items() if callable(v) and not k.startswith("__")})
            for module in _PATCHED_MODULES
        ]
        self.grow()

    def grow(self) -> list[Any]:
        """Take in modules imported since the last call; the current values of their globals."""
        # sys.modules only grows at its end (a dict keeps insertion order), so its size and last
        # name tell whether anything was imported since; the size alone misses an import that came
        # with a removal (pytest and importlib remove modules too).
        seen = (len(sys.modules), next(reversed(sys.modules), None))
        if seen == self._seen:
            return []
        self._seen = seen
        added: list[tuple[types.ModuleType, str]] = []
        for module in _modules(self.packages):
            if module.__name__ in self._known:
                continue
            self._known.add(module.__name__)
            added.extend((module, name) for name in _per_rank_globals(module))
        self.pairs.extend(added)
        self._slots.extend((vars(module), name) for module, name in added)
        return [getattr(module, name) for module, name in added]

    def read(self) -> list[Any]:
        return [namespace[name] for namespace, name in self._slots]

    def write(self, values: list[Any]) -> None:
        """Put ``values`` back; a shorter list (saved before more modules joined) covers its prefix."""
        filters = warnings.filters
        for (namespace, name), value in zip(self._slots, values, strict=False):
            namespace[name] = value
        if warnings.filters != filters:
            _filters_changed()


# [Note: each rank's warnings]
# ``pytest.warns`` and ``warnings.catch_warnings`` replace the warnings module's
# filters and its ``showwarning`` for the duration of a ``with`` block: process
# state. A rank that blocks inside the block hands the turn to a rank that
# enters its own block; shared, the blocks would save and restore each other's
# settings, and a warning would land in another rank's list (or the test
# session's), so ``pytest.warns`` on a rank that communicates saw nothing.
# Each rank therefore owns these names like any module global. The interpreter
# remembers which warnings each module already showed (``__warningregistry__``)
# for one version of the filters; when a switch changes the filters that memory
# must be dropped, as changing the filters in one process does.
# [Note: patched torch.distributed functions]
# Tests patch torch.distributed's functions for a block (``with
# mock.patch.object(dist, "new_group", refuse):``); the patch saves the
# function it replaces and puts it back at the block's end. In one process
# shared by the ranks, rank 0 patches and blocks in a collective inside the
# block, rank 1 enters its block and saves rank 0's patch as "the original",
# and after both blocks the patch stays for good (hp-core's
# test_mesh_from_torch.py). So the functions of ``torch.distributed`` and
# ``distributed_c10d`` are each rank's own: a rank that leaves with some of
# them changed keeps its values and puts the process's back; it finds its
# own again when it enters. An unpatched switch costs one dict-view
# comparison per module (``items() <=``, done in C).
def _filters_changed() -> None:
    """Tell the interpreter the filters changed, through public API only."""
    # Entering and leaving catch_warnings bumps the filters' version and puts every setting back.
    with warnings.catch_warnings():
        pass


# [Note: cheap switches]
# A 64-rank step switches ranks thousands of times (each collective costs one
# switch per rank), so a switch must cost microseconds, not a hundred: slots
# are read and written by indexing the modules' namespaces (a module's
# globals are its ``__dict__``; ``getattr`` / ``setattr`` cost three times as
# much), and a rank's environment is compared and saved as ``os.environ``
# holds it, encoded (:func:`_encoded_environ`), and only the variables whose
# value differs are set (each set is a ``putenv``). The scheduler wakes only
# the rank that runs next (:mod:`hp_testing._local_world`).


# [Note: each rank's environment]
# A process's environment is its own: torchrun gives each rank its ``RANK``
# and ``LOCAL_RANK``, and a script sets variables itself (a device, a port, a
# test saving and restoring one) with ``os.environ[...] =``, not through
# ``monkeypatch``. So each local rank owns the whole environment, swapped like
# its globals: it starts as the launching thread's plus its torchrun variables,
# what it sets or deletes stays its own across switches, and the launching
# thread gets its own environment back when the world ends. Threads the code
# under test starts see the environment of the rank that holds the turn.
def _encoded_environ() -> dict[Any, Any]:
    """``os.environ``'s own table of encoded entries: equal tables compare in a microsecond.

    Decoding the environment (``dict(os.environ)``) costs tens of microseconds
    per switch; the table ``os.environ`` keeps (``_data``, in CPython's ``os``
    since 3.2) is what its ``__setitem__`` writes, so it is always current.
    """
    return os.environ._data  # type: ignore[attr-defined]


def _encoded_with(variables: dict[str, str]) -> dict[Any, Any]:
    """A copy of the process environment's table with ``variables`` set."""
    environ, table = os.environ, dict(_encoded_environ())
    for key, value in variables.items():
        table[environ.encodekey(key)] = environ.encodevalue(value)
    return table


def _put_environ(target: dict[Any, Any]) -> None:
    """Make the process environment ``target`` (an encoded table), setting only what differs.

    The tables of two ranks share the objects of the variables neither changed
    (both are copies of ``os.environ``'s), so most entries compare by identity,
    in a plain loop: cheaper than set differences of the items.
    """
    environ, now = os.environ, _encoded_environ()
    get = now.get
    for key in [key for key, value in target.items() if (old := get(key)) is not value and old != value]:
        environ[environ.decodekey(key)] = environ.decodevalue(target[key])
    if len(now) != len(target):  # ``now`` has every key of ``target`` by now: the others go
        for key in [key for key in now if key not in target]:
            del environ[environ.decodekey(key)]


# [Note: one process, many ranks' state]
# Local mode runs every rank of a world as a thread of one process, but the
# code under test keeps per-process state in module globals: torch's
# ``distributed_c10d`` holds the default group and the group maps, hp_core's
# mesh module caches groups by rank list, the RNG is one generator, and
# ``os.environ`` carries ``RANK``. Shared, rank 1 would find rank 0's groups.
#
# The ranks therefore run one at a time (see :mod:`hp_testing._local_world`)
# and switch only where a rank blocks in communication. At each switch the
# leaving rank's state is saved and the entering rank's is put back, as an
# operating system swaps processes:
#
# * module data globals (dicts, lists, sets, and plain values) of torch's
#   ``distributed_c10d``, of the packages a caller names (``state_packages``)
#   and of every loaded ``hp_*`` module but hp_testing's
#   (whose only per-rank global is ``record_collectives``' list of open logs):
#   each rank starts from a copy of what the process had (containers copied one
#   level, as ``fork`` would give it), then keeps its own; globals a module
#   declared rank-independent (``hp_core.share_across_ranks``: caches keyed by
#   global shapes, not by a rank or a mesh object) stay one object for all;
# * the warnings module's filters and destination (``pytest.warns`` on a rank
#   records that rank's warnings): [Note: each rank's warnings];
# * the CPU RNG state and the default dtype;
# * ``sys.stdout`` / ``sys.stderr`` (each rank writes to its own buffer) and
#   ``sys.excepthook`` (``init_process_group`` installs a rank-prefixing one);
# * the environment: the torchrun variables (``RANK``, ``LOCAL_RANK``, ...) and
#   what the rank sets itself: [Note: each rank's environment];
# * what the rank's ``monkeypatch`` fixture patched: [Note: a rank's monkeypatches].
#
# Only globals are swapped: state a module captured elsewhere (a class
# attribute, a closure, an ``lru_cache``) stays shared between the ranks, which
# is right for caches whose values do not depend on the rank and wrong for any
# that do; hp's packages keep rank-dependent state in module globals.
class RankState:
    """One rank's saved process state while another rank runs."""

    def __init__(self, slots: Slots, parent: list[Any], env: dict[str, str]) -> None:
        self.slots = slots
        self.globals = _fork_all(parent, {})
        self.rng = torch.Generator().get_state()  # a fresh process's default seed, as each pool test gets
        self.dtype = torch.get_default_dtype()
        self.stdout = io.StringIO()
        self.stderr = io.StringIO()
        self.excepthook = sys.excepthook
        self.environ = _encoded_with(env)  # the launching thread's, and the rank's torchrun variables
        self.functions: list[dict[str, Any]] = [{} for _ in slots.functions]  # its patched ones
        # this rank's monkeypatches (:mod:`hp_testing._local_patches`): in place only while it runs
        self.patches: list[Any] = []

    def adopt(self, values: list[Any], running: list[Any]) -> None:
        """Own a copy of the globals of modules imported since this rank last ran.

        ``running`` holds the importing rank's values of the slots known before
        the import: a new global bound to one of them (``from m import TABLE``)
        becomes this rank's own copy of it, not a second one.
        """
        memo = {id(theirs): mine for theirs, mine in zip(running, self.globals, strict=False)}
        self.globals.extend(_fork_all(values, memo))

    def enter(self) -> None:
        """Make this rank's state the process's."""
        self.slots.write(self.globals)
        for (namespace, _), mine in zip(self.slots.functions, self.functions, strict=True):
            for name, value in mine.items():
                if value is _ABSENT:
                    namespace.pop(name, None)
                else:
                    namespace[name] = value
        torch.set_rng_state(self.rng)
        torch.set_default_dtype(self.dtype)
        sys.stdout, sys.stderr, sys.excepthook = self.stdout, self.stderr, self.excepthook
        _put_environ(self.environ)  # see [Note: cheap switches]
        for patch in self.patches:
            patch.reapply()

    def leave(self) -> None:
        """Save what this rank changed, so the next rank can enter."""
        for patch in self.patches:
            patch.withdraw()
        for (namespace, original), mine in zip(self.slots.functions, self.functions, strict=True):
            mine.clear()
            if original.items() <= namespace.items():  # nothing patched: one C-level pass
                continue
            for name, value in original.items():
                now = namespace.get(name, _ABSENT)
                if now is not value:
                    mine[name] = now
                    namespace[name] = value
        self.globals = self.slots.read()
        self.environ = dict(_encoded_environ())
        self.rng = torch.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.excepthook = sys.excepthook


class HostState:
    """The launching thread's state, put back once the world has finished."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.globals = slots.read()
        self.rng = torch.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.stdout, self.stderr, self.excepthook = sys.stdout, sys.stderr, sys.excepthook
        self.environ = dict(_encoded_environ())

    def restore(self) -> None:
        """Put the launching thread's state back (modules the ranks imported keep the last rank's)."""
        sys.stdout, sys.stderr, sys.excepthook = self.stdout, self.stderr, self.excepthook
        _put_environ(self.environ)
        torch.set_rng_state(self.rng)
        torch.set_default_dtype(self.dtype)
        self.slots.write(self.globals)

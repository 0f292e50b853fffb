"""A pool of rank processes kept alive for a whole pytest session.

Spawning ranks per test costs seconds (torch's ``MultiProcessTestCase`` pays
about 2.6 s per 2-rank test); a pooled rank costs a pipe round trip. The pool
keeps that speed without letting one test poison the next:

- a test that fails cleanly on every rank gets a fresh default process group
  (a new store prefix, milliseconds), because a half-run test may leave
  unmatched collectives queued;
- a test that hangs, or whose ranks stop answering a few seconds after one
  rank failed, gets every still-running rank's Python stack printed, then the
  whole pool is killed and re-forked (a fraction of a second: the forkserver
  has torch imported already);
- a rank that dies (``os._exit``, a segfault) is reported with its exit code,
  and the pool is re-forked likewise.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from hp_testing._prestart import forkserver_context, start_forkserver
from hp_testing._worker import RunOptions, Task, TaskResult, WorkerConfig, worker_main

_CTX: Any = None
_STORE: Any = None
_STORE_PID: int | None = None

DEFAULT_GRACE_S = 3.0
DEFAULT_START_TIMEOUT_S = 180.0


def _context() -> Any:
    """The forkserver context, preloading torch once for every rank ever forked."""
    global _CTX
    if _CTX is None:
        ctx = forkserver_context()
        start_forkserver()
        _CTX = ctx
    return _CTX


_LIVE_POOLS: set[int] = set()  # id() of pools whose ranks are forked and not shut down


def preload(modules: list[str]) -> bool:
    """Restart the forkserver with ``modules`` imported too, while no pool of ours has ranks.

    [Note: preloading torch's harness]
    A torch test class's module imports ``torch.testing._internal.common_distributed``
    (and ``common_dtensor``), which costs about 1.6 s of CPU on top of torch's own
    import, in every rank that loads the module: 9.6 s for the 2- and 4-rank pools of a
    small session on a 2-core machine. Imported once in the forkserver, every rank forked
    from it has them for free; the restart costs one import of torch and them. Called
    after collection, before the first pool forks, by the plugin when torch classes are
    pooled. A forkserver this process did not start (pytest-forked's child) or one with
    live ranks (they die with it) is left alone. Returns whether it restarted.
    """
    global _CTX
    from multiprocessing import forkserver

    from hp_testing import _prestart

    server: Any = forkserver._forkserver
    if not modules or _LIVE_POOLS:
        return False
    if server._forkserver_pid is not None and _prestart._started_by != os.getpid():
        return False
    wanted = [*_prestart.PRELOAD, *modules]
    if getattr(server, "_preload_modules", None) == wanted and server._forkserver_pid is not None:
        return False  # already running with them
    ctx = forkserver_context()
    if server._forkserver_pid is not None:
        # Killed, not asked: it would first finish its own preload (seconds) before it noticed.
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()
    ctx.set_forkserver_preload(wanted)  # type: ignore[attr-defined]
    saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as _prestart.start_forkserver does
    try:
        if not _serve_forks_from_here(server, wanted):
            forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    _prestart._started_by = os.getpid()
    _CTX = ctx
    return True


# [Note: a forkserver forked from the pytest process]
# A new forkserver is a new interpreter: it imports torch and torch's harness
# again (3.8 s of CPU; over 10 s of wall time on a busy 2-core machine, longer
# than the 40 pooled tests it serves). After collection the pytest process
# has imported all of it already, so when it runs no thread beyond the one
# torch's import parks (a forkserver forks with that one too; a lock held by
# any other could be copied held) it forks the forkserver
# itself: the child runs multiprocessing's own forkserver loop on a new
# listener, with nothing left to import, and this process's multiprocessing
# state points at it. The child never returns into pytest (``os._exit``), and
# it ends, as a spawned forkserver does, when this process closes the "alive"
# pipe. With another thread running, the forkserver is spawned as before.
# The child freezes the garbage collector's view of everything it inherited
# (``gc.freeze()``, as Python's documentation advises before forking workers):
# the 300,000 objects of torch and its harness are never traversed again by a
# rank's collections, which would otherwise write to (and so copy) the pages
# every rank shares with it, in every rank that collects.
def _os_threads() -> int | None:
    """This process's OS threads (None where /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


#: Threads once torch is imported (the parked pool thread its import starts; forkservers fork with it).
_THREADS_AT_IMPORT = _os_threads()


def _serve_forks_from_here(server: Any, wanted: list[str]) -> bool:
    """Fork the forkserver from this process ([Note: a forkserver forked from the pytest process])."""
    from multiprocessing import connection, resource_tracker
    from multiprocessing import forkserver as mp_forkserver

    threads = _os_threads()
    if threads is None or threads != _THREADS_AT_IMPORT or threading.active_count() != 1:
        return False  # another thread could hold a lock the fork would copy held
    if any(name not in sys.modules for name in wanted):
        return False
    resource_tracker.ensure_running()  # before the fork: the ranks share this process's tracker
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forkserver: serve until the pytest process closes alive_w, never return
        code = 0
        try:
            os.close(alive_w)
            gc.freeze()  # the ranks forked from here: [Note: a forkserver forked from the pytest process]
            mp_forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    server._preload_modules = wanted
    return True


def _store() -> Any:
    """One TCPStore server per pytest process; every pool uses its own key prefix.

    The server lives in the parent so it survives any rank being killed.
    A forked child (pytest-forked) cannot use its parent's server thread, so it
    starts its own.
    """
    global _STORE, _STORE_PID
    if _STORE is None or os.getpid() != _STORE_PID:
        import torch.distributed as dist

        _STORE = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
            use_libuv=True,
        )
        _STORE_PID = os.getpid()
    return _STORE


@dataclass
class Outcome:
    """Everything the pool learnt about one task across its ranks."""

    world_size: int
    results: dict[int, TaskResult] = field(default_factory=dict)
    hung: dict[int, str] = field(default_factory=dict)  # rank -> stack dump
    died: dict[int, int | None] = field(default_factory=dict)  # rank -> exit code
    timed_out: bool = False
    timeout_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.hung
            and not self.died
            and len(self.results) == self.world_size
            and all(r.ok for r in self.results.values())
        )

    def failed_ranks(self) -> list[int]:
        return sorted(r for r, res in self.results.items() if not res.ok)


_POOL_NUMBERS = itertools.count()


class PoolError(RuntimeError):
    """The pool could not start or recover its ranks."""


class WorkerPool:
    """``world_size`` rank processes sharing one default process group."""

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        env: dict[str, str] | None = None,
        pg_timeout_s: float = 300.0,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.grace_s = grace_s
        self._env = dict(env or {})
        self._pg_timeout_s = pg_timeout_s
        self._generation = 0
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._stack_dir = tempfile.mkdtemp(prefix=f"hp-pool-{world_size}-")
        self._ready = False
        self._stop_requested = False
        self.restarts = 0
        self.reinits = 0
        self.runs = 0
        self._names_from: int | None = None  # where the next task's group names start, if it moves
        # Unique for the life of the process: the store outlives pools, and a key made of the
        # object's address was reused by a later pool, whose ranks then read the dead pool's
        # addresses from the store ("Connection refused" at start).
        self._key = f"ws{world_size}-{os.getpid()}-{next(_POOL_NUMBERS)}"

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        """Fork the ranks; they join the group in the background (see ``wait_ready``)."""
        ctx = _context()
        store = _store()
        _LIVE_POOLS.add(id(self))
        self._stop_requested = False
        self._generation += 1
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            # Tasks (with their pickled fixture values) and results travel as pickles over this
            # pipe: a socketpair between this process and its own child, which nothing on the
            # network can reach. Only the TCPStore is reachable, and it carries JSON (see _wire).
            parent, child = ctx.Pipe(duplex=True)
            cfg = WorkerConfig(
                rank=rank,
                world_size=self.world_size,
                store_host="127.0.0.1",
                store_port=store.port,
                pool_key=f"{self._key}-g{self._generation}",
                backend=self.backend,
                pg_timeout_s=self._pg_timeout_s,
                stack_file=self._stack_path(rank),
                env=self._rank_env(rank, store.port),
            )
            proc = ctx.Process(target=worker_main, args=(cfg, child), name=f"hp-rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._ready = False

    def _rank_env(self, rank: int, port: int) -> dict[str, str]:
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # Like torchrun's agent store: an env:// init connects as a client,
            # under a key prefix that changes with each new process group.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(self._generation),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        env.update(self._env)
        return env

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.stack")

    def wait_ready(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Block until every rank has joined the process group (forking them if none are alive)."""
        if self._ready:
            return
        if not self._procs:  # a start that failed killed them: try again for this task
            self.start()
        deadline = time.monotonic() + timeout_s
        waiting = set(range(self.world_size))
        errors: dict[int, str] = {}
        while waiting:
            left = deadline - time.monotonic()
            by_obj: dict[Any, int] = {self._conns[r]: r for r in waiting}
            by_obj.update({self._procs[r].sentinel: r for r in waiting})
            ready = wait(list(by_obj), timeout=max(left, 0))
            if not ready:
                break
            for obj in ready:
                rank = by_obj[obj]
                if rank not in waiting:
                    continue
                msg = self._recv(rank)
                if msg is None:
                    self._procs[rank].join(1)
                    errors[rank] = f"exited with code {self._procs[rank].exitcode} while starting"
                elif msg[0] == "init-failed":
                    errors[rank] = msg[1]
                elif msg[0] != "ready":
                    continue
                waiting.discard(rank)
        if waiting or errors:
            detail = "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
            missing = f"ranks {sorted(waiting)} did not join within {timeout_s:.0f} s\n" if waiting else ""
            self._kill()
            raise PoolError(f"could not start a {self.world_size}-rank pool:\n{missing}{detail}")
        self._ready = True

    def _recv(self, rank: int) -> Any:
        conn = self._conns[rank]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            return None
        return None if not self._procs[rank].is_alive() else ("pending",)

    def request_stop(self) -> None:
        """Ask every rank to stop, without waiting: :meth:`shutdown` waits (several pools side by side)."""
        if self._stop_requested:
            return
        self._stop_requested = True
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("stop",))

    def shutdown(self) -> None:
        """Stop every rank; kill the ones that do not stop within a second."""
        self.request_stop()
        deadline = time.monotonic() + 1.0
        for proc in self._procs:
            proc.join(max(deadline - time.monotonic(), 0))
        self._kill()
        _LIVE_POOLS.discard(id(self))
        with contextlib.suppress(OSError):
            for name in os.listdir(self._stack_dir):
                os.unlink(os.path.join(self._stack_dir, name))
            os.rmdir(self._stack_dir)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._procs, self._conns = [], []
        self._ready = False

    def restart(self) -> None:
        """Kill every rank and fork a new set (after a hang or a dead rank)."""
        self._kill()
        self.restarts += 1
        self.start()
        self.wait_ready()

    def reinit(self) -> None:
        """Give the live ranks a fresh default process group (after a clean failure)."""
        self._generation += 1
        self.reinits += 1
        for conn in self._conns:
            conn.send(("reinit", self._generation))
        self._ready = False
        try:
            self.wait_ready(timeout_s=60.0)
        except PoolError:
            self.restart()

    # -- running ---------------------------------------------------------

    def run(self, task: Task, timeout_s: float, options: RunOptions | None = None) -> Outcome:
        """Run ``task`` on every rank; always leaves the pool ready for the next task.

        ``options`` carries the emulation layer's settings (checks, strict mode,
        faults); the pool gives each run its own store prefix for the checks.
        """
        self.wait_ready()
        self.runs += 1
        base = options if options is not None else RunOptions()
        prefix = f"hp-check/{self._key}/g{self._generation}/r{self.runs}"
        options = RunOptions(
            prefix=prefix,
            checks=base.checks,
            strict=base.strict,
            faults=base.faults,
            names_from=self._names_from,
        )
        self._names_from = None
        outcome = Outcome(world_size=self.world_size, timeout_s=timeout_s)
        pending = set(range(self.world_size))
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(("run", task, options))
            except (BrokenPipeError, OSError):
                outcome.died[rank] = self._procs[rank].exitcode
                pending.discard(rank)
        deadline = time.monotonic() + timeout_s
        fail_deadline: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if fail_deadline is None else min(deadline, fail_deadline)
            by_obj: dict[Any, int] = {self._conns[r]: r for r in pending}
            by_obj.update({self._procs[r].sentinel: r for r in pending})
            ready = wait(list(by_obj), timeout=max(limit - now, 0))
            if not ready:
                outcome.timed_out = fail_deadline is None or deadline <= fail_deadline
                break
            for obj in ready:
                rank = by_obj[obj]
                if rank not in pending:
                    continue
                msg = self._recv(rank)
                if msg is None:
                    self._procs[rank].join(1)
                    outcome.died[rank] = self._procs[rank].exitcode
                    _post_death(prefix, rank, outcome.died[rank])
                elif msg[0] == "result":
                    outcome.results[rank] = msg[1]
                else:
                    continue
                pending.discard(rank)
                bad = rank in outcome.died or not outcome.results[rank].ok
                if bad and fail_deadline is None:
                    fail_deadline = time.monotonic() + self.grace_s
        if pending:
            outcome.hung = self._dump_stacks(sorted(pending))
        if outcome.ok:  # the largest over the ranks: [Note: group names across pooled tests]
            counts = [r.names_from for r in outcome.results.values() if r.names_from is not None]
            self._names_from = max(counts) if counts else None
        self._recover(outcome)
        return outcome

    def _recover(self, outcome: Outcome) -> None:
        if (
            outcome.hung
            or outcome.died
            or not outcome.ok
            or any(r.needs_reinit for r in outcome.results.values())
        ):
            self._names_from = None  # fresh groups, fresh names
        if outcome.hung or outcome.died:
            self.restart()
        elif not outcome.ok or any(r.needs_reinit for r in outcome.results.values()):
            self.reinit()

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each hung rank for its Python stack (see [Note: stack dumps of hung ranks])."""
        offsets = {}
        for rank in ranks:
            path = self._stack_path(rank)
            offsets[rank] = os.path.getsize(path) if os.path.exists(path) else 0
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 2.0
        for rank in ranks:
            path = self._stack_path(rank)
            text, last_size = "", -1
            while time.monotonic() < deadline:
                size = os.path.getsize(path) if os.path.exists(path) else 0
                if size > offsets[rank] and size == last_size:
                    break  # the dump stopped growing
                last_size = size
                time.sleep(0.05)
            with contextlib.suppress(OSError), open(path) as f:
                f.seek(offsets[rank])
                text = f.read()
            stacks[rank] = _trim_stack(text) or "(no stack: the rank did not answer SIGUSR1)"
        return stacks


def _post_death(prefix: str, rank: int, code: int | None) -> None:
    """Tell the live ranks' checks that ``rank`` died, so they stop waiting for it now.

    A JSON record, as every value the checks read from the store
    ([Note: nothing read from the store is executed] in :mod:`hp_testing._wire`).
    """
    from hp_testing._sidechannel import announce_exit

    with contextlib.suppress(Exception):
        announce_exit(_store(), prefix, rank, code, "Its process ended in the middle of the test.")


def _trim_stack(text: str) -> str:
    """Drop the harness's own frames (the worker loop, multiprocessing) from a dump."""
    kept = []
    for line in text.strip().splitlines():
        if "hp_testing/_worker.py" in line or "/multiprocessing/" in line or 'File "<string>"' in line:
            continue
        kept.append(line)
    return "\n".join(kept)

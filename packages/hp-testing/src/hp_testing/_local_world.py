"""The scheduler of local mode: every rank a thread, one running at a time, switching where one blocks.

[Note: cooperative ranks]
Only the rank that holds the turn runs; it gives the turn away only where it
would block in communication (a collective its peers have not all issued, a
receive nobody sent yet), to the next rank in rank order (after itself,
wrapping) that can go on, and wakes that rank alone. The rank taking the turn
puts its own process state back first (:mod:`hp_testing._local_state`), so
each rank sees the globals, RNG and environment it would have in its own
process, and a run is deterministic: the same ranks switch at the same points.

When no live rank can go on, none ever will (nothing runs concurrently): the
world fails every waiting rank with what each one waits in, and which ranks
ended (returned or raised) before issuing what their peers wait for, instead
of waiting for a timeout.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hp_testing._local_state import HostState, RankState, Slots

__all__: list[str] = []


class LocalHangError(RuntimeError):
    """Every live rank of a local world waits for communication that can no longer happen."""


_tls = threading.local()


def current() -> tuple[World, int]:
    """The world and rank of the calling thread (a local-mode rank)."""
    world = getattr(_tls, "world", None)
    if world is None:
        raise RuntimeError(
            "hp_testing local mode: this thread is not a rank of a local world; the 'hplocal' backend "
            "only works inside hp_testing.run_local, @pytest.mark.distributed(..., mode='local') "
            "or hp-run --local"
        )
    return world, _tls.rank


def on_rank() -> bool:
    """Whether the calling thread is a rank of a local world (and not the thread that launched it)."""
    return getattr(_tls, "world", None) is not None


@dataclass
class RankOutcome:
    """What one rank of a local world did."""

    rank: int
    ok: bool = True
    value: Any = None
    error: str = ""
    exception: BaseException | None = None
    stdout: str = ""
    stderr: str = ""


@dataclass
class _Wait:
    ready: Callable[[], bool]
    what: str


@dataclass
class World:
    """One local world: its ranks' states, the turn, and what each waiting rank waits for."""

    size: int
    slots: Slots
    p2p_tags: bool = True  # receives match sends by tag (gloo); False: in issue order (NCCL, HCCL)
    states: dict[int, RankState] = field(default_factory=dict)
    running: int | None = None  # the rank whose process state is in the process
    alive: set[int] = field(default_factory=set)
    ended: dict[int, str] = field(default_factory=dict)  # rank -> "returned" / "raised X"
    waiting: dict[int, _Wait] = field(default_factory=dict)
    stalled: str | None = None
    # Shared by the backend's groups: rendezvous of collectives and p2p channels.
    pending: dict[Any, Any] = field(default_factory=dict)
    channels: dict[Any, Any] = field(default_factory=dict)
    # One lock per rank, held (locked) while that rank may not run: releasing it gives that rank
    # the turn, and a rank that gives the turn away blocks on its own ([Note: cooperative ranks]).
    _turns: list[threading.Lock] = field(default_factory=list)
    _fresh: set[int] = field(default_factory=set)  # ranks that have not run yet

    # -- switching (called by the rank that holds the turn) ----------------------------------------

    def switch_in(self, rank: int) -> None:
        if self.running == rank:
            return
        known = len(self.slots.pairs)
        imported = self.slots.grow()
        if imported:
            running = self.slots.read()[:known]  # the importing rank's (or the host's) values
            for other, state in self.states.items():
                if other != self.running:
                    state.adopt(imported, running)
        if self.running is not None:
            self.states[self.running].leave()
        self.states[rank].enter()
        self.running = rank

    def block_until(self, ready: Callable[[], bool], what: str) -> None:
        """Give the turn away until ``ready()``; raise :class:`LocalHangError` if it never can be."""
        _, rank = current()
        if ready():
            return
        self.waiting[rank] = _Wait(ready, what)
        try:
            while not ready():
                if self.stalled is not None:
                    raise LocalHangError(self.stalled)
                following = self._next_after(rank)
                if following is None:
                    self._stall()
                    continue
                self._turns[following].release()
                self._turns[rank].acquire()  # until a rank gives the turn back to this one
        finally:
            del self.waiting[rank]
            self.switch_in(rank)

    def wake(self) -> None:
        """Something completed: nothing to do, the next rank is chosen when the running one blocks."""

    def _next_after(self, rank: int) -> int | None:
        """The first rank after ``rank`` (in rank order, wrapping) that can go on, or None."""
        size, fresh, waiting, stalled = self.size, self._fresh, self.waiting, self.stalled is not None
        for step in range(1, size):
            other = (rank + step) % size
            if other in fresh:
                return other
            wait = waiting.get(other)
            if wait is not None and (stalled or wait.ready()):
                return other
        return None

    def _stall(self) -> None:
        """No live rank can go on: record why; every waiting rank raises it when it gets the turn."""
        lines = [f"rank {rank} waits in {wait.what}" for rank, wait in sorted(self.waiting.items())]
        lines += [f"rank {rank} {how}" for rank, how in sorted(self.ended.items())]
        self.stalled = (
            f"local world of {self.size} ranks stopped: every live rank waits for communication no rank "
            "can still issue (a real backend would hang here):\n  "
            + "\n  ".join(lines)
            + "\nEvery rank of a group must issue the same collectives on it in the same order, and "
            "each send needs its receive."
        )

    # -- rank threads -----------------------------------------------------------------------------

    def _rank_main(self, rank: int, body: Callable[[int], Any], out: RankOutcome) -> None:
        _tls.world, _tls.rank = self, rank
        self._turns[rank].acquire()  # the first turn
        self._fresh.discard(rank)
        try:
            self.switch_in(rank)
            out.value = body(rank)
            self.ended[rank] = "returned (ended)"
        except BaseException as exc:  # reported per rank, like a failing process
            out.ok = False
            out.exception = exc
            out.error = "".join(traceback.format_exception(exc))
            self.ended[rank] = f"raised {type(exc).__name__} (ended)"
        finally:
            state = self.states[rank]
            out.stdout, out.stderr = state.stdout.getvalue(), state.stderr.getvalue()
            self.alive.discard(rank)
            following = self._next_after(rank)
            if following is None and self.alive:
                self._stall()  # the ranks left all wait for something this one never issued
                following = self._next_after(rank)
            if following is not None:
                self._turns[following].release()

    def run(self, body: Callable[[int], Any], env: Callable[[int], dict[str, str]]) -> list[RankOutcome]:
        """Run ``body(rank)`` on every rank; the calling thread's process state is put back after."""
        envs = [env(rank) for rank in range(self.size)]
        host = HostState(self.slots)
        parent = self.slots.read()
        self.states = {rank: RankState(self.slots, parent, envs[rank]) for rank in range(self.size)}
        self.alive = set(range(self.size))
        self._fresh = set(range(self.size))
        self._turns = [threading.Lock() for _ in range(self.size)]
        for turn in self._turns:
            turn.acquire()
        outcomes = [RankOutcome(rank) for rank in range(self.size)]
        threads = [
            threading.Thread(
                target=self._rank_main, args=(rank, body, outcomes[rank]), name=f"hp-local-rank{rank}"
            )
            for rank in range(self.size)
        ]
        try:
            for thread in threads:
                thread.start()
            self._turns[0].release()  # rank 0 goes first
            for thread in threads:
                thread.join()
        finally:
            self.running = None
            host.restore()
        return outcomes

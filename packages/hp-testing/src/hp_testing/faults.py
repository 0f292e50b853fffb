"""Fault injection: delay a rank, fail or kill it at its k-th collective, drop a message.

Faults are plain frozen dataclasses, so they travel in the marker to the ranks::

    from hp_testing import faults

    @pytest.mark.distributed(world_size=2, faults=[faults.fail(rank=1, at=2)])
    def test_recovers(rank):
        ...

Counting is per rank and per test, from 0: ``at=2`` is the third collective
that rank issues (object collectives and barriers count; point-to-point
transfers count only for :func:`drop`, as sends). A fault that never fired is
reported, so a test cannot silently stop exercising its error path; after
any fired fault the next test gets a fresh process group.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fault", "InjectedFault", "delay", "drop", "fail", "kill"]


class InjectedFault(RuntimeError):
    """Raised on the rank where :func:`fail` fires, as a backend error would be."""


@dataclass(frozen=True)
class Fault:
    """One planned fault; build it with :func:`delay`, :func:`fail`, :func:`kill` or :func:`drop`."""

    kind: str
    rank: int
    at: int | None = None
    seconds: float = 0.0
    exit_code: int = 77

    def __post_init__(self) -> None:
        if self.kind not in ("delay", "fail", "kill", "drop"):
            raise ValueError(f"unknown fault kind {self.kind!r}; use delay, fail, kill or drop")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"fault rank must be an int >= 0, got {self.rank!r}")
        if self.at is not None and (not isinstance(self.at, int) or self.at < 0):
            raise ValueError(f"fault 'at' must be an int >= 0 (0 = the first call), got {self.at!r}")
        if self.kind != "delay" and self.at is None:
            raise ValueError(f"a {self.kind} fault needs at=K (the K-th call on rank {self.rank}, from 0)")

    def describe(self) -> str:
        where = "every collective" if self.at is None else f"collective #{self.at}"
        if self.kind == "delay":
            return f"delay rank {self.rank} by {self.seconds:g} s before {where}"
        if self.kind == "fail":
            return f"fail rank {self.rank} at {where}"
        if self.kind == "kill":
            return f"kill rank {self.rank} (exit code {self.exit_code}) at {where}"
        return f"drop send #{self.at} of rank {self.rank}"


def delay(rank: int, seconds: float, at: int | None = None) -> Fault:
    """Sleep ``seconds`` on ``rank`` before its ``at``-th collective (every one when ``at`` is None)."""
    if seconds < 0:
        raise ValueError(f"delay seconds must be >= 0, got {seconds!r}")
    return Fault("delay", rank, at, seconds=float(seconds))


def fail(rank: int, at: int) -> Fault:
    """Raise :class:`InjectedFault` on ``rank`` at its ``at``-th collective; the peers stop waiting."""
    return Fault("fail", rank, at)


def kill(rank: int, at: int, exit_code: int = 77) -> Fault:
    """End ``rank``'s process with ``exit_code`` at its ``at``-th collective."""
    return Fault("kill", rank, at, exit_code=exit_code)


def drop(rank: int, at: int) -> Fault:
    """Lose ``rank``'s ``at``-th point-to-point send: the receiver gets an error instead of a hang."""
    return Fault("drop", rank, at)

"""The planned faults of one test on one rank: counting calls, firing the due fault, reporting.

A :class:`FaultPlan` is consulted by every checked call before it is compared
with the other ranks (see :mod:`hp_testing._routes`): collectives, object
collectives and barriers count as ``"collective"``, sends as ``"send"``.
What each fault does is described in :mod:`hp_testing.faults`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from hp_testing.faults import Fault, InjectedFault

__all__ = ["FaultPlan"]


class FaultPlan:
    """The faults of the current test on this rank, and the ones that fired so far."""

    def __init__(self, rank: int = -1, faults: tuple[Fault, ...] = ()) -> None:
        self.rank = rank
        self.faults = tuple(faults)
        self.fired: list[str] = []
        self.counts = {"collective": 0, "send": 0}

    def fire(self, kind: str, post_failure: Callable[[str], None]) -> Fault | None:
        """Count one call of ``kind``; run the fault due at it (a drop is returned, not run).

        ``post_failure`` tells the peers before an injected failure raises, so
        they stop waiting for this rank at once.
        """
        if not self.faults:
            return None
        index = self.counts[kind]
        self.counts[kind] = index + 1
        for fault in self.faults:
            if fault.rank != self.rank:
                continue
            if kind == "send" and fault.kind == "drop" and fault.at == index:
                self.fired.append(fault.describe())
                return fault
            if kind == "collective" and fault.kind != "drop" and (fault.at is None or fault.at == index):
                if fault.kind == "delay":
                    if fault.describe() not in self.fired:
                        self.fired.append(fault.describe())
                    time.sleep(fault.seconds)
                    continue
                self.fired.append(fault.describe())
                if fault.kind == "kill":
                    os._exit(fault.exit_code)
                message = f"injected fault: {fault.describe()}"
                post_failure(message)
                raise InjectedFault(message)
        return None

    def unfired(self) -> list[Fault]:
        """This rank's faults that should have fired by now and did not (delays excepted)."""
        fired = set(self.fired)
        mine = [f for f in self.faults if f.rank == self.rank and f.kind != "delay"]
        return [f for f in mine if f.describe() not in fired]

    def check_all_fired(self) -> None:
        """End of a passing test: a fault that never fired means the error path never ran."""
        unfired = self.unfired()
        if unfired:
            raise InjectedFault(
                "planned fault(s) never fired on this rank: "
                + "; ".join(f.describe() for f in unfired)
                + ". The test issued fewer calls than the fault's at=; lower it so the error path runs."
            )

    def report(self) -> list[str]:
        """The faults that fired plus the ones that never did, for the test report."""
        return list(self.fired) + [
            f"did NOT fire: {f.describe()} (the rank issued fewer calls)" for f in self.unfired()
        ]

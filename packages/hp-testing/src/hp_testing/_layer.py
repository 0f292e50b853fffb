"""The emulation layer's per-process state and its lifecycle: one test (or one ``hp-run`` script) at a time.

A rank process holds one :class:`Layer` from :func:`hp_testing.emulation.install`
until it ends. For each test the worker calls, in order:

1. :meth:`Layer.begin_test`: the test's settings (checks, strict mode, faults)
   and a fresh :class:`~hp_testing._sidechannel.SideChannel` under the test's
   store prefix;
2. the test body, whose calls go through :mod:`hp_testing._routes`;
3. :meth:`Layer.finish_test` if the body passed (faults that never fired, work
   never waited, messages never received), or :meth:`Layer.post_failure` /
   :meth:`Layer.post_exit` if it did not, so the peers stop waiting;
4. :meth:`Layer.end_test`, always: forget the test, report its faults.

Under ``hp-run`` there is no test: the side channel is made on first use
(``channel_factory``) and ``check_unwaited`` runs once the script has ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from hp_testing._calls import Call
from hp_testing._fault_plan import FaultPlan
from hp_testing._sidechannel import SideChannel
from hp_testing._strict import StrictMode
from hp_testing.faults import Fault
from hp_testing.profiles import Profile

__all__ = ["Layer"]


class Layer:
    """The per-process emulation state: profile, checks, strict mode, faults, the current test."""

    def __init__(self, profile: Profile, *, checks: bool = True, strict: bool = False) -> None:
        self.profile = profile
        self.checks = checks
        self.strict = strict
        self.channel: SideChannel | None = None
        self.channel_factory: Callable[[], SideChannel | None] | None = None
        self.plan = FaultPlan()
        self.hazards = StrictMode()
        self.calls = 0  # checked calls issued by this process (tests of the layer count them)

    # -- per test ------------------------------------------------------------------

    def begin_test(
        self,
        store: Any,
        prefix: str,
        *,
        checks: bool,
        strict: bool,
        faults: tuple[Fault, ...] = (),
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.checks, self.strict = checks, strict
        self.plan = FaultPlan(rank, tuple(faults))
        self.channel = self.new_channel(store, prefix, rank, world) if checks and store is not None else None
        self.hazards.clear()
        if strict:
            self.hazards.guard.warm_up()

    def new_channel(self, store: Any, prefix: str, rank: int, world: int) -> SideChannel:
        """A side channel with this profile's p2p semantics (see :mod:`hp_testing.profiles`)."""
        return SideChannel(
            store,
            prefix,
            rank,
            world,
            stream_ordered=self.profile.stream_ordered_p2p,
            tags=self.profile.p2p_tags,
            batch_joins_group=self.profile.first_batch_joins_group,
        )

    def post_failure(self, text: str) -> None:
        """Tell the peers this rank failed, so their waits end with this rank's error."""
        channel = self.channel
        if channel is not None:
            try:
                channel.post_status("failed", text)
            except Exception:  # the store is gone: the pool reports the failure anyway
                pass

    def post_exit(self, code: int) -> None:
        """Tell the peers this rank ends now (``sys.exit`` in a test), so their waits end with its code."""
        channel = self.channel
        if channel is not None:
            try:
                channel.post_status("exited", "It called sys.exit() in the middle of the test.", code)
            except Exception:  # the store is gone: the pool reports the failure anyway
                pass

    def finish_test(self) -> None:
        """End-of-test checks on a rank whose body passed: faults, never-waited work, unmatched p2p."""
        self.plan.check_all_fired()
        self.check_unwaited()
        if self.channel is not None:
            self.channel.finish()

    def check_unwaited(self) -> None:
        """Strict mode: raise for async work never waited (end of a test, or of an ``hp-run`` script)."""
        self.hazards.check_unwaited()

    def end_test(self) -> list[str]:
        """Forget the test; return the faults that fired plus the ones that never did."""
        report = self.plan.report()
        self.channel = None
        self.plan = FaultPlan()
        self.hazards.clear()
        return report

    # -- pieces the routes use -------------------------------------------------------

    def side_channel(self) -> SideChannel | None:
        """The test's side channel (made on first use under ``hp-run``), None when checks are off."""
        if self.channel is None and self.checks and self.channel_factory is not None:
            self.channel = self.channel_factory()
        return self.channel

    def fire(self, kind: str) -> Fault | None:
        """Count one call for the fault plan; a due fault runs (a due drop is returned)."""
        return self.plan.fire(kind, self.post_failure)

    def check_collective(self, call: Call, *, defer: bool = False) -> Callable[[], None] | None:
        """Rules, faults and cross-rank checks of one collective, classic or functional (:mod:`._funcol`)."""
        from hp_testing._routes import check_collective

        return check_collective(self, call, defer=defer)

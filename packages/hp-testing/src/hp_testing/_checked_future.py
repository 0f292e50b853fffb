"""The future of a checked async work handle: waiting on it runs the handle's deferred checks first.

``work.get_future().wait()`` is how DDP's comm hooks and some training loops
wait for an async collective; it must find what ``work.wait()`` finds (the
cross-rank comparison deferred to the wait, p2p matching, strict mode's
hand-over), not skip it. :class:`CheckedFuture` completes with the real
work's future; its ``wait()`` waits the checked handle first. Callbacks
chained with ``then()`` run when the communication ends, as they would on
NCCL, and may read ``value()`` there; the checks run when something waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CheckedFuture"]


class CheckedFuture(torch.futures.Future):
    """A ``torch.futures.Future`` that mirrors ``inner`` and waits ``wait_work`` before answering."""

    def __init__(self, wait_work: Callable[[], object], inner: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._wait_work = wait_work
        inner.add_done_callback(self._mirror)

    def _mirror(self, inner: torch.futures.Future[Any]) -> None:
        try:
            result = inner.value()
        except Exception as exc:  # the real work failed: so does this future
            self.set_exception(exc)
        else:
            self.set_result(result)

    def wait(self) -> Any:
        self._wait_work()  # the checks ``work.wait()`` runs, then the real wait
        return super().wait()

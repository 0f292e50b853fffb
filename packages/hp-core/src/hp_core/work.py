"""Async work handles whose ``wait()`` also finishes the job.

Several operations are emulated in two halves: communicate now, then fix the
result up once the data has arrived (divide by the group size for an emulated
average, copy the slices of an uneven all-gather out of a padded buffer). A
torch ``Work`` only knows about the first half, so callers of an async
emulated collective would have to remember the second. :class:`Work` bundles
both: ``wait()`` waits for every underlying handle, then runs the
post-processing exactly once, then returns the result.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Work"]

T = TypeVar("T")


class Work(Generic[T]):
    """A handle for communication in flight; ``wait()`` returns the finished result.

    ``handles`` are torch ``Work`` objects (or anything with ``wait()``),
    ``post`` runs once after all of them completed, and ``result`` is what
    ``wait()`` returns (the output tensor, usually).
    """

    __slots__ = ("_done", "_handles", "_post", "_result")

    def __init__(
        self,
        handles: Sequence[Any] = (),
        post: Callable[[], object] | None = None,
        result: T = None,  # type: ignore[assignment]
    ) -> None:
        self._handles = [h for h in handles if h is not None]
        self._post = post
        self._result = result
        self._done = False

    @classmethod
    def completed(cls, result: T) -> Work[T]:
        """A handle for work that already finished (synchronous paths, size-one groups)."""
        work: Work[T] = cls((), None, result)
        work._done = True
        return work

    def wait(self, timeout: datetime.timedelta | None = None) -> T:
        """Block until the communication finished and the result is final, then return it.

        Calling it again is cheap and returns the same result.
        """
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(
                f"Work.wait: timeout must be a datetime.timedelta or None, got {timeout!r} "
                f"({type(timeout).__name__}); e.g. wait(timeout=datetime.timedelta(seconds={timeout!r}))."
            )
        if not self._done:
            for handle in self._handles:
                if timeout is None:
                    handle.wait()
                else:
                    handle.wait(timeout)
            if self._post is not None:
                self._post()
            self._done = True
            self._handles = []
            self._post = None
        return self._result

    def is_completed(self) -> bool:
        """Whether ``wait()`` already ran (the post-processing runs only inside ``wait()``)."""
        return self._done

    def __repr__(self) -> str:
        state = "done" if self._done else f"pending({len(self._handles)} handle(s))"
        return f"Work({state})"

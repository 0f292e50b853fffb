"""The error every pass raises for a schedule it cannot accept."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hp_pipeline.ir import MetaStep, format_order

__all__ = ["ScheduleError"]

_MAX_LISTED = 8


class ScheduleError(ValueError):
    """A schedule (an order) is malformed, incomplete or would deadlock.

    A ``ValueError`` so callers that guard configuration with ``except ValueError``
    catch it too. The message lists the problems and then prints the rank x step
    grid with every offending step drawn as ``>2F0<``, because a schedule bug is
    far easier to see in the grid than in a sentence.

    Attributes:
        summary: one line saying which rule failed.
        problems: one sentence per offending step.
        marks: the ``(rank, position)`` of each offending step.
    """

    def __init__(
        self,
        summary: str,
        order: Mapping[int, Sequence[MetaStep]],
        problems: Sequence[str] = (),
        marks: Iterable[tuple[int, int]] = (),
    ) -> None:
        self.summary = summary
        self.problems = list(problems)
        self.marks = sorted(set(marks))
        lines = [summary]
        lines += [f"  - {p}" for p in self.problems[:_MAX_LISTED]]
        if len(self.problems) > _MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - _MAX_LISTED} more")
        lines.append(format_order(order, self.marks))
        super().__init__("\n".join(lines))

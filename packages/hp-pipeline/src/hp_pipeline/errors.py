"""The errors of hp-pipeline: a schedule it cannot accept, and a step that failed on some rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from hp_pipeline.ir import MetaStep, format_order

__all__ = ["PipelineStepError", "ScheduleError", "StageFailure"]

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


@dataclass(frozen=True)
class StageFailure:
    """What one rank reports when a pipeline step failed there (see [Note: failures] in executor).

    Attributes:
        rank: the global rank that raised.
        stage: the stage whose step raised, or ``None`` if it failed outside any step
            (splitting the batch, a missing argument).
        step: the step's text form (``"2F1"``), or ``""``.
        error: ``"TypeName: message"`` of the original exception.
        traceback: the formatted traceback on the failing rank.
        exception: the original exception, on the failing rank only (not sent to peers).
    """

    rank: int
    stage: int | None
    step: str
    error: str
    traceback: str
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    def portable(self) -> StageFailure:
        """A copy without the exception object, safe to pickle to other ranks."""
        return replace(self, exception=None)

    def describe(self) -> str:
        where = f" in step {self.step} (stage {self.stage})" if self.step else ""
        return f"rank {self.rank} raised {self.error}{where}"


class PipelineStepError(RuntimeError):
    """A pipeline step failed; raised on *every* rank of the pipeline with the same message.

    The message names each failing rank, its stage and step, and ends with the
    failing rank's traceback. On the failing rank the original exception is the
    ``__cause__``. ``failures`` holds the :class:`StageFailure` records.
    """

    def __init__(self, message: str, failures: Sequence[StageFailure]) -> None:
        super().__init__(message)
        self.failures = list(failures)

    @classmethod
    def from_failures(cls, failures: Sequence[StageFailure]) -> PipelineStepError:
        ordered = sorted(failures, key=lambda f: f.rank)
        ranks = ", ".join(str(f.rank) for f in ordered)
        lines = [f"pipeline step failed on rank {ranks}: " + "; ".join(f.describe() for f in ordered)]
        lines.append(
            "Every rank of the pipeline raises this error; the step's gradients are incomplete, so "
            "zero them before stepping again."
        )
        for failure in ordered:
            lines.append(f"--- traceback on rank {failure.rank} ---")
            lines.append(failure.traceback.rstrip())
        return cls("\n".join(lines), ordered)

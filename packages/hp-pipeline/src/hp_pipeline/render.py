"""``render_order``: draw a schedule, because people read schedules by looking at them.

Both pictures use the simulator's timing (``simulate.py`` [Note: timing model]):
a text timeline, returned as a string and easy to paste into a review or an
issue, and optionally an SVG, written directly (no plotting dependency), with
one row per rank, one colour per step kind (the one it declares, see
[Note: step-kind registry] in :mod:`hp_pipeline.kinds`) and a line per transfer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from xml.sax.saxutils import escape

from hp_pipeline._checks import check_costs, check_order_mapping
from hp_pipeline._deps import matching
from hp_pipeline.ir import MetaStep, MetaStepType, format_order
from hp_pipeline.simulate import SimulationResult, StepCosts, simulate

__all__ = ["render_order"]

_MAX_TEXT_CELLS = 400

_DEFAULT_COLOUR = "#cccccc"  # a kind that declares no colour ([Note: step-kind registry])
_COMM_COLOUR = "#555555"


def render_order(
    order: Mapping[int, Sequence[MetaStep]],
    path: str | os.PathLike[str] | None = None,
    *,
    costs: StepCosts | None = None,
    title: str | None = None,
) -> str:
    """Return a text timeline of ``order`` and, if ``path`` is given, write an SVG there.

    The text has one row per rank and one column per time unit (the largest
    unit that divides every start and duration); each step's text form sits
    where it starts (an ``OVERLAP_F_B`` as ``0F3+7B1``, spanning both halves),
    ``-`` marks the rest of its duration and ``.`` idle time. Steps that take
    no time (SEND/RECV, free ``LOAD``/FSDP steps) are left out of the timeline.
    When the timeline would be wider than 400 columns, the rank x step grid
    (``format_order``) is returned instead.

    Args:
        order: rank -> steps; it is validated by ``simulate``.
        path: where to write the SVG (the name must end in ``.svg``).
        costs: step costs for the timing; ``StepCosts()`` if omitted.
        title: a heading for the SVG; a summary line is used if omitted.

    Raises:
        ScheduleError: the order is invalid.
        ValueError: ``path`` does not end in ``.svg``.
    """
    check_order_mapping("render_order", order)
    check_costs("render_order", costs)
    if title is not None and not isinstance(title, str):
        raise TypeError(
            f"render_order: title={title!r} is a {type(title).__name__}, not a str; pass a str or None"
        )
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"render_order: path={path!r} is a {type(path).__name__}; pass a file name ending in '.svg' "
            "(a str or a pathlib.Path), or None for the text timeline only"
        )
    if path is not None and Path(path).suffix.lower() != ".svg":
        raise ValueError(
            f"render_order writes SVG; got path {os.fspath(path)!r}, use a name ending in '.svg'"
        )
    result = simulate(order, costs)
    text = _text_timeline(order, result)
    if path is not None:
        costs = StepCosts() if costs is None else costs
        Path(path).write_text(_svg(result, Fraction(costs.comm), title), encoding="utf-8")
    return text


def _colour(kind: MetaStepType) -> str:
    """The fill a kind declares for itself."""
    return kind.spec.colour or _DEFAULT_COLOUR


def _summary(result: SimulationResult) -> str:
    bubble = float(result.total_bubble_ratio)
    return f"makespan {_num(result.makespan)}, bubble {bubble:.1%} of rank time"


def _label(step: MetaStep) -> str:
    """A step's text form; a pair as ``0F3+7B1`` (the full form is too wide for a timeline cell)."""
    if step.sub_steps is not None:
        return "+".join(str(part) for part in step.sub_steps)
    return str(step)


def _num(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.4g}"


def _text_timeline(order: Mapping[int, Sequence[MetaStep]], result: SimulationResult) -> str:
    timed = [t for steps in result.timeline.values() for t in steps if t.end > t.start]
    values = {t.start for t in timed} | {t.end for t in timed}
    unit = _common_unit(values)
    if unit is None or result.makespan / unit > _MAX_TEXT_CELLS:
        note = "(the timeline is too fine to print; the rank x step grid instead)"
        return "\n".join([_summary(result), note, format_order(order)])
    columns = int(result.makespan / unit)
    width = max(len(_label(t.step)) for t in timed) + 1
    label = max(len(f"rank {r}") for r in result.timeline)
    header = [" " * label + " |"]
    for col in range(columns):
        header.append(f" {_num(col * unit):<{width - 1}}" if col % 4 == 0 else " " * width)
    lines = [_summary(result), "".join(header).rstrip()]
    for rank, steps in sorted(result.timeline.items()):
        cells = ["." + " " * (width - 1)] * columns
        for t in steps:
            if t.end <= t.start:
                continue
            first = int(t.start / unit)
            cells[first] = f"{_label(t.step):<{width}}"
            for col in range(first + 1, int(t.end / unit)):
                cells[col] = "-" * (width - 1) + " "
        lines.append(f"{f'rank {rank}':<{label}} | " + "".join(cells).rstrip())
    return "\n".join(lines)


def _common_unit(values: set[Fraction]) -> Fraction | None:
    """The largest ``u`` with every value an integer multiple of ``u`` (None if all are 0)."""
    nonzero = [v for v in values if v]
    if not nonzero:
        return None
    denominator = math.lcm(*(v.denominator for v in nonzero))
    numerator = math.gcd(*(int(v * denominator) for v in nonzero))
    return Fraction(numerator, denominator)


def _svg(result: SimulationResult, comm: Fraction, title: str | None) -> str:
    ranks = sorted(result.timeline)
    makespan = float(result.makespan) or 1.0
    left, top, row, gap, right = 64.0, 40.0, 26.0, 8.0, 150.0
    scale = max(4.0, min(48.0, 1200.0 / makespan))
    width = left + makespan * scale + right
    height = top + len(ranks) * (row + gap) + 44.0
    y_of = {rank: top + k * (row + gap) for k, rank in enumerate(ranks)}
    heading = escape(title if title is not None else _summary(result))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.2f} {height:.2f}" font-family="monospace" font-size="10">',
        '<rect width="100%" height="100%" fill="#ffffff"/>',
        f'<text x="{left:.2f}" y="20" font-size="13">{heading}</text>',
    ]
    send_time: dict[MetaStep, float] = {}
    for rank in ranks:
        y = y_of[rank]
        out.append(f'<text x="6" y="{y + row / 2 + 4:.2f}">rank {rank}</text>')
        out.append(
            f'<rect x="{left:.2f}" y="{y:.2f}" width="{makespan * scale:.2f}" '
            f'height="{row:.2f}" fill="#f3f3f3"/>'
        )
        for t in result.timeline[rank]:
            if t.step.type.is_send:
                send_time[t.step] = float(t.start)
            if t.end <= t.start:
                continue
            x, w = left + float(t.start) * scale, float(t.end - t.start) * scale
            colour = _colour(t.step.type)
            label = escape(_label(t.step))
            out.append(
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{row:.2f}" '
                f'fill="{colour}" stroke="#ffffff" stroke-width="1"><title>{label} '
                f"[{_num(t.start)}, {_num(t.end)})</title></rect>"
            )
            if w >= 6.5 * len(label) + 2:
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + row / 2 + 4:.2f}" text-anchor="middle">{label}</text>'
                )
        bubble = float(result.bubble_ratio[rank])
        out.append(
            f'<text x="{left + makespan * scale + 8:.2f}" y="{y + row / 2 + 4:.2f}">'
            f"bubble {bubble:.1%}</text>"
        )
    rank_of_stage = {
        part.stage_index: rank for rank in ranks for t in result.timeline[rank] for part in t.step.parts
    }
    for rank in ranks:
        for t in result.timeline[rank]:
            if not t.step.type.is_recv:
                continue
            send = matching(t.step)
            if send not in send_time:
                continue
            src = rank_of_stage[send.stage_index]
            x1 = left + send_time[send] * scale
            x2 = left + (send_time[send] + float(comm)) * scale
            y1 = y_of[src] + (row if y_of[src] < y_of[rank] else 0.0)
            y2 = y_of[rank] + (0.0 if y_of[src] < y_of[rank] else row)
            out.append(
                f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" '
                f'stroke="{_COMM_COLOUR}" stroke-width="1" opacity="0.5"/>'
            )
    present = sorted(
        {t.step.type for steps in result.timeline.values() for t in steps if t.end > t.start},
        key=lambda kind: list(MetaStepType).index(kind),
    )
    x, y = left, height - 22.0
    for kind in present:
        out.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="12" height="12" fill="{_colour(kind)}"/>')
        out.append(f'<text x="{x + 16:.2f}" y="{y + 10:.2f}">{kind.code} {kind.name}</text>')
        x += 24 + 7 * (len(kind.code) + len(kind.name))
    out.append("</svg>")
    return "\n".join(out) + "\n"

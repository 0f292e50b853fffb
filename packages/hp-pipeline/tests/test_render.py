"""render_order: the text timeline and the SVG picture."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from fractions import Fraction
from pathlib import Path

import pytest
from hp_pipeline import (
    ScheduleError,
    StepCosts,
    build_1f1b_order,
    build_dualpipev_order,
    build_zbv_order,
    format_order,
    insert_comms,
    render_order,
)

SVG = "{http://www.w3.org/2000/svg}"


def test_text_timeline_is_time_aligned() -> None:
    text = render_order(build_1f1b_order(2, 2), costs=StepCosts(forward=1, backward=1))
    assert text.splitlines() == [
        "makespan 6, bubble 33.3% of rank time",
        "       | 0               4",
        "rank 0 | 0F0 0F1 .   0B0 .   0B1",
        "rank 1 | .   1F0 1B0 1F1 1B1 .",
    ]


def test_long_steps_span_several_cells() -> None:
    text = render_order(build_1f1b_order(2, 1), costs=StepCosts(forward=1, backward=2))
    assert "rank 1 | .   1F0 1B0 ---" in text


def test_too_fine_a_timeline_falls_back_to_the_grid() -> None:
    order = build_1f1b_order(2, 2)
    text = render_order(order, costs=StepCosts(forward=1, backward=Fraction(1, 1000)))
    assert "too fine" in text
    assert format_order(order) in text


def test_svg_has_a_box_per_timed_step_and_a_line_per_transfer(tmp_path: Path) -> None:
    order = insert_comms(build_zbv_order(2, 3), data_stages=[2])
    path = tmp_path / "zbv.svg"
    text = render_order(order, path, title="ZB-V <p=2>")
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    boxes = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    timed = [s for steps in order.values() for s in steps if s.type.is_compute]
    assert len(boxes) == len(timed)
    labels = {str(b.findtext(f"{SVG}title")).split()[0] for b in boxes}
    assert labels == {str(s) for s in timed}
    colours = {b.get("fill") for b in boxes}
    assert len(colours) == 3  # F, I, W
    recvs = [s for steps in order.values() for s in steps if s.type.is_recv]
    assert len(list(root.iter(f"{SVG}line"))) == len(recvs) > 0
    headings = [t.text for t in root.iter(f"{SVG}text")]
    assert "ZB-V <p=2>" in headings  # escaped in the file, intact once parsed
    assert "rank 0 |" in text


def test_pairs_are_drawn_as_one_box_over_both_halves(tmp_path: Path) -> None:
    order = build_dualpipev_order(1, 2)  # 0F0 1F0 0F1 1B0 (1F1;0B0)OVERLAP_F_B 1B1 0I1 0W1
    text = render_order(order, tmp_path / "dualpipev.svg", costs=StepCosts(forward=1, backward=2))
    assert "1F1+0B0 ------- ------- 1B1" in text  # the label, then the rest of F + B = 3 cells
    root = ET.parse(tmp_path / "dualpipev.svg").getroot()
    titles = [
        str(r.findtext(f"{SVG}title")) for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None
    ]
    assert "1F1+0B0 [5, 8)" in titles
    runnable = insert_comms(build_dualpipev_order(2, 4))
    render_order(runnable, tmp_path / "dualpipev-2.svg")  # transfers into and out of pairs get lines
    recvs = [s for steps in runnable.values() for s in steps if s.type.is_recv]
    assert len(list(ET.parse(tmp_path / "dualpipev-2.svg").getroot().iter(f"{SVG}line"))) == len(recvs)


def test_svg_path_must_end_in_svg(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    with pytest.raises(ValueError, match=r"use a name ending in '\.svg'"):
        render_order(build_1f1b_order(2, 2), path)
    assert not path.exists()


def test_invalid_orders_are_not_drawn(tmp_path: Path) -> None:
    order = build_1f1b_order(2, 2)
    order[0].reverse()
    with pytest.raises(ScheduleError):
        render_order(order, tmp_path / "bad.svg")
    assert not (tmp_path / "bad.svg").exists()

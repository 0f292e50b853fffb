"""MPipe over the bases added with torch's schedule names: looped BFS, interleaved zero bubble, DualPipeV.

[Note: MPipe bases] and [Note: MPipe over overlapped pairs] in
``hp_pipeline.mpipe.order``. In one process: the woven order strips to the
base builder's order exactly, validates, simulates, keeps DualPipeV's pairs
whole, and a weave that runs the tower's backward before stage 0's input
gradient (inside a pair) is rejected. Across processes: the same parity
against a single-process copy as ``test_mpipe_distributed.py`` (losses, every
gradient, parameters after each AdamW step), at 2 and 4 ranks, ``m`` equal to
and larger than the stage count, on gloo and emulated NCCL. The default run
covers each of those once per base; ``HP_COMPOSITION=full`` runs the product.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    ScheduleDualPipeV,
    ScheduleError,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleMPipe,
    build_dualpipev_order,
    build_interleaved_zero_bubble_order,
    build_looped_bfs_order,
    build_mpipe_order,
    insert_comms,
    mpipe_order,
    mpipe_owner,
    simulate,
    stage_to_rank,
    strip_mpipe,
    validate_order,
)
from hp_pipeline.ir import Order
from hp_pipeline.mpipe import PLACEMENT_COSTS, mpipe_base_layout, mpipe_receives_lead
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from test_mpipe_distributed import Case, check_mpipe_parity

T = MetaStepType
P = MetaStep.parse

#: base -> (its builder as (p, m, v) -> order, stages per rank)
BASES: dict[str, tuple[Callable[[int, int, int], Order], int]] = {
    "looped-bfs": (build_looped_bfs_order, 2),
    "interleaved-zb": (build_interleaved_zero_bubble_order, 2),
    "dualpipev": (lambda p, m, v: build_dualpipev_order(p, m), 2),
}


def _micros(base: str, p: int) -> list[int]:
    """``m`` values the base accepts: the stage count and larger (DualPipeV needs ``m >= 2p``)."""
    stages = p * BASES[base][1]
    if base == "interleaved-zb":  # equal rounds ([Note: interleaved rounds]): multiples of p
        return [stages, stages + p]
    return [stages, stages + 1, stages + 3]


IR_CASES = [
    (base, p, m, owner, tower, load, mode)
    for base in BASES
    for p in (2, 3, 4)
    for m in _micros(base, p)
    for owner, tower, load, mode in (
        (True, True, False, "full"),
        (True, True, True, "full"),
        (True, True, True, "min"),
        (False, True, True, "full"),
        (True, False, True, "full"),
    )
]


def _input_grad_node(row: list[MetaStep], i: int) -> int:
    """The position of the entry of ``row`` that makes stage 0's input gradient of micro-batch ``i``."""
    return next(
        k
        for k, node in enumerate(row)
        if any(
            s.type in (T.BWD, T.BWD_INPUT) and (s.stage_index, s.micro_index) == (0, i) for s in node.parts
        )
    )


@pytest.mark.parametrize("base, p, m, owner, tower, load, mode", IR_CASES)
def test_mpipe_over_the_new_bases(base, p, m, owner, tower, load, mode) -> None:
    build, v = BASES[base]
    ref = build(p, m, v)
    options = dict(overflow_mode=mode, owner_backward=owner, tower_backward=tower, load_data=load, base=base)
    assert strip_mpipe(build_mpipe_order(p, m, **options)) == ref  # type: ignore[arg-type]
    runnable = mpipe_order(p, m, **options)  # type: ignore[arg-type]
    validate_order(runnable, n_microbatches=m, num_stages=p * v, require_comms=True)
    assert {r: [s for s in row if not s.type.is_comm] for r, row in strip_mpipe(runnable).items()} == ref
    result = simulate(runnable)
    assert result.makespan > 0
    counts = Counter((s.type, s.micro_index) for row in runnable.values() for s in row)
    # DualPipeV's pairs stay whole: the same OVERLAP_F_B entries, none opened by the weave.
    pairs = Counter(s for row in runnable.values() for s in row if s.sub_steps is not None)
    assert pairs == Counter(s for row in ref.values() for s in row if s.sub_steps is not None)
    row0 = runnable[0]
    for i in range(m):
        owner_rank = mpipe_owner(p, m, i, mode)  # type: ignore[arg-type]
        assert counts[T.PREPROCESS_FWD, i] == 1
        assert MetaStep(i, T.PREPROCESS_FWD, owner_rank) in runnable[owner_rank]
        assert counts[T.PREPROCESS_BWD, i] == int(tower)
        remote = owner_rank != 0
        # dL/dfeatures leaves stage 0 only after the entry (a pair on DualPipeV) that makes it.
        if tower and owner and remote:
            assert row0.index(MetaStep(i, T.PREPROCESS_GRAD_SEND, 0, owner_rank)) > _input_grad_node(row0, i)
        elif tower:
            assert row0.index(MetaStep(i, T.PREPROCESS_BWD, 0)) > _input_grad_node(row0, i)
    style = mpipe_base_layout(base, v)[2]
    peer_of = {s: stage_to_rank(s, p, style=style) for s in range(p * v)}
    assert mpipe_receives_lead(row0, peer_of)


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("owner", [True, False])
def test_placement_never_lengthens_the_step_on_the_new_bases(base, p, owner) -> None:
    """[Note: tower placement over pairs]: placed in split form, pairs closed again, never longer."""
    m = _micros(base, p)[-1]
    options = dict(owner_backward=owner, base=base, load_data=True)
    orders = [
        mpipe_order(p, m, **options),  # type: ignore[arg-type]
        mpipe_order(p, m, place_forward=False, **options),  # type: ignore[arg-type]
        mpipe_order(p, m, place_forward=False, place_backward=False, **options),  # type: ignore[arg-type]
    ]
    spans = [simulate(o, PLACEMENT_COSTS).makespan for o in orders]
    assert spans[0] <= spans[1] <= spans[2], spans
    for r in orders[0]:
        assert Counter(orders[0][r]) == Counter(orders[2][r])  # only PF and PB moved


def test_dualpipev_input_gradient_sits_inside_a_pair() -> None:
    """The case the weave had to learn: stage 0's ``B`` is the backward half of an ``OVERLAP_F_B``."""
    p, m = 2, 6
    compute = build_mpipe_order(p, m, base="dualpipev", place_forward=False, place_backward=False)
    row0 = compute[0]
    inside = [
        (k, node.parts[1])
        for k, node in enumerate(row0)
        if node.sub_steps is not None and node.parts[1].stage_index == 0
    ]
    assert inside, "DualPipeV over 2 ranks pairs stage 0's backward with a forward"
    for k, half in inside:
        i = half.micro_index
        if mpipe_owner(p, m, i) == 0:  # rank 0's own tower backward: right after the pair
            assert row0[k + 1] == MetaStep(i, T.PREPROCESS_BWD, 0)
            assert row0[k].micro_index != i  # the pair is named by its forward's micro-batch


def _move_before(row: list[MetaStep], moving: MetaStep, anchor: int) -> list[MetaStep]:
    out = [s for s in row if s != moving]
    out.insert(anchor, moving)
    return out


def test_validate_catches_a_tower_backward_before_the_pair_that_makes_its_gradient() -> None:
    """A weave that must fail: the tower's backward ahead of the pair holding stage 0's ``B``."""
    p, m = 2, 6
    good = mpipe_order(p, m, base="dualpipev", owner_backward=False)
    validate_order(good)
    row0 = list(good[0])
    k, half = next(
        (k, n.parts[1]) for k, n in enumerate(row0) if n.sub_steps is not None and n.parts[1].stage_index == 0
    )
    pb = MetaStep(half.micro_index, T.PREPROCESS_BWD, 0)
    with pytest.raises(ScheduleError, match=rf"{pb}.*(runs before|needs)"):
        validate_order({**good, 0: _move_before(row0, pb, k)})
    # With the owner backward: dL/dfeatures sent back before the pair that computes it.
    good = mpipe_order(p, m, base="dualpipev")
    row0 = list(good[0])
    sends = {s.micro_index: s for s in row0 if s.type is T.PREPROCESS_GRAD_SEND}
    k, half = next(
        (k, n.parts[1])
        for k, n in enumerate(row0)
        if n.sub_steps is not None and n.parts[1].stage_index == 0 and n.parts[1].micro_index in sends
    )
    send = sends[half.micro_index]
    with pytest.raises(ScheduleError, match=rf"{send}"):
        validate_order({**good, 0: _move_before(row0, send, k)})
    # And a planted order that is simply built that way: insert_comms cannot save it either.
    compute = build_mpipe_order(p, m, base="dualpipev", owner_backward=False)
    row0 = list(compute[0])
    k = _input_grad_node(row0, half.micro_index)
    bad = {**compute, 0: _move_before(row0, MetaStep(half.micro_index, T.PREPROCESS_BWD, 0), k)}
    with pytest.raises(ScheduleError, match=r"runs before|needs"):
        validate_order(insert_comms(bad))


def test_the_gate_keeps_pairs_startable() -> None:
    """[Note: tower placement over pairs]: a forward half waits for its backward half's inputs.

    Two ranks, one stage each; rank 0 runs the pair ``(0F1; 0B0)``, whose
    backward half needs ``1B0`` from rank 1, which rank 1 runs only after
    ``1F1``, downstream of the pair's own forward. The split form runs it;
    started at once, the halves wait for each other. The placement's timer
    must call it stuck, as ``validate_order`` does.
    """
    from hp_pipeline.mpipe.placement import _Timer

    pair = MetaStep.overlap(P("0F1"), P("0B0"))
    rows = [[P("0F0"), *pair.parts, P("0B1")], [P("1F0"), P("1F1"), P("1B0"), P("1B1")]]
    split = _Timer(rows, PLACEMENT_COSTS)
    gated = _Timer(rows, PLACEMENT_COSTS, {pair.parts[0]: pair.parts[1]})
    numbered = [[split.number[s] for s in row] for row in rows]
    assert split.makespan(numbered) is not None
    assert gated.makespan(numbered) is None
    with pytest.raises(ScheduleError):
        validate_order(insert_comms({0: [P("0F0"), pair, P("0B1")], 1: rows[1]}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(base="looped-bfs", stages_per_rank=1), r"over base 'looped-bfs' runs >= 2 stage\(s\) per rank"),
        (dict(base="dualpipev", stages_per_rank=3), r"over base 'dualpipev' runs 2 stage\(s\) per rank.*"),
        (dict(base="dualpipev", n_microbatches=3), r"n_microbatches=3 is fewer than the 4 stages"),
        (dict(base="DualPipeV"), r"cannot build on base 'DualPipeV'.*'dualpipev'"),
    ],
)
def test_new_bases_reject_what_they_cannot_run(kwargs, match) -> None:
    kwargs = {"n_microbatches": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_mpipe_order(2, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cls, name",
    [
        (ScheduleLoopedBFS, "looped-bfs"),
        (ScheduleInterleavedZeroBubble, "interleaved-zb"),
        (ScheduleDualPipeV, "dualpipev"),
    ],
)
def test_schedule_mpipe_takes_the_new_classes_as_bases(cls, name) -> None:
    from hp_pipeline.mpipe.schedule import _base_name

    assert _base_name(cls) == name
    assert _base_name(name) == name
    if name == "interleaved-zb":  # runs any number of stages per rank, one included
        return
    # A one-stage rank cannot run a base of two or more; checked before any group is looked at.
    with pytest.raises(ValueError, match=rf"over base '{name}' runs"):
        ScheduleMPipe([], 4, preprocess=nn.Linear(1, 1), loss_fn=None, base=cls)


# -- multi-process parity ----------------------------------------------------------------------


def _parity_cases() -> list[tuple[str, int, int, str, dict[str, Any]]]:
    """(base, p, m, backend, case options): each base at 2 and 4 ranks, m = and > stages, both backends."""
    full = os.environ.get("HP_COMPOSITION") == "full"
    cases = []
    for base in BASES:
        if full:
            for p, backend in itertools.product((2, 4), ("gloo", "nccl-emu")):
                for m in _micros(base, p)[:2]:
                    cases.append((base, p, m, backend, {}))
            continue
        small, large = _micros(base, 2), _micros(base, 4)
        cases.append((base, 2, small[0], "gloo", {"loading": True}))
        cases.append((base, 4, large[1], "nccl-emu", {"owner_backward": False, "mode": "min"}))
    return cases


def _param(base: str, p: int, m: int, backend: str, extra: dict[str, Any]) -> Any:
    label = "-".join(f"{k}={v}" for k, v in extra.items())
    return pytest.param(
        base,
        p,
        m,
        extra,
        marks=pytest.mark.distributed(world_size=p, backend=backend, timeout=150),
        id=f"{base}-p{p}-m{m}-{backend}" + (f"-{label}" if label else ""),
    )


@pytest.mark.parametrize("base, p, m, extra", [_param(*c) for c in _parity_cases()])
def test_mpipe_on_the_new_bases_matches_single_process(rank, world_size, base, p, m, extra, monkeypatch):
    check_mpipe_parity(rank, Case(p, m, v=2, base=base, **extra), monkeypatch)

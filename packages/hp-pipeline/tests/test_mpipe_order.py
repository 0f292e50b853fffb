"""MPipe in one process: ownership, the order, validation of planted bugs, the sampler."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import pytest
from hp_pipeline import (
    MetaStep,
    MetaStepType,
    PPRankOwnedSampler,
    ScheduleError,
    StepCosts,
    build_1f1b_order,
    build_interleaved_1f1b_order,
    build_mpipe_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    insert_comms,
    mpipe_order,
    mpipe_owned_micros,
    mpipe_owner,
    simulate,
    stage_to_rank,
    strip_mpipe,
    validate_order,
)
from hp_pipeline.mpipe import PLACEMENT_COSTS, is_mpipe_kind, mpipe_receives_lead
from torch.utils.data import RandomSampler, SequentialSampler

T = MetaStepType
P = MetaStep.parse

# The order sweeps' micro-batch counts: fewer, more, equal to and multiples of the
# stage count by default; every m up to 12 with HP_COMPOSITION=full.
SWEEP_M = range(1, 13) if os.environ.get("HP_COMPOSITION") == "full" else (1, 2, 3, 4, 5, 7, 8, 12)

# -- ownership ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "min"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", range(1, 13))
def test_every_micro_has_one_owner(p: int, m: int, mode: str) -> None:
    owned = [mpipe_owned_micros(p, m, r, mode) for r in range(p)]  # type: ignore[arg-type]
    flat = sorted(k for ks in owned for k in ks)
    assert flat == list(range(m))
    nt = min(p, m)
    assert all(owned[r] == [] for r in range(nt, p))
    for r in range(p):
        assert owned[r] == sorted(owned[r])
        assert all(mpipe_owner(p, m, k, mode) == r for k in owned[r])  # type: ignore[arg-type]
    if mode == "full":
        assert all(mpipe_owner(p, m, k) == k % nt for k in range(m))
    else:
        assert [len(owned[r]) for r in range(1, nt)] == [m // nt] * (nt - 1)
        assert len(owned[0]) == m // nt + m % nt


def test_ownership_examples() -> None:
    assert mpipe_owned_micros(4, 10, 0, "full") == [0, 4, 8]
    assert mpipe_owned_micros(4, 10, 3, "full") == [3, 7]
    assert mpipe_owned_micros(4, 10, 0, "min") == [0, 4, 8, 9]
    assert mpipe_owned_micros(4, 10, 1, "min") == [1, 5]
    assert mpipe_owned_micros(4, 2, 3) == []


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mpipe_owned_micros(0, 2, 0), "pp_size must be an int >= 1, got 0"),
        (lambda: mpipe_owned_micros(2, 2, 2), r"pp_rank must be in 0 \.\. 1, got 2"),
        (lambda: mpipe_owned_micros(2, 2, 0, "most"), "mode must be 'full' or 'min', got 'most'"),  # type: ignore[arg-type]
        (lambda: mpipe_owner(2, 3, 3), r"micro must be in 0 \.\. 2, got 3"),
    ],
)
def test_ownership_rejects_bad_input(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# -- the order -----------------------------------------------------------------------------

ORDER_CASES = [
    (p, m, v, mode, owner, tower, load)
    for p in (2, 3, 4)
    for m in SWEEP_M
    for v in (1, 2)
    for mode in ("full", "min")
    for owner in (True, False)
    for tower, load in ((True, False), (True, True), (False, True))
    if v == 1 or m <= p or m % max(1, m // p) == 0  # the interleaved builder's rule
]


@pytest.mark.parametrize("p, m, v, mode, owner, tower, load", ORDER_CASES)
def test_mpipe_orders_are_valid_and_strip_to_the_base(p, m, v, mode, owner, tower, load) -> None:
    base = build_1f1b_order(p, m) if v == 1 else build_interleaved_1f1b_order(p, m, v)
    options = dict(
        stages_per_rank=v, overflow_mode=mode, owner_backward=owner, tower_backward=tower, load_data=load
    )
    compute = build_mpipe_order(p, m, **options)  # type: ignore[arg-type]
    assert strip_mpipe(compute) == base
    runnable = mpipe_order(p, m, **options)  # type: ignore[arg-type]
    validate_order(runnable, n_microbatches=m, num_stages=p * v, require_comms=True)
    assert {r: [s for s in steps if not s.type.is_comm] for r, steps in strip_mpipe(runnable).items()} == base
    steps = [s for row in runnable.values() for s in row]
    counts = Counter((s.type, s.micro_index) for s in steps)
    for i in range(m):
        owner_rank = mpipe_owner(p, m, i, mode)  # type: ignore[arg-type]
        assert counts[T.PREPROCESS_FWD, i] == 1
        assert MetaStep(i, T.PREPROCESS_FWD, owner_rank) in runnable[owner_rank]
        assert counts[T.PREPROCESS_BWD, i] == (1 if tower else 0)
        assert counts[T.DATA_LOAD, i] == (1 if load else 0)
        if load:
            assert MetaStep(i, T.DATA_LOAD, owner_rank) in runnable[owner_rank]
        remote = owner_rank != 0
        assert counts[T.PREPROCESS_SEND, i] == counts[T.PREPROCESS_RECV, i] == int(remote)
        grads_back = int(remote and tower and owner)
        assert counts[T.PREPROCESS_GRAD_SEND, i] == counts[T.PREPROCESS_GRAD_RECV, i] == grads_back
        if tower and not owner:
            assert MetaStep(i, T.PREPROCESS_BWD, 0) in runnable[0]
    reduces = [s for s in steps if s.type is T.PREPROCESS_REDUCE]
    assert len(reduces) == (p if tower else 0)
    if tower:
        assert all(row[-1].type is T.PREPROCESS_REDUCE for row in runnable.values())
    # The features of micro-batch i reach stage 0 before its forward there.
    row0 = runnable[0]
    for i in range(m):
        recv = [k for k, s in enumerate(row0) if s.type is T.PREPROCESS_RECV and s.micro_index == i]
        if recv:
            assert recv[0] < row0.index(MetaStep(i, T.FWD, 0))
    peer_of = {s: stage_to_rank(s, p) for s in range(p * v)}
    assert mpipe_receives_lead(row0, peer_of)


ZB_CASES = [
    (base, p, m, mode, owner, tower, load)
    for base in ("zb-h1", "zbv")
    for p in (2, 3, 4)
    for m in SWEEP_M
    for mode in ("full", "min")
    for owner in (True, False)
    for tower, load in ((True, False), (True, True), (False, True))
]


@pytest.mark.parametrize("base, p, m, mode, owner, tower, load", ZB_CASES)
def test_mpipe_over_zero_bubble_bases(base, p, m, mode, owner, tower, load) -> None:
    """[Note: MPipe bases]: ZB-H1 and ZB-V orders with the MPipe steps woven in."""
    ref = build_zero_bubble_h1_order(p, m) if base == "zb-h1" else build_zbv_order(p, m)
    v, style = (1, "loop") if base == "zb-h1" else (2, "v")
    options = dict(overflow_mode=mode, owner_backward=owner, tower_backward=tower, load_data=load, base=base)
    assert strip_mpipe(build_mpipe_order(p, m, **options)) == ref  # type: ignore[arg-type]
    runnable = mpipe_order(p, m, **options)  # type: ignore[arg-type]
    validate_order(runnable, n_microbatches=m, num_stages=p * v, require_comms=True)
    assert {r: [s for s in row if not s.type.is_comm] for r, row in strip_mpipe(runnable).items()} == ref
    counts = Counter((s.type, s.micro_index) for row in runnable.values() for s in row)
    row0 = runnable[0]
    compute0 = [s for s in row0 if not s.type.is_comm]
    for i in range(m):
        owner_rank = mpipe_owner(p, m, i, mode)  # type: ignore[arg-type]
        # Owned once, by its owner, whose home stage is its rank in both placements.
        assert counts[T.PREPROCESS_FWD, i] == 1
        assert MetaStep(i, T.PREPROCESS_FWD, owner_rank) in runnable[owner_rank]
        assert counts[T.PREPROCESS_BWD, i] == int(tower)
        assert counts[T.DATA_LOAD, i] == int(load)
        remote = owner_rank != 0
        assert counts[T.PREPROCESS_SEND, i] == counts[T.PREPROCESS_RECV, i] == int(remote)
        assert counts[T.PREPROCESS_GRAD_SEND, i] == int(remote and tower and owner)
        if load:
            # Stage 0 and the last stage each get their own keys from the owner unless they are on
            # its rank; in the V placement both are on rank 0, so a remote owner sends twice there.
            need = sum(stage_to_rank(s, p, style=style) != owner_rank for s in (0, p * v - 1))  # type: ignore[arg-type]
            assert counts[T.DATA_SEND, i] == counts[T.DATA_RECV, i] == need
        # dL/dfeatures leaves stage 0 after its input-gradient step I, never its W.
        grad_from = MetaStep(i, T.BWD_INPUT, 0)
        if tower and (not owner or not remote):
            # After I; the placement may move it later ([Note: tower backward placement]).
            assert compute0.index(MetaStep(i, T.PREPROCESS_BWD, 0)) > compute0.index(grad_from)
            unplaced = [s for s in build_mpipe_order(p, m, place_backward=False, **options)[0]]  # type: ignore[arg-type]
            assert unplaced.index(MetaStep(i, T.PREPROCESS_BWD, 0)) == unplaced.index(grad_from) + 1
        if tower and owner and remote:
            send = MetaStep(i, T.PREPROCESS_GRAD_SEND, 0, owner_rank)
            assert row0.index(grad_from) < row0.index(send)
    peer_of = {s: stage_to_rank(s, p, style=style) for s in range(p * v)}  # type: ignore[arg-type]
    assert mpipe_receives_lead(row0, peer_of)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(base="gpipe"),
            r"cannot build on base 'gpipe'.*\['1f1b', 'interleaved', 'looped-bfs', 'zb-h1', "
            r"'interleaved-zb', 'zbv', 'dualpipev'\]",
        ),
        (
            dict(base="zb-h1", stages_per_rank=2),
            r"over base 'zb-h1' runs 1 stage\(s\) per rank, got stages_per_rank=2",
        ),
        (
            dict(base="zbv", stages_per_rank=3),
            r"over base 'zbv' runs 2 stage\(s\) per rank, got stages_per_rank=3",
        ),
        (dict(stages_per_rank=0), r"stages_per_rank must be an int >= 1, got 0"),
    ],
)
def test_mpipe_rejects_bases_it_cannot_serve(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_mpipe_order(2, 4, **kwargs)


def test_schedule_mpipe_rejects_other_schedule_classes() -> None:
    from hp_pipeline import ScheduleGPipe, ScheduleMPipe
    from torch import nn

    # The base is checked before the stages or the process group are looked at.
    with pytest.raises(
        ValueError, match=r"cannot build on ScheduleGPipe \(GPipe has 1F1B's bubble.*Schedule1F1B"
    ):
        ScheduleMPipe([], 4, preprocess=nn.Linear(1, 1), loss_fn=None, base=ScheduleGPipe)
    with pytest.raises(ValueError, match=r"cannot build on ScheduleMPipe; base= takes one of"):
        ScheduleMPipe([], 4, preprocess=nn.Linear(1, 1), loss_fn=None, base=ScheduleMPipe)


def test_text_forms_of_the_mpipe_steps_round_trip() -> None:
    order = mpipe_order(3, 5, load_data=True)
    texts = {str(s) for row in order.values() for s in row}
    for text in ("1PF1", "1SEND_P1->0", "0RECV_P1<-1", "0SEND_PG1->1", "1RECV_PG1<-0", "1PB1", "2REDUCE_P"):
        assert text in texts
        assert str(P(text)) == text
    for step in (s for row in order.values() for s in row):
        assert P(str(step)) == step
    with pytest.raises(ValueError, match="must name its peer_stage"):
        MetaStep(1, T.PREPROCESS_SEND, 1)
    with pytest.raises(ValueError, match="needs a micro_index"):
        MetaStep(None, T.PREPROCESS_FWD, 0)


def _fails(order, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        validate_order(order)


def test_validate_catches_planted_mpipe_bugs() -> None:
    good = mpipe_order(2, 4)
    validate_order(good)

    def without(text: str) -> dict[int, list[MetaStep]]:
        return {r: [s for s in row if str(s) != text] for r, row in good.items()}

    # A micro-batch without a tower forward (and its transfer removed too).
    no_pf = {
        r: [
            s
            for s in row
            if s.micro_index != 1 or s.type not in (T.PREPROCESS_FWD, T.PREPROCESS_SEND, T.PREPROCESS_RECV)
        ]
        for r, row in good.items()
    }
    _fails(no_pf, r"PF steps cover micro-batches .*missing \[1\]")
    # The features never reach stage 0.
    _fails(without("0RECV_P1<-1"), "no matching 0RECV_P1<-1|needs 1PF1")
    # Tower backward before the gradient arrives.
    row1 = list(good[1])
    pb, recv = row1.index(P("1PB1")), row1.index(P("1RECV_PG1<-0"))
    row1[pb], row1[recv] = row1[recv], row1[pb]
    _fails({0: good[0], 1: row1}, "1PB1 .* arrives after|runs before")
    # A rank skips the collective: the others wait in it forever.
    _fails(without("1REDUCE_P"), "REDUCE_P is a collective over every rank")
    # REDUCE_P before the rank's last tower backward.
    row1 = [s for s in good[1] if s != P("1REDUCE_P")]
    row1.insert(0, P("1REDUCE_P"))
    _fails({0: good[0], 1: row1}, "runs before")
    # Two owners load the same micro-batch.
    compute = build_mpipe_order(2, 2, load_data=True)
    compute[1].insert(0, MetaStep(0, T.DATA_LOAD, 1))
    _fails(compute, r"loaded more than once \(0 on stages \[0, 1\]\)")


def test_simulate_spreads_the_tower_over_the_ranks() -> None:
    costs = StepCosts(forward=1, backward=2, preprocess_forward=1, preprocess_backward=2)
    p, m = 4, 8
    mpipe = simulate(mpipe_order(p, m), costs)
    # The tower on stage 0 alone: PF before every F(0, i), PB right after every B(0, i).
    on_stage0 = build_mpipe_order(p, m, overflow_mode="full")
    stacked = {r: [s for s in row if not is_mpipe_kind(s.type)] for r, row in on_stage0.items()}
    row0 = []
    for s in stacked[0]:
        if s.type is T.FWD:
            row0.append(MetaStep(s.micro_index, T.PREPROCESS_FWD, 0))
        row0.append(s)
        if s.type is T.BWD:
            row0.append(MetaStep(s.micro_index, T.PREPROCESS_BWD, 0))
    stacked[0] = row0
    for r in stacked:
        stacked[r].append(MetaStep(None, T.PREPROCESS_REDUCE, r))
    plain = simulate(insert_comms(stacked), costs)
    assert mpipe.makespan < plain.makespan
    assert all(t.end <= mpipe.makespan for row in mpipe.timeline.values() for t in row)
    # Tower compute counts as compute: every rank carries 2 of the 8 micro-batches' tower work.
    assert all(mpipe.compute_time[r] == m * 3 + 2 * 3 for r in range(p))


# -- tower backward placement ---------------------------------------------------------------

# The simulator's unit costs (the tower costs one text stage, free transfers), for readable figures.
UNIT = StepCosts(forward=1, backward=2, preprocess_forward=1, preprocess_backward=2)


@pytest.mark.parametrize(
    "base, p, m",
    [
        (base, p, m)
        for base in ("1f1b", "interleaved", "zb-h1", "zbv")
        for p, m in ((2, 3), (2, 8), (3, 7), (4, 4), (4, 9), (4, 16))
        if base != "interleaved" or m % p == 0  # interleaved 1F1B needs m a multiple of p
    ],
)
@pytest.mark.parametrize("owner", [True, False])
@pytest.mark.parametrize("mode", ["full", "min"])
@pytest.mark.parametrize("load", [False, True])
def test_placement_never_lengthens_the_step(base, p, m, owner, mode, load) -> None:
    """[Note: tower backward placement], [Note: tower forward placement]: each PB and PF goes to
    the best slot found, so the step simulated with the placement's costs never grows, and the
    forward pass, which runs second, never undoes what the backward pass gained."""
    options = dict(overflow_mode=mode, owner_backward=owner, base=base, load_data=load)
    placed = mpipe_order(p, m, **options)  # type: ignore[arg-type]
    backward_only = mpipe_order(p, m, place_forward=False, **options)  # type: ignore[arg-type]
    first = mpipe_order(p, m, place_forward=False, place_backward=False, **options)  # type: ignore[arg-type]
    spans = [simulate(o, PLACEMENT_COSTS).makespan for o in (placed, backward_only, first)]
    assert spans[0] <= spans[1] <= spans[2], spans
    # Only PF and PB moved: the same steps per rank, everything else in the base's order.
    tower = (T.PREPROCESS_BWD, T.PREPROCESS_FWD)
    for r in placed:
        assert Counter(placed[r]) == Counter(first[r])
        compute = [s for s in placed[r] if not s.type.is_comm]
        assert [s for s in compute if s.type not in tower] == [
            s for s in first[r] if not s.type.is_comm and s.type not in tower
        ]
        where = {s: k for k, s in enumerate(compute)}
        for s in compute:
            i = s.micro_index
            if s.type is T.PREPROCESS_BWD:  # after its home stage's input gradient
                grad = [
                    x
                    for x in compute
                    if x.type in (T.BWD, T.BWD_INPUT) and (x.micro_index, x.stage_index) == (i, s.stage_index)
                ]
                assert grad and where[grad[0]] < where[s]
            if s.type is T.PREPROCESS_FWD:  # after its load, before what reads it on this rank
                if load:
                    assert where[MetaStep(i, T.DATA_LOAD, s.stage_index)] < where[s]
                readers = [
                    x
                    for x in compute
                    if x.micro_index == i
                    and (x.type is T.PREPROCESS_BWD or (x.type is T.FWD and x.stage_index == 0))
                ]
                assert all(where[s] < where[x] for x in readers)
    # Stage 0's rank still receives the features before anything else from each peer.
    peer_of = {
        st: stage_to_rank(st, p, style="v" if base == "zbv" else "loop")
        for st in range(p * (2 if base in ("zbv", "interleaved") else 1))
    }
    assert mpipe_receives_lead(placed[0], peer_of)


@pytest.mark.parametrize(
    "base, p, m, unplaced, backward, both",
    [
        ("1f1b", 2, 8, 43, 38, 37),
        ("1f1b", 4, 16, 73, 67, 64),
        ("1f1b", 4, 32, 141, 127, 124),
        ("interleaved", 4, 16, 116, 113, 111),
        ("zb-h1", 4, 16, 69, 64, 61),
        ("zb-h1", 8, 64, 237, 224, 217),
        ("zbv", 2, 8, 66, 61, 60),
        ("looped-bfs", 4, 16, 121, 117, 117),
        ("interleaved-zb", 4, 16, 117, 112, 110),
        ("dualpipev", 4, 16, 114, 111, 110),
    ],
)
def test_placement_fills_the_owners_idle_slots(base, p, m, unplaced, backward, both) -> None:
    """PBs in the owners' steady state instead of a tail, PFs out of the step's start: these figures.

    The figures are the simulator's makespans with unit costs (F = PF = 1,
    B = PB = 2, free transfers) of the same order with the tower's steps
    where they first go (every PF at the start of its owner's list, every PB
    at the end), with the PBs placed, and with the PFs placed too; they are
    checked exactly, so a weaker placement fails here.
    """
    orders = [
        mpipe_order(p, m, base=base, place_forward=False, place_backward=False),
        mpipe_order(p, m, base=base, place_forward=False),
        mpipe_order(p, m, base=base),
    ]
    assert [simulate(o, UNIT).makespan for o in orders] == [unplaced, backward, both]
    if base == "looped-bfs":
        return  # each rank's backwards are one block at the end: no steady state to fill
    row = [s for s in orders[2][1] if not s.type.is_comm]
    last_pipeline_backward = max(k for k, s in enumerate(row) if s.type in (T.BWD, T.BWD_INPUT, T.BWD_WEIGHT))
    tail = row[last_pipeline_backward:]
    owned = [s for s in row if s.type is T.PREPROCESS_BWD]
    assert len([s for s in tail if s.type is T.PREPROCESS_BWD]) < len(owned)  # some in the steady state
    row0 = [s for s in orders[2][0] if not s.type.is_comm]
    first_forward = row0.index(MetaStep(0, T.FWD, 0))
    assert any(s.type is T.PREPROCESS_FWD for s in row0[first_forward:])  # some after the first forward


# -- the sampler -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, m, mbs, mode", [(2, 4, 2, "full"), (4, 6, 1, "full"), (3, 5, 3, "min"), (4, 4, 2, "min")]
)
def test_owned_sampling_reads_every_sample_once(p: int, m: int, mbs: int, mode: str) -> None:
    n = 3 * m * mbs + 2  # three steps and a partial one, which is dropped
    seen: list[int] = []
    for r in range(p):
        owned = mpipe_owned_micros(p, m, r, mode)  # type: ignore[arg-type]
        if not owned:
            continue
        sampler = PPRankOwnedSampler(SequentialSampler(range(n)), owned, mbs, m)
        got = list(sampler)
        assert len(got) == len(sampler) == 3 * len(owned) * mbs
        seen += got
        # Step t, micro k of the base order is indices [t*m*mbs + k*mbs, ... + mbs).
        first = [t * m * mbs + k * mbs + j for t in range(3) for k in owned for j in range(mbs)]
        assert got == first
    assert sorted(seen) == list(range(3 * m * mbs))


def test_sampler_resumes_exactly_and_fails_early() -> None:
    import torch

    base = RandomSampler(range(40), generator=torch.Generator().manual_seed(3))

    def fresh() -> PPRankOwnedSampler:
        base.generator.manual_seed(3)  # type: ignore[union-attr]
        return PPRankOwnedSampler(base, [1, 3], 2, 4)

    full = list(fresh())
    sampler = fresh()
    it = iter(sampler)
    head = list(itertools.islice(it, 5))
    state = sampler.state_dict()
    assert state == {"epoch": 0, "yielded": 5}
    resumed = fresh()
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    assert resumed.state_dict()["yielded"] == 0  # the epoch finished
    with pytest.raises(
        ValueError,
        match=r"has 10 samples, which feed 1 step\(s\) per epoch of .* 4 \* 2 = 8 samples, but 3 step",
    ):
        PPRankOwnedSampler(SequentialSampler(range(10)), [0], 2, 4, num_steps=3)
    with pytest.raises(ValueError, match="owns no micro-batch"):
        PPRankOwnedSampler(SequentialSampler(range(10)), [], 2, 4)
    with pytest.raises(ValueError, match=r"outside 0 \.\. 3"):
        PPRankOwnedSampler(SequentialSampler(range(10)), [4], 2, 4)

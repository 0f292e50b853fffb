"""Where each owner runs the tower's steps: the slot that shortens the step most.

Details in the [Note]s below: tower backward placement, tower forward
placement, placement costs, tower placement over pairs.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from itertools import pairwise
from math import lcm

from hp_pipeline._deps import OrderView
from hp_pipeline.ir import MetaStep, MetaStepType, Order
from hp_pipeline.simulate import StepCosts

__all__ = ["PLACEMENT_COSTS", "place_tower_backward", "place_tower_forward"]

# [Note: placement costs]
# The simulation is the timing model of :func:`hp_pipeline.simulate` on the
# compute-only order (``[Note: timing model]``), with the dependencies computed
# once and integer costs, so one evaluation is a single pass over the steps.
# :data:`PLACEMENT_COSTS` assumes the tower costs what one text stage costs
# (``PF = F``, ``PB = B``), the case MPipe is for, and a transfer a tenth of a
# forward. With free transfers most ``PF`` slots tie and the search keeps the
# start of the list; a small latency tells it that a feature made just in time
# arrives late, and on device-measured costs (one CPU core per rank, tower
# about one stage, a load about 0.7 ``F``, a transfer about 0.1 ``F``) the
# step it then finds is 2-4% shorter for 1F1B at ``p=4`` (``m=32`` and
# ``m=16``). Other costs can be passed.


T = MetaStepType
_INPUT_GRAD = ("B", "I")  # codes: the kinds need not be registered at import


# [Note: tower placement over pairs]
# On a base with ``OVERLAP_F_B`` pairs (DualPipeV, [Note: MPipe over
# overlapped pairs] in :mod:`hp_pipeline.mpipe.order`) the placement works on
# the rows in their split form, each pair as its forward half then its backward
# half, which is how the executor runs a pair and how ``simulate`` times it;
# no ``PF`` or ``PB`` may go between the halves, and the pairs are closed again
# afterwards. One more rule keeps the result valid: ``validate_order`` holds a
# pair to the strict meaning that both halves may start at once, so everything
# the backward half receives must not need the forward half's output
# ([Note: running overlapped steps] in :mod:`hp_pipeline.overlap`). A ``PB``
# can break that without any stall in the split form: put on rank ``r-1``
# before the step that feeds a pair's backward on rank ``r``, it waits for
# stage 0's input gradient, which may come after the pair's forward made its
# way round the V. So the simulation *gates* each forward half on the
# backward half's inputs from other ranks: the forward may not run before they
# have run (a slot that makes them wait for the pair stalls and is skipped),
# while its start time is still its own inputs' (the gate changes what may
# run, never when something runs, so the makespan stays the split form's).


class _Timer:
    """Makespan of a compute-only order under the simulator's timing model, in integers.

    Steps are numbered once; rows are lists of those numbers, so trying a slot
    is a list insert and one pass without hashing a step.
    """

    def __init__(
        self, rows: list[list[MetaStep]], costs: StepCosts, halves: dict[MetaStep, MetaStep] | None = None
    ) -> None:
        """``rows`` in split form; ``halves`` maps each pair's forward half to its backward half."""
        view = OrderView(dict(enumerate(rows)))
        steps = [s for row in rows for s in row]
        self.number = {s: n for n, s in enumerate(steps)}
        raw = [costs.of(s.type) for s in steps]
        comm = Fraction(costs.comm)
        scale = lcm(*(Fraction(c).denominator for c in [*raw, comm]))
        self.cost = [int(c * scale) for c in raw]
        self.comm = int(comm * scale)
        self.inputs = [
            tuple(
                self.number[e.producer]
                for e in view.edges_into(s)
                if not view.same_rank(e.producer.stage_index, s.stage_index)
            )
            for s in steps
        ]
        # [Note: tower placement over pairs]: a forward half runs only once its backward half's
        # cross-rank inputs have.
        self.gate: list[tuple[int, ...]] = [()] * len(steps)
        for forward, backward in (halves or {}).items():
            self.gate[self.number[forward]] = self.inputs[self.number[backward]]

    def makespan(self, rows: list[list[int]], beat: int | None = None) -> int | None:
        """The makespan, or ``None`` when some rank would wait forever or it cannot be below ``beat``.

        ``beat`` prunes: a rank whose clock plus its remaining work reaches it
        ends the pass early, since the result could not be chosen anyway.
        """
        return self._run(rows, beat, None)

    def idle_before(self, rows: list[list[int]], at_least: int) -> list[bool]:
        """Per step number: whether its rank waits ``at_least`` or longer right before the step."""
        starts = [-1] * len(self.cost)
        self._run(rows, None, starts)
        idle = [False] * len(self.cost)
        for row in rows:
            for a, b in pairwise(row):
                idle[b] = starts[b] - starts[a] - self.cost[a] >= max(at_least, 1)
        return idle

    def _run(self, rows: list[list[int]], beat: int | None, starts: list[int] | None) -> int | None:
        cost, inputs, comm, gate = self.cost, self.inputs, self.comm, self.gate
        end = [-1] * len(cost)
        head = [0] * len(rows)
        clock = [0] * len(rows)
        left_work = [sum(cost[n] for n in row) for row in rows]
        left = sum(len(r) for r in rows)
        progress = True
        while progress:
            progress = False
            for k, row in enumerate(rows):
                h, now, work = head[k], clock[k], left_work[k]
                while h < len(row):
                    n = row[h]
                    if gate[n] and any(end[x] < 0 for x in gate[n]):
                        break
                    ready = now
                    for producer in inputs[n]:
                        done = end[producer]
                        if done < 0:
                            break
                        if done + comm > ready:
                            ready = done + comm
                    else:
                        if starts is not None:
                            starts[n] = ready
                        now = end[n] = ready + cost[n]
                        work -= cost[n]
                        h += 1
                        continue
                    break
                if h != head[k]:
                    if beat is not None and now + work >= beat:
                        return None
                    left -= h - head[k]
                    head[k], clock[k], left_work[k] = h, now, work
                    progress = True
        return max(clock) if left == 0 else None


#: The costs the placement simulates: the tower costs one text stage (``PF = F``, ``PB = B``) and a
#: transfer a tenth of a forward ([Note: placement costs]).
PLACEMENT_COSTS = StepCosts(
    forward=1, backward=2, preprocess_forward=1, preprocess_backward=2, comm=Fraction(1, 10)
)


# [Note: tower forward placement]
# Each owner's ``PF`` first goes to the start of its list (with its ``LOAD``
# before it), which is always valid: the owners compute the features while
# stage 0's forwards have not started. But stage 0's rank owns micro-batches
# too, and doing all its ``PF`` before its first ``F`` delays the whole
# pipeline by ``m/p`` tower forwards, while later in the warm-up it waits
# idle for the first gradient to come back. :func:`place_tower_forward` moves
# each ``PF`` (after the backward pass, so it cannot undo what that gained) the
# same greedy way as the ``PB``: to the slot with the least simulated makespan
# among the waits it fits in and the latest slot it may take, ties to the
# earlier slot. A ``PF`` stays after its ``LOAD``, which does not move (the
# loader yields the micro-batches in the owner's order), and before what
# reads the tower's output on its rank: stage 0's forward of the micro-batch
# and the owner's ``PB``. On a rank other than stage 0's it also stays before
# the first pipeline step whose output goes to stage 0's rank, so stage 0's
# rank still receives every feature before anything else from that peer and
# can post those receives together ([Note: MPipe receive posting] in
# :mod:`hp_pipeline.mpipe.order`). Only ``PF`` and ``PB`` move: stripping the
# MPipe steps still gives the base order.


def place_tower_forward(order: Order, costs: StepCosts | None = None) -> Order:
    """``order`` with each owner's ``PF`` moved to its best slot ([Note: tower forward placement]).

    ``order`` is a compute-only MPipe order (no SEND/RECV) whose ``PF`` steps
    may sit anywhere before their consumers; ``LOAD`` steps stay where they are.
    ``costs`` defaults to :data:`PLACEMENT_COSTS`.
    """
    return _placed(order, costs, T.PREPROCESS_FWD)


# [Note: tower backward placement]
# With the owner backward, rank ``r`` can run ``PB`` of its micro-batch ``i``
# only once stage 0 has made dL/dfeatures (``0Bi`` or ``0Ii``) and sent it back.
# Putting every owner's ``PB`` at the end of its list is always valid, but then
# the owner does all its tower backwards after its last pipeline step, while
# in the steady state it had idle slots (stage 0's rank does more work per
# micro-batch, so the other ranks wait for it), and the step ends with a tail
# of ``PB`` on the owners. A ``PB`` that goes into one of those idle slots is
# free.
#
# :func:`place_tower_backward` moves the ``PB`` steps greedily: one at a time,
# in the order of the micro-batches, each to the slot of its rank's list where
# the simulated makespan is least, ties going to the earlier slot (the kept
# tower graph is freed sooner). The candidate slots come after the owner's own
# input gradient of that micro-batch (dL/dfeatures needs it first) and are
# those where the rank would otherwise wait at least as long as the step takes
# (the simulated timeline without this ``PB`` says where), the end of the
# list, and the current slot, so no move makes the simulated step longer.
# Slots that would make the order stall are skipped. Trying only the idle
# slots is 10-20 times faster than trying every slot, and on the shapes we
# measured it was never worse, sometimes better: a greedy move into an idle
# slot leaves the busy stretches for the moves after it. Waits shorter than
# the step are not tried: with transfer latency in the model nearly every
# receive is a short wait, and trying them all made the search about 4 times
# slower for no better result.


def place_tower_backward(order: Order, costs: StepCosts | None = None) -> Order:
    """``order`` with each owner's ``PB`` moved to its best slot ([Note: tower backward placement]).

    ``order`` is a compute-only MPipe order (no SEND/RECV); ``REDUCE_P`` stays
    each rank's last step. ``costs`` defaults to :data:`PLACEMENT_COSTS`.
    Rank 0's ``PB`` steps move too: they may wait for an idle slot rather than
    delay stage 0's next forward.
    """
    return _placed(order, costs, T.PREPROCESS_BWD)


def _placed(order: Order, costs: StepCosts | None, kind: MetaStepType) -> Order:
    key = tuple((r, tuple(order[r])) for r in sorted(order))
    return {r: list(row) for r, row in _place(key, costs or PLACEMENT_COSTS, kind)}


def _bounds(row: list[MetaStep], step: MetaStep, feeds_rank0: set[MetaStep]) -> tuple[int, int]:
    """The slots of ``row`` (``step`` taken out) where ``step`` may go: ``[first, last]``.

    A ``PB`` needs its home stage's input gradient of the micro-batch first
    (dL/dfeatures comes from it) and may go as late as the end. A ``PF`` needs
    its ``LOAD`` first and must precede what reads the tower's output on its
    rank (stage 0's forward of the micro-batch, its ``PB``) and, on another
    rank, the first pipeline step whose output goes to rank 0 (``feeds_rank0``),
    so that stage 0's rank still receives the features before anything else
    from that peer ([Note: MPipe receive posting]).
    """
    i = step.micro_index
    if step.type is T.PREPROCESS_BWD:
        own = next(
            k
            for k, s in enumerate(row)
            if s.type.code in _INPUT_GRAD and s.micro_index == i and s.stage_index == step.stage_index
        )
        return own + 1, len(row)
    load = [k for k, s in enumerate(row) if s.type is T.DATA_LOAD and s.micro_index == i]
    readers = [
        k
        for k, s in enumerate(row)
        if s in feeds_rank0
        or (s.micro_index == i and ((s.type is T.FWD and s.stage_index == 0) or s.type is T.PREPROCESS_BWD))
    ]
    return (load[0] + 1 if load else 0), (readers[0] if readers else len(row))


@lru_cache(maxsize=256)
def _place(
    key: tuple[tuple[int, tuple[MetaStep, ...]], ...], costs: StepCosts, kind: MetaStepType
) -> tuple[tuple[int, tuple[MetaStep, ...]], ...]:
    """One placement pass over the steps of ``kind`` (memoised: every rank builds the same order)."""
    order = dict(key)
    ranks = sorted(order)
    tails = {r: [s for s in order[r] if s.type is T.PREPROCESS_REDUCE] for r in ranks}
    # [Note: tower placement over pairs]: the rows in split form; the pairs are closed at the end.
    pair_of = {s.parts[0]: s for r in ranks for s in order[r] if s.sub_steps is not None}
    steps = [[part for s in order[r] if s.type is not T.PREPROCESS_REDUCE for part in s.parts] for r in ranks]
    timer = _Timer(steps, costs, {forward: pair.parts[1] for forward, pair in pair_of.items()})
    number = timer.number
    by_number = [s for row in steps for s in row]
    rows = [[number[s] for s in row] for row in steps]
    best = timer.makespan(rows)
    if best is None:  # not ours to fix: validate_order names the problem
        return key
    # The pipeline steps of other ranks whose output rank 0 receives (they bound a PF only).
    feeds_rank0 = (
        {
            by_number[x]
            for n in rows[0]
            for x in timer.inputs[n]
            if by_number[x].type not in (T.PREPROCESS_FWD, T.DATA_LOAD)
        }
        if kind is T.PREPROCESS_FWD
        else set()
    )
    moves = sorted(
        ((k, s) for k, row in enumerate(steps) for s in row if s.type is kind),
        key=lambda ks: (ks[1].micro_index, ks[0]),
    )
    second_halves = {number[pair.parts[1]] for pair in pair_of.values()}
    for k, moving in moves:
        row, n = rows[k], number[moving]
        here = row.index(n)
        del row[here]
        first, last = _bounds([by_number[x] for x in row], moving, feeds_rank0)
        if last < len(row) and row[last] in second_halves:
            last -= 1  # a bound inside a pair: before the pair
        # The candidates: slots where the rank would otherwise wait as long as the step takes (it
        # fits there), the far bound, and the current slot; never between the halves of a pair.
        idle = timer.idle_before(rows, timer.cost[n])
        slots = [j for j in range(first, last) if idle[row[j]] and row[j] not in second_halves] + [last]
        choice = here
        for j in slots:
            if j == here:
                continue
            row.insert(j, n)
            t = timer.makespan(rows, beat=best if j > here else best + 1)
            del row[j]
            if t is not None and (t < best or (t == best and j < choice)):
                choice, best = j, t
        row.insert(choice, n)
    return tuple(
        (r, (*_closed([by_number[n] for n in rows[k]], pair_of), *tails[r])) for k, r in enumerate(ranks)
    )


def _closed(row: list[MetaStep], pair_of: dict[MetaStep, MetaStep]) -> list[MetaStep]:
    """``row`` in split form with each pair's halves (adjacent: nothing goes between) made one pair again."""
    out: list[MetaStep] = []
    skip = False
    for step in row:
        if skip:
            skip = False
            continue
        pair = pair_of.get(step)
        out.append(step if pair is None else pair)
        skip = pair is not None
    return out

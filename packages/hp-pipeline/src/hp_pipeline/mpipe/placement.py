"""Where each owner runs the tower's backward: the slot that shortens the step most.

[Note: tower backward placement]
With the owner backward, rank ``r`` can run ``PB`` of its micro-batch ``i``
only once stage 0 has made dL/dfeatures (``0Bi`` or ``0Ii``) and sent it back.
Putting every owner's ``PB`` at the end of its list is always valid, but then
the owner does all its tower backwards after its last pipeline step, while
in the steady state it had idle slots (stage 0's rank does more work per
micro-batch, so the other ranks wait for it), and the step ends with a tail
of ``PB`` on the owners. A ``PB`` that goes into one of those idle slots is
free.

:func:`place_tower_backward` moves the ``PB`` steps greedily: one at a time,
in the order of the micro-batches, each to the slot of its rank's list where
the simulated makespan is least, ties going to the earlier slot (the kept
tower graph is freed sooner). The candidate slots come after the owner's own
input gradient of that micro-batch (dL/dfeatures needs it first) and are
those where the rank would otherwise wait (the simulated timeline without
this ``PB`` says where), the end of the list, and the current slot, so no
move makes the simulated step longer. Slots that would make the order stall
are skipped. Trying only the idle slots is 10-20 times faster than trying
every slot, and on the shapes we measured it was never worse, sometimes
better (1F1B ``p=2, m=8``: 38 instead of 39; ZB-H1 ``p=8, m=64``: 224
instead of 230): a greedy move into an idle slot leaves the busy stretches
for the moves after it. The placement only moves ``PB``; stripping the
MPipe steps still gives the base order.

The simulation is the timing model of :func:`hp_pipeline.simulate` on the
compute-only order (``[Note: timing model]``), with the dependencies computed
once and integer costs, so one evaluation is a single pass over the steps.
The tower is assumed to cost what one text stage costs (``PF = F``,
``PB = B``), the case MPipe is for; other costs can be passed.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from itertools import pairwise
from math import lcm

from hp_pipeline._deps import OrderView
from hp_pipeline.ir import MetaStep, MetaStepType, Order
from hp_pipeline.simulate import StepCosts

__all__ = ["place_tower_backward"]

T = MetaStepType
_INPUT_GRAD = (T.BWD, T.BWD_INPUT)


class _Timer:
    """Makespan of a compute-only order under the simulator's timing model, in integers.

    Steps are numbered once; rows are lists of those numbers, so trying a slot
    is a list insert and one pass without hashing a step.
    """

    def __init__(self, rows: list[list[MetaStep]], costs: StepCosts) -> None:
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

    def makespan(self, rows: list[list[int]], beat: int | None = None) -> int | None:
        """The makespan, or ``None`` when some rank would wait forever or it cannot be below ``beat``.

        ``beat`` prunes: a rank whose clock plus its remaining work reaches it
        ends the pass early, since the result could not be chosen anyway.
        """
        return self._run(rows, beat, None)

    def idle_before(self, rows: list[list[int]]) -> list[bool]:
        """Per step number: whether its rank waits (is idle) right before the step starts."""
        starts = [-1] * len(self.cost)
        self._run(rows, None, starts)
        idle = [False] * len(self.cost)
        for row in rows:
            for a, b in pairwise(row):
                idle[b] = starts[b] > starts[a] + self.cost[a]
        return idle

    def _run(self, rows: list[list[int]], beat: int | None, starts: list[int] | None) -> int | None:
        cost, inputs, comm = self.cost, self.inputs, self.comm
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


def place_tower_backward(order: Order, costs: StepCosts | None = None) -> Order:
    """``order`` with each owner's ``PB`` moved to its best slot ([Note: tower backward placement]).

    ``order`` is a compute-only MPipe order (no SEND/RECV); ``REDUCE_P`` stays
    each rank's last step. ``costs`` defaults to a tower that costs one text
    stage. Rank 0's ``PB`` steps move too: they may wait for an idle slot
    rather than delay stage 0's next forward.
    """
    key = tuple((r, tuple(order[r])) for r in sorted(order))
    return {r: list(row) for r, row in _place(key, costs or StepCosts())}


@lru_cache(maxsize=256)
def _place(
    key: tuple[tuple[int, tuple[MetaStep, ...]], ...], costs: StepCosts
) -> tuple[tuple[int, tuple[MetaStep, ...]], ...]:
    """The placement of one order (memoised: every rank builds the same order, tests build many)."""
    order = dict(key)
    ranks = sorted(order)
    tails = {r: [s for s in order[r] if s.type is T.PREPROCESS_REDUCE] for r in ranks}
    steps = [[s for s in order[r] if s.type is not T.PREPROCESS_REDUCE] for r in ranks]
    timer = _Timer(steps, costs)
    number = timer.number
    rows = [[number[s] for s in row] for row in steps]
    best = timer.makespan(rows)
    if best is None:  # not ours to fix: validate_order names the problem
        return key
    moves = sorted(
        ((k, s) for k, row in enumerate(steps) for s in row if s.type is T.PREPROCESS_BWD),
        key=lambda ks: (ks[1].micro_index, ks[0]),
    )
    for k, pb in moves:
        row, n = rows[k], number[pb]
        here = row.index(n)
        del row[here]
        # dL/dfeatures needs the owner's own input gradient of the micro-batch (on its home
        # stage, the one that names the PB) first: before it the owner would wait forever.
        own = next(
            s
            for s in steps[k]
            if s.type in _INPUT_GRAD and s.micro_index == pb.micro_index and s.stage_index == pb.stage_index
        )
        first = row.index(number[own]) + 1
        # The candidates: slots where the rank would otherwise wait, and the end of its list.
        idle = timer.idle_before(rows)
        slots = [j for j in range(first, len(row)) if idle[row[j]]] + [len(row)]
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
    by_number = [s for row in steps for s in row]
    return tuple((r, (*(by_number[n] for n in rows[k]), *tails[r])) for k, r in enumerate(ranks))

"""[Note: coalesced batches]: the batches the executor posts on NCCL/HCCL cannot deadlock.

Single process, over every builder and a grid of sizes: the batches of
``_coalesced_batches`` are run through a model of NCCL's rules (each rank's
groups run one after another; a group finishes when every operation in it
meets its peer operation in the peer's running group (the operations of a
group progress independently); a group's sends need
the compute before it; a compute step needs every group up to its own), and
every step must finish. The model also rejects the schedule the executor used
to post (receives of the next block ahead of this block's sends), so it can
fail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hp_pipeline import (
    MetaStep,
    build_1f1b_order,
    build_dualpipev_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_interleaved_zero_bubble_order,
    build_looped_bfs_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    insert_comms,
)
from hp_pipeline.builders import stage_to_rank
from hp_pipeline.executor import _blocks, _coalesced_batches
from hp_pipeline.overlap import add_fsdp_steps_with_overlaps, split_order

Batches = list[list[MetaStep]]


def _lookahead_one(steps: Sequence[MetaStep]) -> Batches:
    """The old posting: sends of block k with all receives of block k+1 (deadlocks on NCCL)."""
    blocks = _blocks(steps)
    out: Batches = [[s for s in blocks[0].comms if s.type.is_recv]] if blocks else []
    for k, block in enumerate(blocks):
        following = blocks[k + 1].comms if k + 1 < len(blocks) else []
        out.append([s for s in block.comms if s.type.is_send] + [s for s in following if s.type.is_recv])
    return out


def _new(steps: Sequence[MetaStep]) -> Batches:
    return [[], *_coalesced_batches(_blocks(steps))]


def nccl_finishes(
    order: dict[int, list[MetaStep]], style: str, post: Callable[[Sequence[MetaStep]], Batches]
) -> bool:
    """Run ``post``'s batches under the NCCL model of the module docstring; True if all finish.

    ``post(steps)`` returns ``len(blocks) + 1`` batches: batch ``k + 1`` is
    posted before the action of block ``k`` (batch 0 before anything).
    """
    p = len(order)
    batches = {r: post(steps) for r, steps in order.items()}
    actions = {r: len(_blocks(steps)) for r, steps in order.items()}
    # Match the i-th send from a to b with the i-th receive on b from a (NCCL ignores tags).
    where: dict[tuple[int, int, int, bool], int] = {}  # (rank, peer, index, send) -> batch
    counters: dict[tuple[int, int, bool], int] = {}
    for r, rank_batches in batches.items():
        for b, batch in enumerate(rank_batches):
            for step in batch:
                assert step.peer_stage is not None
                peer = stage_to_rank(step.peer_stage, p, style=style)  # type: ignore[arg-type]
                send = step.type.is_send
                i = counters.get((r, peer, send), 0)
                counters[(r, peer, send)] = i + 1
                where[(r, peer, i, send)] = b
    ops: dict[int, list[list[tuple[int, int, bool]]]] = {
        r: [[] for _ in rank_batches] for r, rank_batches in batches.items()
    }
    for (r, peer, i, send), b in where.items():
        ops[r][b].append((peer, i, send))
    current = dict.fromkeys(order, 0)  # the group running on each rank's stream
    done_actions = dict.fromkeys(order, 0)
    finished: set[tuple[int, int, int, bool]] = set()  # (rank, peer, index, send) of completed ops

    def running(r: int) -> bool:
        # a group starts once the compute before it ran (its sends' payloads exist)
        return current[r] < len(batches[r]) and done_actions[r] >= current[r] - 1

    progress = True
    while progress:
        progress = False
        for r in order:
            if running(r):
                b = current[r]
                for peer, i, send in ops[r][b]:
                    their = where.get((peer, r, i, not send))
                    if their is None:
                        raise AssertionError(f"rank {r}: op #{i} with rank {peer} has no other end")
                    # an op meets its peer op while both groups run; each op of a group on its own
                    if current[peer] == their and running(peer):
                        finished.add((r, peer, i, send))
                        finished.add((peer, r, i, not send))
                if all((r, peer, i, send) in finished for peer, i, send in ops[r][b]):
                    current[r] = b + 1
                    progress = True
            a = done_actions[r]
            if a < actions[r] and current[r] >= a + 2:  # every group up to action a's own finished
                done_actions[r] = a + 1
                progress = True
    return all(done_actions[r] == actions[r] and current[r] == len(batches[r]) for r in order)


def _orders() -> list[tuple[str, dict[int, list[MetaStep]], str]]:
    cases = []
    for p in (2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8):
            cases.append((f"gpipe-p{p}-m{m}", build_gpipe_order(p, m), "loop"))
            if m >= 1:
                cases.append((f"1f1b-p{p}-m{m}", build_1f1b_order(p, m), "loop"))
            if m >= p:
                cases.append((f"zbh1-p{p}-m{m}", build_zero_bubble_h1_order(p, m), "loop"))
                cases.append((f"zbv-p{p}-m{m}", build_zbv_order(p, m), "v"))
            if m % p == 0:
                cases.append((f"interleaved-p{p}-m{m}", build_interleaved_1f1b_order(p, m, 2), "loop"))
                cases.append(
                    (f"interleaved-zb-p{p}-m{m}", build_interleaved_zero_bubble_order(p, m, 2), "loop")
                )
            cases.append((f"looped-bfs-p{p}-m{m}", build_looped_bfs_order(p, m, 2), "loop"))
            if m >= 2 * p:
                cases.append((f"dualpipev-p{p}-m{m}", build_dualpipev_order(p, m), "v"))
    return cases


CASES = _orders()


@pytest.mark.parametrize(("order", "style"), [(o, s) for _, o, s in CASES], ids=[n for n, _, _ in CASES])
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
def test_coalesced_batches_finish_under_nccl_rules(
    order: dict[int, list[MetaStep]], style: str, fsdp: bool
) -> None:
    if fsdp:
        order = add_fsdp_steps_with_overlaps(
            order, {s.stage_index for steps in order.values() for s in steps}
        )
    # what the runner posts from: each OVERLAP_F_B split ([Note: running overlapped steps])
    runnable = split_order(insert_comms(order))
    assert nccl_finishes(runnable, style, _new)
    # forward only (no loss_fn): the runner drops the backward steps, then batches what is left
    forward_only = {r: [s for s in steps if not s.type.training_only] for r, steps in runnable.items()}
    assert nccl_finishes(forward_only, style, _new)


def test_model_rejects_the_old_posting() -> None:
    """GPipe's last forward send and first gradient receive cross under the old posting."""
    runnable = insert_comms(build_gpipe_order(2, 4))
    assert not nccl_finishes(runnable, "loop", _lookahead_one)
    assert nccl_finishes(runnable, "loop", _new)

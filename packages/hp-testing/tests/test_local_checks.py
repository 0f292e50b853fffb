"""NCCL's and HCCL's contract in both modes: each planted bug, one test body, caught with mode="local" too.

The rules that need no concurrency (argument agreement, element counts and
dtypes, group membership, p2p matching and tags, a pair's order, NCCL's first
batch on a group, hangs) must be caught by local mode as by the multi-process
mode. Bugs that raise before anything moves are caught inside the body in
both modes; bugs that leave half a message behind run in an inner pytest
session, where each fails and the report is read per mode.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_testing import BackendRuleError, CollectiveMismatchError, P2PMismatchError
from hp_testing._calls import NotAMemberError

# Local mode beside pytester's inner sessions: see [Note: local mode beside pytester] in conftest.py.

MODES = ("process", "local")


def _both(world: int, backend: str) -> pytest.MarkDecorator:
    """The test once per mode, on ``world`` ranks of ``backend``."""
    marks = {m: pytest.mark.distributed(world_size=world, backend=backend, mode=m) for m in MODES}
    return pytest.mark.parametrize("mode", [pytest.param(m, marks=marks[m], id=m) for m in MODES])


# -- caught inside the body: the check raises on every rank before anything is sent ------------------


@_both(2, "nccl-emu")
def test_collective_arguments_must_agree_in_both_modes(rank: int, mode: str) -> None:
    with pytest.raises(CollectiveMismatchError):
        dist.all_reduce(torch.ones(2, dtype=torch.float64 if rank else torch.float32))  # dtype
    with pytest.raises(CollectiveMismatchError):
        dist.all_reduce(torch.ones(2 + rank))  # element count
    with pytest.raises(CollectiveMismatchError):
        dist.broadcast(torch.ones(2), src=rank)  # root
    with pytest.raises(CollectiveMismatchError):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM)  # reduce op
    with pytest.raises(CollectiveMismatchError):
        dist.broadcast_object_list([None] * (1 + rank), src=0)  # list lengths
    with pytest.raises(CollectiveMismatchError):
        ins, outs = ([1, 1], [1, 1]) if rank == 0 else ([2, 0], [1, 1])  # rank 1 sends 0 to rank 1
        dist.all_to_all_single(torch.empty(2), torch.ones(2), outs, ins)
    # element counts agree, shapes differ: NCCL and gloo see a count, so it runs, in both modes
    t = torch.full((2, 2) if rank else (4,), float(rank + 1))
    dist.all_reduce(t)
    torch.testing.assert_close(t.reshape(-1), torch.full((4,), 3.0), rtol=0, atol=0)
    source = torch.arange(4.0).reshape((4,) if rank else (2, 2)) * (1 - rank)
    dist.broadcast(source, src=0)
    torch.testing.assert_close(source.reshape(-1), torch.arange(4.0), rtol=0, atol=0)


@_both(2, "nccl-emu")
def test_rooted_collectives_and_all_to_all_lists_in_both_modes(rank: int, mode: str) -> None:
    with pytest.raises(CollectiveMismatchError):
        dist.reduce(torch.ones(2), dst=rank)  # the ranks name different roots
    with pytest.raises(CollectiveMismatchError):
        dist.gather(torch.ones(1 + rank), [torch.empty(1)] * 2 if rank == 0 else None, dst=0)
    with pytest.raises(CollectiveMismatchError):
        dist.scatter(torch.empty(1), [torch.ones(1)] * 2, src=rank)  # each rank its own root
    # and each gives what one process computes
    t = torch.full((3,), float(rank + 1))
    dist.reduce(t, dst=1)
    if rank == 1:
        torch.testing.assert_close(t, torch.full((3,), 3.0), rtol=0, atol=0)
    gathered = [torch.empty(2) for _ in range(2)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0)
    if gathered is not None:
        expected = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
        torch.testing.assert_close(torch.stack(gathered), expected, rtol=0, atol=0)
    piece = torch.empty(2)
    dist.scatter(piece, [torch.full((2,), 5.0 + r) for r in range(2)] if rank == 1 else None, src=1)
    torch.testing.assert_close(piece, torch.full((2,), 5.0 + rank), rtol=0, atol=0)
    with pytest.raises(CollectiveMismatchError):  # rank 1 sends 2 elements to itself, expecting 1
        dist.all_to_all([torch.empty(1), torch.empty(1)], [torch.ones(1), torch.ones(1 + rank)])
    outs = [torch.empty(1) for _ in range(2)]
    dist.all_to_all(outs, [torch.full((1,), 10.0 * rank + j) for j in range(2)])
    torch.testing.assert_close(torch.cat(outs), torch.tensor([rank, 10.0 + rank]), rtol=0, atol=0)


@_both(2, "gloo")
def test_sparse_tensors_are_refused_in_both_modes(rank: int, mode: str) -> None:
    with pytest.raises(BackendRuleError, match=r"tensor has layout torch\.sparse_coo"):
        dist.all_reduce(torch.ones(2).to_sparse())
    t = torch.ones(2).to_sparse().to_dense()
    dist.all_reduce(t)
    torch.testing.assert_close(t, torch.full((2,), 2.0), rtol=0, atol=0)


@_both(4, "nccl-emu")
def test_group_membership_in_both_modes(rank: int, mode: str) -> None:
    pair = dist.new_group([0, 1])
    if rank >= 2:
        with pytest.raises(NotAMemberError, match=f"rank {rank} is not a member of the group it passed"):
            dist.all_reduce(torch.ones(1), group=pair)
    else:
        t = torch.ones(1)
        dist.all_reduce(t, group=pair)
        assert t.item() == 2.0


@_both(2, "nccl-emu")
def test_object_p2p_list_lengths_in_both_modes(rank: int, mode: str) -> None:
    with pytest.raises(P2PMismatchError):
        if rank == 0:
            dist.send_object_list(["a", "b"], dst=1)
        else:
            dist.recv_object_list([None], src=0)


# -- bugs that leave half a message behind: an inner session, each must fail in both modes -------------

HEADER = "import pytest\nimport torch\nimport torch.distributed as dist\nMODES = ('process', 'local')\n"

BUGS = """
def both(world, backend):
    return pytest.mark.parametrize("mode", [
        pytest.param(m, marks=pytest.mark.distributed(world_size=world, backend=backend, mode=m), id=m)
        for m in MODES])

@both(2, "nccl-emu")
def test_bug_tags_cross(rank, mode):
    if rank == 0:
        a, b = dist.isend(torch.ones(1), 1, tag=1), dist.isend(torch.ones(1), 1, tag=2)
    else:
        b, a = dist.irecv(torch.empty(1), 0, tag=2), dist.irecv(torch.empty(1), 0, tag=1)
    a.wait(); b.wait()

@both(2, "hccl-emu")
def test_bug_opposite_order(rank, mode):
    peer = 1 - rank
    works = [dist.isend(torch.ones(2), peer), dist.irecv(torch.empty(2), peer)]
    for w in works:
        w.wait()

def exchange_pair(rank, group=None):
    if rank < 2:
        got = torch.empty(1)
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), 1 - rank, group),
                                dist.P2POp(dist.irecv, got, 1 - rank, group)])[0].wait()
        assert got.item() == 1.0

@both(4, "nccl-emu")
def test_bug_first_batch_without_ranks_2_3(rank, mode):
    exchange_pair(rank)  # ranks 2 and 3 never touch the world group

@both(4, "nccl-emu")
def test_bug_first_batch_rank_3_raises(rank, mode):
    if rank == 3:
        raise ValueError("boom")
    exchange_pair(rank)

@both(2, "nccl-emu")
def test_bug_sizes(rank, mode):
    ops = [dist.P2POp(dist.isend, torch.ones(2 + rank), 1 - rank),
           dist.P2POp(dist.irecv, torch.empty(2), 1 - rank)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()

@both(2, "nccl-emu")
def test_bug_send_send_deadlock(rank, mode):
    dist.send(torch.ones(2), 1 - rank)
    dist.recv(torch.empty(2), 1 - rank)

@both(2, "nccl-emu")
def test_bug_send_never_waited_nor_received(rank, mode):
    if rank == 0:
        dist.isend(torch.ones(2), 1)

@both(2, "nccl-emu")
def test_bug_skipped_collective(rank, mode):
    if rank == 0:
        dist.all_reduce(torch.ones(2))

@both(4, "hccl-emu")
def test_ok_first_batch_rule_is_nccl_only(rank, mode):
    exchange_pair(rank)

@both(4, "nccl-emu")
def test_ok_first_batch_after_a_collective(rank, mode):
    dist.barrier()
    exchange_pair(rank)

@both(4, "nccl-emu")
def test_ok_first_batch_while_others_join_by_a_collective(rank, mode):
    exchange_pair(rank)  # ranks 2 and 3 join the communicator in the barrier below
    dist.barrier()

@both(4, "nccl-emu")
def test_ok_first_batch_on_a_pair_group(rank, mode):
    pair = dist.new_group([0, 1])
    exchange_pair(rank, pair)

@both(4, "nccl-emu")
def test_ok_ring_pipeline_and_tags_in_order(rank, mode):
    nxt, prev = (rank + 1) % 4, (rank - 1) % 4
    got = torch.empty(2)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt),
                                     dist.P2POp(dist.irecv, got, prev)]):
        w.wait()
    assert got.tolist() == [float(prev)] * 2
    if rank % 2 == 0:
        dist.send(torch.ones(3), rank + 1, tag=5)
        dist.recv(got, rank + 1, tag=6)
    else:
        dist.recv(torch.empty(3), rank - 1, tag=5)
        dist.send(torch.ones(2), rank - 1, tag=6)
    works = [dist.irecv(torch.empty(1), prev), dist.isend(torch.ones(1), nxt)] if rank else \\
        [dist.isend(torch.ones(1), nxt), dist.irecv(torch.empty(1), prev)]
    for w in works:
        w.wait()
"""

# what each mode must report for each planted bug (the same text where the rule is the contract's)
EXPECTED: dict[str, dict[str, list[str]]] = {
    "test_bug_tags_cross": {
        mode: [
            r"P2PMismatchError: message #0 from rank 0 to rank 1: the tags differ:",
            r"rank 0: isend\(1 torch.float32 to rank 1\) tag=1  at .*test_inner.py:\d+ in test_bug_tags",
            r"rank 1: irecv\(1 torch.float32 from rank 0\) tag=2  at .*test_inner.py:\d+ in test_bug_tags",
            r"NCCL and HCCL ignore tags",
        ]
        for mode in MODES
    },
    "test_bug_opposite_order": {
        mode: [
            r"DeadlockError: ranks [01] and [01] post their point-to-point ops to each other in opposite "
            r"orders",
            r"rank 0 posts  1. isend\(2 torch.float32 to rank 1\) at .*test_inner.py:\d+",
            r"2. irecv\(2 torch.float32 from rank 1\) at .*test_inner.py:\d+",
            r"Post both in one batch_isend_irecv",
        ]
        for mode in MODES
    },
    "test_bug_first_batch_without_ranks_2_3": {
        mode: [
            r"PeerFailedError: rank [23] finished the test while rank [01] waited for it in "
            r"isend\(1 torch.float32 to rank 1\): the first batch_isend_irecv on group \[0, 1, 2, 3\], "
            r"where NCCL creates the group's communicator",
            r"rank [23] never issued the matching call\. It issued no collective on that group\.",
        ]
        for mode in MODES
    },
    "test_bug_first_batch_rank_3_raises": {
        mode: [
            r"PeerFailedError: rank [23] (failed|finished the test) while rank [01] waited for it in "
            r"isend",
            r"the first batch_isend_irecv on group \[0, 1, 2, 3\]",
            r"ValueError",
        ]
        for mode in MODES
    },
    "test_bug_sizes": {
        "process": [r"P2PMismatchError: message #0 from rank [01] to rank [01]: the two ends disagree"],
        "local": [r"P2PMismatchError: hp_testing local mode: a send and the receive it meets disagree"],
    },
    "test_bug_send_send_deadlock": {
        "process": [r"DeadlockError: deadlock: ranks \[\d, \d\] wait on each other in a cycle"],
        "local": [r"LocalHangError: local world of 2 ranks stopped", r"rank 0 waits in rank 0 send"],
    },
    "test_bug_send_never_waited_nor_received": {
        mode: [
            r"UnmatchedError: ",
            r"rank 0 sent 1 message\(s\) to rank 1 but rank 1 received 0",
            r"first unreceived: #0 isend\(2 torch.float32 to rank 1\) at .*test_inner.py:\d+",
        ]
        for mode in MODES
    },
    "test_bug_skipped_collective": {
        "process": [r"rank 1 finished the test while rank 0 waited for it in all_reduce"],
        "local": [r"rank 0 waits in all_reduce", r"rank 1 returned \(ended\)"],
    },
}


def test_p2p_and_hang_bugs_are_caught_in_both_modes(inner: Any) -> None:
    result, sections = inner(HEADER + BUGS)
    failed = {name for name in sections if name.startswith("test_bug_")}
    assert failed == {f"{bug}[{mode}]" for bug in EXPECTED for mode in MODES}, sorted(sections)
    result.assert_outcomes(passed=2 * 5, failed=2 * len(EXPECTED))
    for bug, per_mode in EXPECTED.items():
        for mode, patterns in per_mode.items():
            text = sections[f"{bug}[{mode}]"]
            for pattern in patterns:
                assert re.search(pattern, text), f"{bug}[{mode}]: no {pattern!r} in\n{text}"


def test_every_backend_rule_applies_in_local_mode(inner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """test_emulation_rules.py (every profile rule, planted and correct) again, each body in local mode.

    The inner session runs local mode in this process: [Note: local mode beside pytester].
    """
    monkeypatch.setenv("HP_TEST_MODE", "local")
    source = (pathlib.Path(__file__).parent / "test_emulation_rules.py").read_text()
    result, _ = inner(source)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 40 and set(outcomes) <= {"passed", "warnings"}, outcomes


# -- messages never received: the end-of-test check of run_local_outcomes --------------------------------


def test_unmatched_messages_at_the_end_read_as_in_the_process_mode() -> None:
    """A send never received and a receive never sent fail the ranks at both ends, as ``UnmatchedError``."""
    from hp_testing.local import run_local_outcomes

    def body(rank: int) -> None:
        if rank == 0:
            dist.isend(torch.ones(2), 1)  # never waited, never received
        got = torch.empty(1)
        work = dist.irecv(got, 0) if rank == 2 else None  # never sent
        dist.barrier()
        del work

    outcomes = run_local_outcomes(body, 3, emulate="nccl")
    assert [o.ok for o in outcomes] == [False, False, False]
    assert all(type(o.exception).__name__ == "UnmatchedError" for o in outcomes)
    sent = re.compile(
        r"UnmatchedError: point-to-point messages without their other end at the end of the test:\n"
        r"  rank 0 sent 1 message\(s\) to rank 1 but rank 1 received 0; first unreceived: "
        r"#0 isend\(2 torch.float32 to rank 1\) at .*test_local_checks.py:\d+ in body"
    )
    assert sent.search(outcomes[1].error), outcomes[1].error
    assert "rank 2 posted 1 receive(s) from rank 0 but rank 0 sent 0" in outcomes[0].error
    assert "rank 2 posted 1 receive(s) from rank 0" in outcomes[2].error
    assert "to rank 1" not in outcomes[2].error  # rank 2 is told only of its own messages


@pytest.mark.parametrize("emulate", [None, "nccl"])
def test_messages_received_but_never_waited_pass(emulate: str | None) -> None:
    """Only a message without its other end is reported: a received send nobody waited on is fine."""
    from hp_testing.local import run_local_outcomes

    def matched(rank: int) -> float:
        got = torch.zeros(2)
        if rank == 0:
            dist.isend(torch.ones(2), 1)  # never waited, but received
        elif rank == 1:
            dist.recv(got, 0)
        return got.sum().item()

    outcomes = run_local_outcomes(matched, 2, emulate=emulate)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert [o.value for o in outcomes] == [0.0, 2.0]


def test_a_failed_rank_is_reported_alone() -> None:
    """When a rank raised, its own error stands: no unmatched-message report on top (as with processes)."""
    from hp_testing.local import run_local_outcomes

    def body(rank: int) -> None:
        if rank == 0:
            dist.isend(torch.ones(2), 1)
        else:
            raise ValueError("boom on rank 1")

    outcomes = run_local_outcomes(body, 2)
    assert outcomes[0].ok and not outcomes[1].ok
    assert "ValueError: boom on rank 1" in outcomes[1].error and "UnmatchedError" not in outcomes[1].error

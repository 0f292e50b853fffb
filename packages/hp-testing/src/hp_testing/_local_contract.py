"""NCCL's and HCCL's point-to-point contract in local mode: tags, order per pair, a group's first batch.

The in-memory backend sees both ends of a message at once; this module holds
what it needs beyond that to check the rules the multi-process side channel
checks, with the same errors: a send and a receive that meet with different
tags, ops two ranks post to each other in opposite orders (NCCL and HCCL run a
pair's ops one after another), and NCCL's first ``batch_isend_irecv`` on a
group, which waits until every rank of the group has joined the group's
communicator. Which of them apply is the run's profile
(:mod:`hp_testing.profiles`); the table of rules per mode is in the README.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hp_testing._p2p_notes import Note
from hp_testing._sidechannel import (
    DeadlockError,
    P2PMismatchError,
    PeerFailedError,
    UnmatchedError,
    opposite_orders,
    tags_differ,
    unmatched_text,
    unreceived_line,
    unsent_line,
)

if TYPE_CHECKING:
    from hp_testing._local_world import RankOutcome, World
    from hp_testing.profiles import Profile

__all__ = ["Contract", "End", "contract", "report_unmatched"]


@dataclass
class End:
    """One end of a message as the checks see it: who, what, where, and its place among the pair's ops."""

    rank: int
    peer: int
    shown: str  # as the layer shows it: "isend(2 torch.float32 to rank 1)"
    site: str
    tag: int
    pos: int  # the op's place among this rank's ops with its peer (a batch is one place)
    seq: int  # message number on (group, src, dst)
    noted: bool  # issued through the layer (the tag is the user's)

    @property
    def where(self) -> str:
        return f"{self.shown} at {self.site}"


@dataclass
class _Pair:
    pos: int = 0
    batch: object | None = None
    batch_pos: int | None = None


@dataclass
class Contract:
    """One local world's record for the checks: positions per pair, matched messages, joined groups."""

    profile: Profile | None
    pairs: dict[tuple[str, int, int], _Pair] = field(default_factory=dict)  # (group, rank, peer)
    matches: dict[tuple[str, int, int], list[tuple[End, End]]] = field(default_factory=dict)
    seqs: dict[tuple[str, int, int, bool], int] = field(default_factory=dict)
    joined: dict[str, set[int]] = field(default_factory=dict)
    collectives: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)

    # -- recording -------------------------------------------------------------------------------

    def end(
        self, group: str, rank: int, peer: int, send: bool, note: Note | None, shown: str, tag: int
    ) -> End:
        """Record one send (``send``) or receive posted by ``rank`` to or from ``peer``."""
        src, dst = (rank, peer) if send else (peer, rank)
        key = (group, src, dst, send)
        seq = self.seqs.get(key, 0)
        self.seqs[key] = seq + 1
        pair = self.pairs.setdefault((group, rank, peer), _Pair())
        batch = note.batch if note is not None else None
        if batch is None:
            pos, pair.batch_pos = pair.pos, None
            pair.pos += 1
        else:  # the ops of one batch to one peer progress together: one place
            if pair.batch_pos is None or pair.batch is not batch:
                pair.batch_pos, pair.batch = pair.pos, batch
                pair.pos += 1
            pos = pair.batch_pos
        if note is None:
            return End(rank, peer, shown, "<unknown>", tag, pos, seq, noted=False)
        call = note.call
        return End(rank, peer, call.shown, call.site, call.tag, pos, seq, noted=True)

    def collective(self, group: str, rank: int, shown: str) -> None:
        """A collective issued by ``rank`` on ``group``: it joins the group's communicator."""
        count, _ = self.collectives.get((group, rank), (0, ""))
        self.collectives[(group, rank)] = (count + 1, shown)
        self.joined.setdefault(group, set()).add(rank)

    # -- checks at the meeting of a send and its receive -------------------------------------------

    def meet(self, group: str, send: End, recv: End) -> tuple[RuntimeError, RuntimeError] | None:
        """The errors of the send's and the receive's ranks if the two break the profile's contract."""
        profile = self.profile
        if profile is None:
            return None
        if not profile.p2p_tags and send.noted and recv.noted and send.tag != recv.tag:
            return _tags_differ(send, recv, send, recv), _tags_differ(send, recv, recv, send)
        if profile.stream_ordered_p2p:
            return self._order(group, send, recv)
        return None

    def _order(self, group: str, send: End, recv: End) -> tuple[RuntimeError, RuntimeError] | None:
        low, high = sorted((send, recv), key=lambda e: e.rank)
        history = self.matches.setdefault((group, low.rank, high.rank), [])
        for earlier in history:
            if (earlier[0].pos - low.pos) * (earlier[1].pos - high.pos) < 0:
                return (
                    _opposite(send, recv, (earlier, (low, high))),
                    _opposite(recv, send, (earlier, (low, high))),
                )
        history.append((low, high))
        return None

    # -- NCCL's first batch on a group ---------------------------------------------------------

    def first_batch(
        self, world: World, group: str, ranks: tuple[int, ...], rank: int, note: Note | None
    ) -> None:
        """Wait, as ``ncclCommInitRank`` does, until every rank of ``group`` has joined it.

        [Note: the first batch on a group] in :mod:`hp_testing.profiles`.
        """
        if self.profile is None or not self.profile.first_batch_joins_group or note is None or not note.first:
            return
        members = self.joined.setdefault(group, set())
        if rank in members:
            return
        members.add(rank)
        world.wake()
        call = note.call
        what = (
            f"{call.shown}: the first batch_isend_irecv on group {list(ranks)}, where NCCL creates the "
            "group's communicator and waits until every rank of the group joins it (with a "
            "batch_isend_irecv or a collective on the group)"
        )
        from hp_testing._local_world import LocalHangError

        try:
            world.block_until(lambda: members.issuperset(ranks), f"{what} at {call.site}")
        except LocalHangError:
            for owner in ranks:
                if owner not in members and owner in world.ended:
                    raise self._gone(world, group, owner, rank, f"{what} at {call.site}") from None
            raise

    def _gone(self, world: World, group: str, owner: int, rank: int, waited: str) -> PeerFailedError:
        """The multi-process mode's error for a peer that ended without issuing what ``rank`` waits for."""
        how = world.ended[owner]
        if how.startswith("raised"):
            return PeerFailedError(
                f"rank {owner} failed while rank {rank} waited for it in {waited}; stopped waiting. "
                f"Rank {owner} {how.removesuffix(' (ended)')} (its traceback is in its own report)."
            )
        count, last = self.collectives.get((group, owner), (0, ""))
        issued = (
            f"It issued {count} collective(s) on that group; the last was {last}."
            if count
            else "It issued no collective on that group."
        )
        return PeerFailedError(
            f"rank {owner} finished the test while rank {rank} waited for it in {waited}: rank {owner} never "
            f"issued the matching call. {issued}"
        )


def _tags_differ(send: End, recv: End, mine: End, them: End) -> P2PMismatchError:
    """The message ``send`` -> ``recv`` met ends with different tags, told from ``mine``'s rank."""
    ends = [(end.rank, end.shown, end.tag, end.site) for end in (mine, them)]
    return tags_differ(send.seq, send.rank, recv.rank, ends[0], ends[1])


def _opposite(mine: End, theirs: End, matches: tuple[tuple[End, End], tuple[End, End]]) -> DeadlockError:
    """Ranks ``mine.rank`` and ``theirs.rank`` posted two of their ops to each other in opposite orders."""

    def oriented(match: tuple[End, End]) -> tuple[End, End]:
        return match if match[0].rank == mine.rank else (match[1], match[0])

    first, second = sorted((oriented(m) for m in matches), key=lambda m: m[0].pos)
    return opposite_orders(
        mine.rank, theirs.rank, (first[0].where, second[0].where), (second[1].where, first[1].where)
    )


_CONTRACTS: dict[int, Contract] = {}


def contract(world: Any) -> Contract:
    """``world``'s record, made on first use with the profile of the layer installed for the run."""
    found = _CONTRACTS.get(id(world))
    if found is None:
        from hp_testing.emulation import active_layer

        layer = active_layer()
        found = _CONTRACTS[id(world)] = Contract(layer.profile if layer is not None else None)
        weakref.finalize(world, _CONTRACTS.pop, id(world), None)
    return found


def report_unmatched(world: World, outcomes: list[RankOutcome]) -> None:
    """After a run whose ranks all passed: fail each rank with a message whose other end never came.

    The multi-process mode's end-of-test check (``UnmatchedError``, the same text): a send
    never received, or a receive never sent, that no rank waited for (a wait would have been
    a hang, reported at once). Meant for ``run_local_outcomes`` once the world has run.
    """
    if not all(outcome.ok for outcome in outcomes):
        return  # a failed rank's own report says why; as in the multi-process mode
    record = _CONTRACTS.get(id(world))
    if record is None:
        return
    lines: dict[tuple[str, int, int], str] = {}
    for key, (sends, recvs) in sorted(world.channels.items(), key=lambda item: str(item[0])):
        group = key[0]
        for message, is_send in [*((m, True) for m in sends), *((m, False) for m in recvs)]:
            end = message.end
            if end is None:
                continue
            src, dst = (end.rank, end.peer) if is_send else (end.peer, end.rank)
            sent, received = (
                record.seqs.get((group, src, dst, True), 0),
                record.seqs.get((group, src, dst, False), 0),
            )
            if (group, src, dst) in lines:
                continue
            lines[(group, src, dst)] = (
                unreceived_line(src, dst, sent, received, f"#{end.seq} {end.where}")
                if is_send
                else unsent_line(src, dst, sent, received)
            )
    for outcome in outcomes:
        mine = [line for (_, src, dst), line in sorted(lines.items()) if outcome.rank in (src, dst)]
        if not mine:
            continue
        text = unmatched_text(mine)
        outcome.ok = False
        outcome.exception = UnmatchedError(text)
        outcome.error = f"hp_testing._sidechannel.UnmatchedError: {text}\n"

"""Cross-rank checks through the pool's TCPStore, beside (never through) the collectives.

Before a collective runs, each rank posts its fingerprint under
``c/<group>/<seq>/<rank>`` and reads every other member's; a mismatch raises
on every rank the same side-by-side report. Point-to-point messages are keyed
per direction and per message number (``s/...`` for the send, ``r/...`` for
the receive); waiting for a message's other end is where unmatched sends,
size mismatches and NCCL ordering deadlocks surface. Waits never hang
([Note: waiting without hanging]); values are checked JSON records, never
pickles ([Note: nothing read from the store is executed] in ``_wire``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from hp_testing._calls import Call
from hp_testing._p2p_report import exchange_report
from hp_testing._wire import (
    Blocked,
    Done,
    Fingerprint,
    ForeignValueError,
    P2PEnd,
    Posted,
    R,
    Record,
    Status,
    decode,
    encode,
    plain,
    status_key,
)

__all__ = [
    "CollectiveMismatchError",
    "DeadlockError",
    "DroppedMessageError",
    "ForeignValueError",
    "P2PMismatchError",
    "PeerFailedError",
    "SideChannel",
    "Ticket",
    "UnmatchedError",
    "announce_exit",
    "opposite_orders",
    "tags_differ",
    "unmatched_text",
    "unreceived_line",
    "unsent_line",
]

_POLLS = (0.2, 0.3, 0.5, 1.0)


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group issued different collectives at the same position."""


class PeerFailedError(RuntimeError):
    """Another rank failed, died or finished while this one waited for it."""


class DeadlockError(RuntimeError):
    """Ranks wait on each other in a cycle (or in an order NCCL would serialise into one)."""


class P2PMismatchError(RuntimeError):
    """A send and its receive disagree on element count or dtype."""


class UnmatchedError(RuntimeError):
    """Sends or receives without their other end: at the end of the test, or ranks that all wait for one."""


class DroppedMessageError(RuntimeError):
    """The message this receive waits for was dropped by fault injection."""


# -- the p2p errors' texts, shared with local mode (hp_testing._local_contract) ---------------------


def tags_differ(
    seq: int, src: int, dst: int, mine: tuple[int, str, int, str], theirs: tuple[int, str, int, str]
) -> P2PMismatchError:
    """Message ``seq`` from ``src`` to ``dst`` met ends with different tags: (rank, shown, tag, site) each."""
    lines = "".join(
        f"  rank {rank}: {shown} tag={tag}  at {site}\n" for rank, shown, tag, site in (mine, theirs)
    )
    return P2PMismatchError(
        f"message #{seq} from rank {src} to rank {dst}: the tags differ:\n{lines}"
        "NCCL and HCCL ignore tags ('tag is not supported with the NCCL backend', torch docs) and "
        "match sends to receives in issue order per pair, so these two meet there while gloo "
        "would pair them by tag. Post sends and receives in the same order on both ranks."
    )


def opposite_orders(me: int, peer: int, mine: tuple[str, str], theirs: tuple[str, str]) -> DeadlockError:
    """Ranks ``me`` and ``peer`` posted two ops to each other in opposite orders, each in its order."""
    return DeadlockError(
        f"ranks {me} and {peer} post their point-to-point ops to each other in opposite orders:\n"
        f"  rank {me} posts  1. {mine[0]}\n"
        f"                  2. {mine[1]}\n"
        f"  rank {peer} posts  1. {theirs[0]}\n"
        f"                  2. {theirs[1]}\n"
        "NCCL and HCCL run the point-to-point ops between two ranks one after another, each "
        "blocking until its peer op runs, so this deadlocks on a GPU/NPU even though gloo "
        "completes it. Post both in one batch_isend_irecv, or order them so each send meets "
        "its receive."
    )


def unreceived_line(src: int, dst: int, sent: int, received: int, first: str) -> str:
    """One line of the end-of-test report: sends without receives (``first``: "#n where", if known)."""
    line = f"  rank {src} sent {sent} message(s) to rank {dst} but rank {dst} received {received}"
    return line + (f"; first unreceived: {first}" if first else "")


def unsent_line(src: int, dst: int, sent: int, received: int) -> str:
    """One line of the end-of-test report: receives without sends."""
    return f"  rank {dst} posted {received} receive(s) from rank {src} but rank {src} sent {sent}"


def unmatched_text(lines: list[str]) -> str:
    """The end-of-test report of messages without their other end (``lines``: one per direction)."""
    return (
        "point-to-point messages without their other end at the end of the test:\n"
        + "\n".join(lines)
        + "\nOn NCCL or HCCL an unmatched send or receive hangs the stream. Pair every send with "
        "a receive of the same size on the peer."
    )


@dataclass
class Ticket:
    """One posted point-to-point op: what we wait for to call it matched."""

    call: Call
    send: bool
    group: str
    src: int
    dst: int
    seq: int
    pos: int
    checked: bool = False

    def posted(self) -> Posted:
        return Posted(self.send, self.group, self.src, self.dst, self.seq, self.call.shown, self.call.site)


@dataclass
class _Pair:
    """The point-to-point stream between two ranks: positions in issue order (a batch shares one)."""

    pos: int = 0
    batch_pos: int | None = None
    batch: object | None = None
    matches: list[tuple[int, int, str, str]] = field(default_factory=list)


def _put(store: Any, key: str, record: Record) -> None:
    store.set(key, encode(record))


def announce_exit(store: Any, prefix: str, rank: int, code: int | None, how: str) -> None:
    """Tell the checks of the ranks still running that ``rank``'s process has ended.

    Posted by whoever watches the processes (the pytest pool, ``hp-run``),
    since a process that has ended cannot post anything itself. A status the
    rank posted before it ended (its traceback) is kept: it says more.
    ``how`` is one sentence for the peers' error, e.g. how the launcher saw it end.
    """
    channel = dist.PrefixStore(prefix + "/", store)
    key = status_key(rank)
    if not channel.check([key]):
        _put(channel, key, Status("exited", how, code))


def _is_p2p(key: str) -> bool:
    """Whether a store key is one end of a point-to-point message."""
    return key.startswith(("s/", "r/"))


# Seconds between looks for the exchanges of ranks still running: 2 s in all, well inside the
# pool's grace period (3 s) and hp-run's (5 s) for the peers of a rank that failed.
_REPORT_WAIT = (0.1,) * 20


def _line(rank: int, posted: Fingerprint | None, width: int) -> str:
    if posted is None:
        return f"  rank {rank}: (nothing posted)"
    return f"  rank {rank}: {posted.shown:<{width}}  at {posted.site}"


def _split(posted: Fingerprint, side: int, index: int) -> int | None:
    """One all_to_all split a rank posted (``side`` 0: input, 1: output); None if it posted none."""
    if posted.splits is None or index >= len(posted.splits[side]):
        return None
    return posted.splits[side][index]


# [Note: waiting without hanging]
# A rank waits for its peers' keys with short store timeouts. Between two
# tries it reads the peers' status keys: a peer that failed (posted by the
# worker) or died (posted by the pool) or already finished the test turns the
# wait into an error naming that rank. After the first timeout it also
# publishes what it waits for (``blocked/<rank>``) and follows the other
# blocked ranks' waits: a cycle that comes back to itself, with every awaited
# key still missing, is a deadlock and is reported on every rank in it.
class SideChannel:
    """The per-test state of the checks on one rank (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        *,
        stream_ordered: bool,
        tags: bool = True,
        batch_joins_group: bool = False,
    ) -> None:
        self.store = dist.PrefixStore(prefix + "/", store)
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.stream_ordered = stream_ordered
        self.tags = tags  # gloo matches messages by tag; NCCL and HCCL ignore tags and match in order
        self.seqs: dict[str, int] = {}
        self.last: dict[str, str] = {}
        self.group_ranks: dict[str, tuple[int, ...]] = {}
        self.channels: dict[tuple[str, int, int], int] = {}
        self.pairs: dict[tuple[str, int, int], _Pair] = {}
        self.sent: dict[tuple[str, int, int, int], str] = {}
        self.matched: dict[tuple[str, int, int, int], Any] = {}
        self._blocked_posted = False
        self._timeout: float | None = None
        # [Note: the current exchange] in hp_testing._p2p_report
        self.exchange: list[Ticket] = []
        self.open: set[int] = set()
        self._blocking = False  # the current wait is inside a blocking send/recv
        # [Note: the first batch on a group] in hp_testing.profiles
        self.batch_joins_group = batch_joins_group
        self.joined: set[str] = set()

    # -- store helpers -----------------------------------------------------------

    def _set_timeout(self, seconds: float) -> None:
        if self._timeout != seconds:
            self.store.set_timeout(datetime.timedelta(seconds=seconds))
            self._timeout = seconds

    def _arrived(self, keys: list[str], seconds: float) -> bool:
        """Whether all ``keys`` exist within about ``seconds`` ([Note: quiet waits]).

        [Note: quiet waits]
        A store read that times out makes torch's C++ client print two
        ``waitForInput ... timed out`` warnings on stderr, and a rank running
        late made every peer print them every poll: noise that buried the
        program's own output (and read like a fault). So a wait asks
        ``check`` (answered at once) and sleeps between asks, from 0.2 ms
        doubling to 20 ms, which keeps a peer that is about to arrive cheap;
        the blocking read comes only once every key is there.
        """
        deadline = time.monotonic() + seconds
        pause = 0.0002
        while not self.store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.02)
        return True

    def _exists(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _get(self, key: str, kind: type[R]) -> R | None:
        return decode(self.store.get(key), self._where(key), kind) if self._exists(key) else None

    def _where(self, key: str) -> str:
        """``key`` as the store holds it, for errors: with this run's prefix."""
        return f"{self.prefix}/{key}"

    def post_status(self, kind: str, text: str, code: int | None = None) -> None:
        """Tell the peers this rank failed (``"failed"``) or ends (``"exited"``) so their waits end now."""
        _put(self.store, status_key(self.rank), Status(kind, text, code))

    def _await(
        self,
        keys: list[str],
        owners: list[int],
        kind: type[R],
        what: str,
        site: str,
        group: str | None = None,
        *,
        at_end: bool = False,
    ) -> list[R]:
        """The ``kind`` records under ``keys`` (owned by ``owners``) once all exist.

        See [Note: waiting without hanging].
        """
        attempt = 0
        try:
            while True:
                poll = _POLLS[min(attempt, len(_POLLS) - 1)]
                self._set_timeout(poll)
                if self._arrived(keys, poll):
                    try:
                        raws = self.store.multi_get(keys)
                    except dist.DistStoreError:
                        pass
                    else:
                        pairs = zip(raws, keys, strict=True)
                        return [decode(raw, self._where(key), kind) for raw, key in pairs]
                attempt += 1
                missing = [(k, o) for k, o in zip(keys, owners, strict=True) if not self._exists(k)]
                self._check_missing(missing, what, site, group)
                if not self._blocked_posted:
                    blocked = Blocked(missing, what, site, self._exchange(), self._blocking)
                    _put(self.store, f"blocked/{self.rank}", blocked)
                    self._blocked_posted = True
                if not at_end:
                    # A rank at the end of the test leaves cycle reports to the ranks still
                    # inside an op: they see its done/ key and name the call it never issued.
                    self._find_cycle(missing, what, site)
        finally:
            if self._blocked_posted:
                _put(self.store, f"blocked/{self.rank}", Blocked())  # no longer waiting
                self._blocked_posted = False

    def _check_missing(self, missing: list[tuple[str, int]], what: str, site: str, group: str | None) -> None:
        p2p = all(_is_p2p(key) for key, _ in missing)
        for _, owner in missing:
            status = self._get(status_key(owner), Status)
            if status is not None and status.kind == "exited":
                raise PeerFailedError(
                    f"rank {owner} exited (code {status.code}) while rank {self.rank} waits for it in {what} "
                    f"at {site}; stopped waiting. {status.text} A rank must issue every collective and "
                    "point-to-point op its peers issue before it ends (NCCL and HCCL would hang here until "
                    "the watchdog timeout): if one rank's data runs out first, agree on the number of steps "
                    "(e.g. all_reduce a 'has data' flag each step) so every rank stops at the same one."
                    + (f"\n{self._exchange_report()}" if p2p else "")
                )
            if status is not None:
                raise PeerFailedError(
                    f"rank {owner} {status.kind} while rank {self.rank} waited for it in {what} at {site}; "
                    f"stopped waiting. Rank {owner}'s error:\n{status.text}"
                )
            done = self._get(f"done/{owner}", Done)
            if done is not None:
                raise PeerFailedError(
                    f"rank {owner} finished the test while rank {self.rank} waited for it in {what} at "
                    f"{site}: rank {owner} never issued the matching call. "
                    + self._last_of(done, group)
                    + (f"\n{self._exchange_report()}" if p2p else "")
                )

    @staticmethod
    def _last_of(done: Done, group: str | None) -> str:
        if group is None:
            return ""
        if group not in done.groups:
            return "It issued no collective on that group."
        count, last = done.groups[group]
        return f"It issued {count} collective(s) on that group; the last was {last}."

    # -- unmatched point to point ---------------------------------------------------------

    def _exchange(self) -> list[Posted]:
        """This rank's current exchange ([Note: the current exchange]), the last 32 ops at most."""
        return [t.posted() for t in self.exchange[-32:]]

    def _exchange_report(self) -> str:
        """Every rank's current exchange; waits up to 2 s for live ranks that have not published one."""
        posted: dict[int, list[Posted] | None] = {self.rank: self._exchange()}
        notes: dict[int, str] = {}
        others = [r for r in range(self.world_size) if r != self.rank]
        for pause in (0.0, *_REPORT_WAIT):
            if pause:
                time.sleep(pause)
            for rank in others:
                if posted.get(rank) is not None or rank in notes:
                    continue
                blocked = self._get(f"blocked/{rank}", Blocked)
                if blocked is not None and blocked.missing:
                    posted[rank] = blocked.posted
                    continue
                done = self._get(f"done/{rank}", Done)
                if done is not None:
                    posted[rank] = done.posted
                    continue
                status = self._get(status_key(rank), Status)
                if status is not None:  # it will publish nothing more
                    code = f" (code {status.code})" if status.code is not None else ""
                    notes[rank] = f"({status.kind}{code} before publishing its exchange)"
            if all(posted.get(r) is not None or r in notes for r in others):
                break
        return exchange_report(self.world_size, posted, self._exists, notes)

    def _raise_unmatched(self, cycle: list[int], lines: list[str], report: str) -> None:
        """Ranks that all wait in ``wait()`` for sends and receives whose other ends were never posted."""
        raise UnmatchedError(
            f"unmatched point-to-point ops: ranks {cycle} each wait in wait() for an op whose other end "
            "was never posted, and none of them will post anything more (NCCL and HCCL would hang "
            "here until the watchdog timeout):\n"
            + "\n".join(lines)
            + report
            + "\nEvery send needs a receive on its peer (same element count and dtype, same order per "
            "pair): check the peer ranks of the ops marked NO COUNTERPART."
        )

    def _find_cycle(self, missing: list[tuple[str, int]], what: str, site: str) -> None:
        """Report a wait cycle through this rank, if every awaited key in it is still missing."""
        states: dict[int, Blocked] = {}
        for rank in range(self.world_size):
            if rank != self.rank:
                state = self._get(f"blocked/{rank}", Blocked)
                if state is not None and state.missing:
                    states[rank] = state
        path: list[int] = [self.rank]
        edges: dict[int, list[tuple[str, int]]] = {self.rank: missing}

        def follow(rank: int) -> list[int] | None:
            for _, owner in edges[rank]:
                if owner == self.rank:
                    return list(path)
                if owner in path or owner not in states:
                    continue
                edges[owner] = states[owner].missing
                path.append(owner)
                found = follow(owner)
                if found is not None:
                    return found
                path.pop()
            return None

        cycle = follow(self.rank)
        if cycle is None:
            return
        for rank in cycle:
            if any(self._exists(key) for key, _ in edges[rank]):
                return  # someone already moved on: not stuck
        lines = [f"  rank {self.rank}: waits in {what} at {site}"]
        for rank in cycle[1:]:
            lines.append(f"  rank {rank}: waits in {states[rank].what} at {states[rank].site}")
        keys = [key for rank in cycle for key, _ in edges[rank]]
        report = ""
        if any(_is_p2p(key) for key in keys):
            report = "\n" + self._exchange_report()
            blocking = self._blocking or any(states[r].blocking for r in cycle[1:])
            if all(_is_p2p(key) for key in keys) and not blocking:
                self._raise_unmatched(cycle, lines, report)
        raise DeadlockError(
            f"deadlock: ranks {cycle} wait on each other in a cycle, so none can proceed "
            "(NCCL and HCCL would hang here until the watchdog timeout):\n"
            + "\n".join(lines)
            + "\nIssue collectives in the same order on every rank; pair each blocking send with a "
            "receive posted first on the other side, or post both in one batch_isend_irecv." + report
        )

    # -- joining a group's communicator -------------------------------------------------

    def join_group(self, call: Call, *, wait: bool) -> None:
        """NCCL's first batch on a group creates its communicator: every member must join it.

        A collective joins without waiting (its own comparison waits for the
        members); the first ``batch_isend_irecv`` waits here until every member
        of the group has joined, as ``ncclCommInitRank`` does
        ([Note: the first batch on a group] in :mod:`hp_testing.profiles`).
        """
        group = call.group_name
        if not self.batch_joins_group or group in self.joined:
            return
        self.joined.add(group)
        _put(self.store, f"join/{group}/{self.rank}", Fingerprint(plain(call.key), call.shown, call.site))
        others = [r for r in call.group_ranks if r != self.rank]
        if not wait or not others:
            return
        what = (
            f"{call.shown}: the first batch_isend_irecv on group {list(call.group_ranks)}, where NCCL "
            "creates the group's communicator and waits until every rank of the group joins it (with a "
            "batch_isend_irecv or a collective on the group)"
        )
        self._await([f"join/{group}/{r}" for r in others], others, Fingerprint, what, call.site, group)

    # -- collectives -------------------------------------------------------------

    def collective(self, call: Call, *, defer: bool = False) -> Callable[[], None] | None:
        """Compare ``call`` with every other member's call at the same position.

        Blocks, unless ``defer``: then the call is posted at once (its
        position fixed) and the returned function makes the comparison, for
        ``wait()`` of an async operation ([Note: deferred async checks] in
        :mod:`hp_testing.emulation`).
        """
        group = call.group_name
        if self.batch_joins_group and group not in self.joined:
            self.join_group(call, wait=False)
        seq = self.seqs.get(group, 0)
        self.seqs[group] = seq + 1
        self.group_ranks[group] = call.group_ranks
        self.last[group] = f"{call.shown} at {call.site}"
        payload = Fingerprint(plain(call.key), call.shown, call.site, call.splits)
        _put(self.store, f"c/{group}/{seq}/{self.rank}", payload)
        others = [r for r in call.group_ranks if r != self.rank]
        if not others:
            return None
        if defer:
            # Whichever of two disagreeing ranks posts second sees the other now, before gloo does.
            posted = [r for r in others if self._exists(f"c/{group}/{seq}/{r}")]
            if posted:
                self._compare(call, group, seq, payload, posted)
            return lambda: self._compare(call, group, seq, payload, others)
        self._compare(call, group, seq, payload, others)
        return None

    def _compare(self, call: Call, group: str, seq: int, payload: Fingerprint, others: list[int]) -> None:
        keys = [f"c/{group}/{seq}/{r}" for r in others]
        what = f"{call.shown} (collective #{seq} on group {list(call.group_ranks)})"
        values = self._await(keys, others, Fingerprint, what, call.site, group)
        by_rank = dict(zip(others, values, strict=True))
        by_rank[self.rank] = payload
        if any(v.key != payload.key for v in values):
            width = max(len(v.shown) for v in by_rank.values())
            lines = [_line(r, by_rank.get(r), width) for r in call.group_ranks]
            raise CollectiveMismatchError(
                f"the ranks of group {list(call.group_ranks)} disagree on collective #{seq} of this test "
                "on that group:\n"
                + "\n".join(lines)
                + "\nOn NCCL or HCCL this hangs or corrupts memory. Issue the same collectives (same op, "
                "element counts, dtypes, reduce op and root) in the same order on every rank of the group."
            )
        if call.splits is not None and len(by_rank) == len(call.group_ranks):
            self._check_splits(call, by_rank, seq)

    def _check_splits(self, call: Call, by_rank: dict[int, Fingerprint], seq: int) -> None:
        ranks = call.group_ranks
        problems = []
        for i, src in enumerate(ranks):
            for j, dst in enumerate(ranks):
                sends = _split(by_rank[src], 0, j)
                expects = _split(by_rank[dst], 1, i)
                if sends != expects:
                    problems.append(
                        f"  rank {src} sends {sends} to rank {dst} (input split {j}, at {by_rank[src].site}) "
                        f"but rank {dst} expects {expects} from rank {src} (output split {i}, at "
                        f"{by_rank[dst].site})"
                    )
        if problems:
            raise CollectiveMismatchError(
                f"{call.name} #{seq} on group {list(ranks)}: split sizes disagree between ranks:\n"
                + "\n".join(problems)
                + "\nRank i's input_split_sizes[j] must equal rank j's output_split_sizes[i]; exchange "
                "the sizes first (e.g. an all_to_all_single of the counts)."
            )

    # -- point to point ------------------------------------------------------------

    def p2p_issue(self, call: Call, *, batch: object | None = None, dropped: bool = False) -> Ticket:
        """Post one send or receive; returns the ticket :meth:`p2p_wait` settles."""
        send = "send" in call.name
        peer = call.peer
        assert peer is not None
        src, dst = (self.rank, peer) if send else (peer, self.rank)
        group = call.group_name if not (self.tags and call.tag) else f"{call.group_name}#tag{call.tag}"
        channel = (group, src, dst)
        seq = self.channels.get(channel, 0)
        self.channels[channel] = seq + 1
        pair_key = (group, min(src, dst), max(src, dst))
        pair = self.pairs.setdefault(pair_key, _Pair())
        if batch is None:
            pos = pair.pos
            pair.pos += 1
            pair.batch_pos = None
        else:
            if pair.batch_pos is None or pair.batch is not batch:
                pair.batch_pos = pair.pos
                pair.pos += 1
                pair.batch = batch
            pos = pair.batch_pos
        payload = P2PEnd(plain(call.key), call.shown, call.site, pos, dropped, call.tag)
        letter = "s" if send else "r"
        _put(self.store, f"{letter}/{group}/{src}/{dst}/{seq}", payload)
        if send:
            self.sent[(group, src, dst, seq)] = f"{call.shown} at {call.site}"
        ticket = Ticket(call, send, group, src, dst, seq, pos)
        if not self.open:
            self.exchange = []  # all earlier ops matched: a new exchange starts
        self.exchange.append(ticket)
        self.open.add(id(ticket))
        return ticket

    def _other_key(self, ticket: Ticket) -> str:
        other = "r" if ticket.send else "s"
        return f"{other}/{ticket.group}/{ticket.src}/{ticket.dst}/{ticket.seq}"

    def posted(self, ticket: Ticket) -> bool:
        """Whether the other end of ``ticket`` is already posted (no waiting)."""
        return self._exists(self._other_key(ticket))

    def p2p_wait(self, ticket: Ticket) -> None:
        """Block until the other end of ``ticket`` is posted; check sizes, drops and NCCL order."""
        if ticket.checked:
            return
        ticket.checked = True
        call = ticket.call
        peer = ticket.dst if ticket.send else ticket.src
        key = self._other_key(ticket)
        side = "receive" if ticket.send else "send"
        what = (
            f"{call.shown} (message #{ticket.seq} from rank {ticket.src} to rank {ticket.dst}, "
            f"waiting for rank {peer}'s matching {side})"
        )
        self._blocking = call.name in ("send", "recv")
        try:
            (theirs,) = self._await([key], [peer], P2PEnd, what, call.site)
        finally:
            self._blocking = False
        self.open.discard(id(ticket))
        their_shown, their_site, their_pos, their_tag = theirs.shown, theirs.site, theirs.pos, theirs.tag
        if theirs.dropped and not ticket.send:
            raise DroppedMessageError(
                f"message #{ticket.seq} from rank {ticket.src} to rank {ticket.dst} ({their_shown} at "
                f"{their_site}) was dropped by fault injection; {call.shown} at {call.site} would wait "
                "forever on a real cluster."
            )
        if theirs.key[1:] != plain(call.key)[1:]:
            raise P2PMismatchError(
                f"message #{ticket.seq} from rank {ticket.src} to rank {ticket.dst}: the two ends disagree:\n"
                f"  rank {self.rank}: {call.shown}  at {call.site}\n"
                f"  rank {peer}: {their_shown}  at {their_site}\n"
                "A send and its receive must have the same element count and dtype (NCCL matches them "
                "in order per pair, ignoring tags)."
            )
        if not self.tags and their_tag != call.tag:
            mine = (self.rank, call.shown, call.tag, call.site)
            raise tags_differ(
                ticket.seq, ticket.src, ticket.dst, mine, (peer, their_shown, their_tag, their_site)
            )
        if self.stream_ordered:
            self._check_order(ticket, their_pos, their_shown, their_site, peer)

    def _check_order(
        self, ticket: Ticket, their_pos: int, their_shown: str, their_site: str, peer: int
    ) -> None:
        pair = self.pairs[(ticket.group, min(ticket.src, ticket.dst), max(ticket.src, ticket.dst))]
        current = (
            ticket.pos,
            their_pos,
            f"{ticket.call.shown} at {ticket.call.site}",
            f"{their_shown} at {their_site}",
        )
        for earlier in pair.matches:
            pos, other_pos = earlier[0], earlier[1]
            if (pos - ticket.pos) * (other_pos - their_pos) < 0:
                first, second = sorted((earlier, current))
                raise opposite_orders(self.rank, peer, (first[2], second[2]), (second[3], first[3]))
        pair.matches.append(current)

    # -- end of test ------------------------------------------------------------------

    def finish(self) -> None:
        """Publish this rank's counts, wait for every rank, and report unmatched messages."""
        groups = {g: (n, self.last.get(g, "")) for g, n in self.seqs.items()}
        mine = Done(groups, dict(self.channels), self._exchange())
        _put(self.store, f"done/{self.rank}", mine)
        others = [r for r in range(self.world_size) if r != self.rank]
        if not others:
            return
        keys = [f"done/{r}" for r in others]
        try:
            values = self._await(keys, others, Done, "the end of the test", "(test end)", at_end=True)
        except PeerFailedError:
            return  # a peer failed: its own report says why
        done = dict(zip(others, values, strict=True))
        done[self.rank] = mine
        problems = []
        channels = {c for d in done.values() for c in d.channels if self.rank in c[1:]}
        for group, src, dst in sorted(channels):
            sent = done[src].channels.get((group, src, dst), 0)
            received = done[dst].channels.get((group, src, dst), 0)
            if sent > received:
                first = self.sent.get((group, src, dst, received), "") if src == self.rank else ""
                problems.append(unreceived_line(src, dst, sent, received, first and f"#{received} {first}"))
            elif received > sent:
                problems.append(unsent_line(src, dst, sent, received))
        if problems:
            posted: dict[int, list[Posted] | None] = {r: d.posted for r, d in done.items()}
            raise UnmatchedError(
                unmatched_text(problems) + "\n" + exchange_report(self.world_size, posted, self._exists)
            )

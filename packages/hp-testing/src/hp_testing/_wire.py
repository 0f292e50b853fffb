"""What the cross-rank checks write to the TCPStore, as JSON checked field by field on the way back.

The store accepts writes from anyone who reaches its port, so nothing read
from it is ever executed ([Note: nothing read from the store is executed]).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "Blocked",
    "Done",
    "Fingerprint",
    "ForeignValueError",
    "P2PEnd",
    "Posted",
    "Status",
    "decode",
    "encode",
    "plain",
    "status_key",
]

_SHOWN_BYTES = 80  # how much of a foreign value an error quotes


class ForeignValueError(RuntimeError):
    """A store key the checks read holds something the harness did not write; nothing of it was run."""


class _Invalid(ValueError):
    """One field of a record has the wrong type (turned into a ForeignValueError with the key)."""


def status_key(rank: int) -> str:
    """The key under which ``rank`` posts that it failed (its worker) or died (the pool)."""
    return f"status/{rank}"


def plain(value: Any) -> Any:
    """``value`` with every tuple (``torch.Size`` included) as a list: what JSON gives back for it.

    Both sides of a comparison pass through here, so a key read from the
    store and a key computed locally compare equal exactly when the calls do.
    """
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    raise TypeError(f"the checks can only post JSON scalars and sequences of them, got {value!r}")


# -- field checks -------------------------------------------------------------------------


def _str(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise _Invalid(f"field {name!r} is {value!r}, not a string")
    return value


def _int(obj: dict[str, Any], name: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Invalid(f"field {name!r} is {value!r}, not an integer")
    return value


def _bool(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name)
    if not isinstance(value, bool):
        raise _Invalid(f"field {name!r} is {value!r}, not true or false")
    return value


def _list(obj: dict[str, Any], name: str) -> list[Any]:
    value = obj.get(name)
    if not isinstance(value, list):
        raise _Invalid(f"field {name!r} is {value!r}, not a list")
    return value


def _ints(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _Invalid(f"field {name!r} holds {value!r}, not a list of integers")
    return value


def _key(obj: dict[str, Any]) -> list[Any]:
    """A call's key: a non-empty list of JSON scalars and lists of them (see :func:`plain`)."""
    value = _list(obj, "key")

    def ok(v: Any, depth: int) -> bool:
        if isinstance(v, list):
            return depth < 3 and all(ok(x, depth + 1) for x in v)
        return v is None or isinstance(v, (str, int, float))

    if not value or not isinstance(value[0], str) or not ok(value, 0):
        raise _Invalid(f"field 'key' is {value!r}, not a call key (an op name, then scalars)")
    return value


# -- records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """One rank's collective at one position of a group: ``c/<group>/<seq>/<rank>``."""

    key: list[Any]
    shown: str
    site: str
    splits: tuple[list[int], list[int]] | None = None  # all_to_all: (input splits, output splits)

    def to_json(self) -> dict[str, Any]:
        splits = None if self.splits is None else [list(self.splits[0]), list(self.splits[1])]
        return {"key": self.key, "shown": self.shown, "site": self.site, "splits": splits}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Fingerprint:
        raw = obj.get("splits")
        splits = None
        if raw is not None:
            if not isinstance(raw, list) or len(raw) != 2:
                raise _Invalid(f"field 'splits' is {raw!r}, not [input splits, output splits]")
            splits = (_ints(raw[0], "splits"), _ints(raw[1], "splits"))
        return cls(_key(obj), _str(obj, "shown"), _str(obj, "site"), splits)


@dataclass(frozen=True)
class P2PEnd:
    """One end of a point-to-point message: ``s/...`` (send) or ``r/...`` (receive)."""

    key: list[Any]
    shown: str
    site: str
    pos: int  # position in the pair's issue order (a batch shares one)
    dropped: bool  # the send was dropped by fault injection
    tag: int

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "shown": self.shown,
            "site": self.site,
            "pos": self.pos,
            "dropped": self.dropped,
            "tag": self.tag,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> P2PEnd:
        return cls(
            _key(obj),
            _str(obj, "shown"),
            _str(obj, "site"),
            _int(obj, "pos"),
            _bool(obj, "dropped"),
            _int(obj, "tag"),
        )


_STATUS_KINDS = ("failed", "died", "exited")


@dataclass(frozen=True)
class Status:
    """A rank that failed (posted by its worker), or whose process ended (posted by the pool or hp-run).

    ``exited`` carries the exit ``code`` (0 included): a rank that returns
    early, e.g. because its data loader ran out, leaves its peers waiting
    just as a crashed one does, and the peers' error must say which it was.
    """

    kind: str  # "failed", "died" or "exited"
    text: str  # the rank's traceback, or how the process ended
    code: int | None = None  # the exit code, for "exited"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text, "code": self.code}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Status:
        kind = _str(obj, "kind")
        if kind not in _STATUS_KINDS:
            raise _Invalid(f"field 'kind' is {kind!r}, not one of {list(_STATUS_KINDS)}")
        code = obj.get("code")
        if code is not None and (not isinstance(code, int) or isinstance(code, bool)):
            raise _Invalid(f"field 'code' is {code!r}, not an integer or null")
        return cls(kind, _str(obj, "text"), code)


@dataclass(frozen=True)
class Posted:
    """One send or receive a rank posted, as the unmatched-p2p report lists it (no tensor, no key)."""

    send: bool
    group: str
    src: int
    dst: int
    seq: int  # message number on the (group, src, dst) channel
    shown: str  # "isend(2 torch.float32 to rank 1)": peer, size and dtype
    site: str

    def to_row(self) -> list[Any]:
        return [self.send, self.group, self.src, self.dst, self.seq, self.shown, self.site]

    @classmethod
    def from_row(cls, row: Any) -> Posted:
        if not (isinstance(row, list) and len(row) == 7):
            fields = "[send, group, src, dst, seq, shown, site]"
            raise _Invalid(f"a row of field 'posted' is {row!r}, not {fields}")
        names = ("send", "group", "src", "dst", "seq", "shown", "site")
        entry = dict(zip(names, row, strict=True))
        return cls(
            _bool(entry, "send"),
            _str(entry, "group"),
            _int(entry, "src"),
            _int(entry, "dst"),
            _int(entry, "seq"),
            _str(entry, "shown"),
            _str(entry, "site"),
        )


def _posted(obj: dict[str, Any]) -> list[Posted]:
    """Field ``posted`` (absent: none)."""
    if "posted" not in obj:
        return []
    return [Posted.from_row(row) for row in _list(obj, "posted")]


@dataclass(frozen=True)
class Done:
    """A rank that finished its test (``done/<rank>``): its collectives per group, messages per channel."""

    groups: dict[str, tuple[int, str]] = field(default_factory=dict)
    channels: dict[tuple[str, int, int], int] = field(default_factory=dict)  # (group, src, dst) -> messages
    posted: list[Posted] = field(default_factory=list)  # its last point-to-point exchange

    def to_json(self) -> dict[str, Any]:
        return {
            "groups": [[g, n, last] for g, (n, last) in self.groups.items()],
            "channels": [[g, src, dst, n] for (g, src, dst), n in self.channels.items()],
            "posted": [p.to_row() for p in self.posted],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Done:
        groups: dict[str, tuple[int, str]] = {}
        for row in _list(obj, "groups"):
            if not (isinstance(row, list) and len(row) == 3):
                raise _Invalid(f"a row of field 'groups' is {row!r}, not [group, count, last call]")
            entry = {"group": row[0], "count": row[1], "last": row[2]}
            groups[_str(entry, "group")] = (_int(entry, "count"), _str(entry, "last"))
        channels: dict[tuple[str, int, int], int] = {}
        for row in _list(obj, "channels"):
            if not (isinstance(row, list) and len(row) == 4):
                raise _Invalid(f"a row of field 'channels' is {row!r}, not [group, src, dst, count]")
            entry = {"group": row[0], "src": row[1], "dst": row[2], "count": row[3]}
            channel = (_str(entry, "group"), _int(entry, "src"), _int(entry, "dst"))
            channels[channel] = _int(entry, "count")
        return cls(groups, channels, _posted(obj))


@dataclass(frozen=True)
class Blocked:
    """What a waiting rank waits for (``blocked/<rank>``); no ``missing`` keys: not waiting."""

    missing: list[tuple[str, int]] = field(default_factory=list)  # (key, owning rank)
    what: str = ""
    site: str = ""
    posted: list[Posted] = field(default_factory=list)  # its current point-to-point exchange
    blocking: bool = False  # inside a blocking op (it may post more once that returns), not a wait()

    def to_json(self) -> dict[str, Any]:
        return {
            "missing": [[k, owner] for k, owner in self.missing],
            "what": self.what,
            "site": self.site,
            "posted": [p.to_row() for p in self.posted],
            "blocking": self.blocking,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Blocked:
        missing = []
        for row in _list(obj, "missing"):
            if not (isinstance(row, list) and len(row) == 2):
                raise _Invalid(f"a row of field 'missing' is {row!r}, not [key, rank]")
            entry = {"key": row[0], "rank": row[1]}
            missing.append((_str(entry, "key"), _int(entry, "rank")))
        blocking = _bool(obj, "blocking") if "blocking" in obj else False
        return cls(missing, _str(obj, "what"), _str(obj, "site"), _posted(obj), blocking)


Record = Fingerprint | P2PEnd | Status | Done | Blocked
R = TypeVar("R", Fingerprint, P2PEnd, Status, Done, Blocked)

_TAGS: dict[type[Any], str] = {
    Fingerprint: "fingerprint",
    P2PEnd: "p2p",
    Status: "status",
    Done: "done",
    Blocked: "blocked",
}


# [Note: nothing read from the store is executed]
# The checks talk through a ``torch.distributed.TCPStore``, whose server listens
# on every interface of the machine that hosts it (torch binds it that way; the
# harness does not change it), without authentication. Anyone who can reach the
# port while a run lasts can write any key. Had the values been pickles, as they
# once were, writing one would have run that person's code in every rank that
# read it. So every value is one of the records below, encoded as a JSON object
# of plain types, and decoding checks each field's type: a value that is not
# such a record raises :class:`ForeignValueError` naming the key and the first
# bytes it found, which fails the test on that rank like any other error (its
# peers are told through its status key and stop waiting), and nothing of the
# value is run.
#
# Only the ranks of one run write these keys; the structures of the checks
# (tuples, dicts keyed by tuples) are converted here to lists and objects and
# back, explicitly, so nothing depends on what a generic encoder guesses.
def encode(record: Record) -> bytes:
    """The bytes stored for ``record``: a JSON object tagged with the record's kind."""
    return json.dumps({"hp": _TAGS[type(record)], **record.to_json()}, separators=(",", ":")).encode()


def decode(raw: bytes, key: str, kind: type[R]) -> R:
    """The ``kind`` record stored under ``key``; :class:`ForeignValueError` for anything else.

    Only ``json.loads`` and the field checks ever see ``raw``: nothing in it is
    imported, called or unpickled ([Note: nothing read from the store is executed]).
    """
    tag = _TAGS[kind]
    try:
        obj = json.loads(raw)  # bytes: UTF-8 is checked first (UnicodeDecodeError is a ValueError)
        if not isinstance(obj, dict):
            raise _Invalid(f"it is a JSON {type(obj).__name__}, not an object")
        if obj.get("hp") != tag:
            raise _Invalid(f"its 'hp' tag is {obj.get('hp')!r}, not {tag!r}")
        from_json: Callable[[dict[str, Any]], R] = kind.from_json
        return from_json(obj)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and _Invalid are ValueErrors
        shown = bytes(raw[:_SHOWN_BYTES])
        more = f" ... ({len(raw)} bytes)" if len(raw) > _SHOWN_BYTES else ""
        raise ForeignValueError(
            f"the store value under {key!r} is not a {tag} record of hp-testing's checks "
            f"({exc.__class__.__name__}: {exc}); it starts {shown!r}{more}. Something other than "
            "this run's ranks wrote to the run's TCPStore, which listens on every interface: nothing "
            "of the value was run or unpickled. Find what else connects to the store's port (and "
            "firewall it from other hosts), then run again."
        ) from None

"""Record the collectives a block of code issues through hp_core: which, on which group, how many bytes.

Tests count communication at hp_core's collectives, the same protocol on every
backend, with a recorder that needs no harness ([Note: collective records]);
``nbytes`` is the payload as the algorithms count it ([Note: payload bytes]).
Point-to-point transfers are recorded beside them, apart from the collectives'
totals ([Note: p2p records]).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "P2P_RECORDED",
    "RECORDED",
    "CollectiveLog",
    "CollectiveRecord",
    "P2PRecord",
    "record_collectives",
]

#: The hp_core collectives that are recorded, with the argument whose size is the payload.
RECORDED: dict[str, str] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
}

#: The hp_core point-to-point functions that are recorded (see [Note: p2p records]).
P2P_RECORDED: tuple[str, ...] = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_P2P_NAMES = ("send", "recv", "isend", "irecv")


# [Note: payload bytes]
# ``nbytes`` is the payload ``P`` of the collective as the algorithms count it:
# the tensor of an all-reduce or a broadcast, the *output* of an all-gather
# (all ranks' pieces), the *input* of a reduce-scatter and of an all-to-all.
# A ring moves ``(W-1)/W * P`` per rank for the all-gather and the
# reduce-scatter and twice that for the all-reduce, which tests compare with.
@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank issued through hp_core ([Note: collective records])."""

    name: str
    group_ranks: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype
    async_op: bool


@dataclass(frozen=True)
class P2PRecord:
    """One point-to-point transfer this rank posted through hp_core ([Note: p2p records]).

    ``name`` is ``"send"``, ``"recv"``, ``"isend"`` or ``"irecv"`` (a batch's
    items are ``"isend"`` / ``"irecv"``); ``peer`` the other side's global rank;
    ``batch`` numbers the ``batch_isend_irecv`` call the item was posted in
    (0, 1, ... within the log), ``None`` outside a batch.
    """

    name: str
    peer: int
    group_ranks: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype
    batch: int | None = None


class CollectiveLog:
    """The records of one :func:`record_collectives` block, in issue order, with counting helpers.

    Indexing, iteration, ``len``, :meth:`count`, :meth:`counts` and
    :meth:`nbytes` cover the collectives only; point-to-point transfers are
    read with :meth:`p2p`, :meth:`p2p_count` and :meth:`p2p_nbytes`
    ([Note: p2p records]).
    """

    def __init__(self) -> None:
        self._records: list[CollectiveRecord] = []
        self._p2p: list[P2PRecord] = []
        self._batches = 0

    def __getitem__(self, index: int) -> CollectiveRecord:
        return self._records[index]

    def __iter__(self) -> Iterator[CollectiveRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"CollectiveLog({self._records!r})"

    def append(self, record: CollectiveRecord) -> None:
        self._records.append(record)

    def append_p2p(self, records: Sequence[P2PRecord], batched: bool) -> None:
        """Add one call's transfers (a batch's items get this log's next batch number)."""
        if batched:
            records = [replace(r, batch=self._batches) for r in records]
            self._batches += 1
        self._p2p.extend(records)

    def clear(self) -> None:
        """Forget what was recorded so far (to count phases of one block apart)."""
        self._records.clear()
        self._p2p.clear()
        self._batches = 0

    def of(
        self, name: str | None = None, *, group_ranks: Sequence[int] | None = None
    ) -> list[CollectiveRecord]:
        """The records of collective ``name`` (any when ``None``), on the group ``group_ranks`` if given."""
        if name is not None and name not in RECORDED:
            raise ValueError(f"{name!r} is not a recorded collective; pick one of {sorted(RECORDED)}")
        ranks = None if group_ranks is None else tuple(group_ranks)
        return [
            r
            for r in self._records
            if (name is None or r.name == name) and (ranks is None or r.group_ranks == ranks)
        ]

    def count(self, name: str | None = None, *, group_ranks: Sequence[int] | None = None) -> int:
        """How many collectives ``name`` (any when ``None``) were issued, on ``group_ranks`` if given."""
        return len(self.of(name, group_ranks=group_ranks))

    def counts(self) -> Counter[str]:
        """Calls per collective name."""
        return Counter(r.name for r in self._records)

    def nbytes(self, name: str | None = None, *, group_ranks: Sequence[int] | None = None) -> int:
        """The payload bytes of the matching records, summed."""
        return sum(r.nbytes for r in self.of(name, group_ranks=group_ranks))

    def p2p(self, name: str | None = None, *, peer: int | None = None) -> list[P2PRecord]:
        """The point-to-point records named ``name`` (any when ``None``), with ``peer`` if given.

        ``name`` is ``"send"``, ``"recv"``, ``"isend"`` or ``"irecv"``; the
        directions ``"sent"`` (send and isend) and ``"received"`` (recv and
        irecv) match both forms.
        """
        directions = {"sent": ("send", "isend"), "received": ("recv", "irecv")}
        if name is not None and name not in _P2P_NAMES and name not in directions:
            raise ValueError(
                f"{name!r} is not a recorded point-to-point name; pick one of "
                f"{sorted(_P2P_NAMES) + sorted(directions)}"
            )
        names = directions.get(name, (name,)) if name is not None else _P2P_NAMES
        return [r for r in self._p2p if r.name in names and (peer is None or r.peer == peer)]

    def p2p_count(self, name: str | None = None, *, peer: int | None = None) -> int:
        """How many point-to-point transfers match (see :meth:`p2p`)."""
        return len(self.p2p(name, peer=peer))

    def p2p_nbytes(self, name: str | None = None, *, peer: int | None = None) -> int:
        """The bytes of the matching point-to-point transfers, summed."""
        return sum(r.nbytes for r in self.p2p(name, peer=peer))

    def p2p_batches(self) -> int:
        """How many ``batch_isend_irecv`` calls were recorded (rounds of a neighbour exchange)."""
        return self._batches


_ACTIVE: list[CollectiveLog] = []


def _group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of the group an hp_core collective ran on (``None``: the world)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    if not isinstance(group, dist.ProcessGroup) and hasattr(group, "get_group"):
        group = group.get_group()  # a 1-D DeviceMesh, as hp_core accepts
    return tuple(dist.get_process_group_ranks(group))


def _recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    payload = RECORDED[name]

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        tensor = bound.arguments[payload]
        record = CollectiveRecord(
            name=name,
            group_ranks=_group_ranks(bound.arguments.get("group")),
            nbytes=tensor.numel() * tensor.element_size(),
            dtype=tensor.dtype,
            async_op=bool(bound.arguments.get("async_op", False)),
        )
        for log in _ACTIVE:
            log.append(record)
        return result

    recorded.__wrapped__ = original  # type: ignore[attr-defined]
    recorded.__doc__ = original.__doc__
    return recorded


def _p2p_name(op: Any) -> str:
    """A batch item's direction as hp_core spells it: ``"isend"`` or ``"irecv"``."""
    if isinstance(op, str):
        return "isend" if op in ("isend", "send") else "irecv"
    return "isend" if getattr(op, "__name__", "") == "isend" else "irecv"


def _p2p_record(name: str, tensor: torch.Tensor, peer: int, group: Any) -> P2PRecord:
    return P2PRecord(
        name=name,
        peer=int(peer),
        group_ranks=_group_ranks(group),
        nbytes=tensor.numel() * tensor.element_size(),
        dtype=tensor.dtype,
    )


#: How deep this rank is inside recorded p2p calls: hp_core's send calls its isend, recorded once.
_P2P_DEPTH: list[int] = [0]


class _RecordedP2P:
    """A recording stand-in for one hp_core p2p function, equal (and hashing alike) to the original.

    hp_core's ``P2POp`` accepts its own ``isend`` / ``irecv`` functions as the
    op and looks them up in a table; a caller that reads ``hp_core.isend``
    while a block records gets this object, which must still be found there.
    """

    def __init__(self, name: str, original: Callable[..., Any]) -> None:
        self.name = name
        self.original = original
        self.signature = inspect.signature(original)
        self.__wrapped__ = original
        self.__doc__ = original.__doc__
        self.__name__ = original.__name__

    def __hash__(self) -> int:
        return hash(self.original)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _P2P_DEPTH[0] += 1
        try:
            result = self.original(*args, **kwargs)
        finally:
            _P2P_DEPTH[0] -= 1
        if _P2P_DEPTH[0] or not _ACTIVE:
            return result
        bound = self.signature.bind(*args, **kwargs)
        if self.name == "batch_isend_irecv":
            items = list(bound.arguments["p2p_op_list"])
            records = [_p2p_record(_p2p_name(i.op), i.tensor, i.peer, i.group) for i in items]
        else:
            peer = bound.arguments["dst" if self.name in ("send", "isend") else "src"]
            records = [_p2p_record(self.name, bound.arguments["tensor"], peer, bound.arguments.get("group"))]
        for log in _ACTIVE:
            log.append_p2p(records, batched=self.name == "batch_isend_irecv")
        return result


class _Installed:
    """The wrapped functions and how many ranks record through them.

    One object shared by the whole process, while ``_ACTIVE`` is each rank's
    own in local mode (hp_testing.collectives is one of the modules whose
    globals every local rank owns, see :mod:`hp_testing._local_state`): the
    wrappers go in when the first rank starts recording and come out when the
    last one stops, so one rank leaving its block does not cut off another.
    A process of the pool is a single rank, and the count is then 0 or 1.
    """

    def __init__(self) -> None:
        self.ranks = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def acquire(self) -> None:
        import hp_core
        import hp_core.collectives as hc

        self.ranks += 1
        if self.ranks > 1:
            return
        import hp_core.p2p as hp2p

        wrappers: list[tuple[Any, str, Any, Any]] = []
        for name in RECORDED:
            original = getattr(hc, name)
            wrappers.append((hc, name, original, _recording(name, original)))
        for name in P2P_RECORDED:
            original = getattr(hp2p, name)
            wrappers.append((hp2p, name, original, _RecordedP2P(name, original)))
        for home, name, original, wrapper in wrappers:
            for module in (home, hp_core):
                if getattr(module, name, None) is original:
                    self.saved.append((module, name, original))
                    setattr(module, name, wrapper)

    def release(self) -> None:
        self.ranks -= 1
        if self.ranks > 0:
            return
        for module, name, original in self.saved:
            setattr(module, name, original)
        self.saved.clear()


_INSTALLED = _Installed()


# [Note: collective records]
# Tests of parallel features check communication by counting: FSDP's N+1
# all-gathers for N wrapped blocks, one reduce-scatter per bucket, the
# all-reduce of a pipeline's tower gradients once per step. They count at
# hp_core's collectives, not at ``torch.distributed``: that is the protocol the
# library chose, the same on every backend, while what reaches torch differs by
# backend (gloo has no fused reduce-scatter, so hp_core all-reduces there).
#
# [Note: p2p records]
# hp_core's point-to-point functions (``send``, ``recv``, ``isend``, ``irecv``,
# ``batch_isend_irecv``) are swapped the same way and recorded as
# :class:`P2PRecord` (direction, peer, bytes), one per transfer; the items of
# one ``batch_isend_irecv`` share a batch number, so a test counts rounds of a
# neighbour exchange with :meth:`CollectiveLog.p2p_batches`. A call made inside
# another recorded one (hp_core's ``send`` posts its ``isend``) is recorded
# once, as the outer call. They are kept apart from the collectives: ``len``,
# iteration, ``count()`` and ``nbytes()`` with no name read collectives only,
# as tests across the repository rely on (``len(log) == 0`` as "no collective",
# ``counts() == {...}`` of a pipeline step that also sends activations).
# ``send_object`` / ``recv_object`` are not recorded.
#
# :func:`record_collectives` swaps each tensor collective of ``hp_core`` (the
# names in :data:`RECORDED`) for a wrapper while the block runs, on the module
# ``hp_core.collectives`` and on the ``hp_core`` package itself, since callers
# reach them both ways (``hc.all_reduce(...)`` and ``from hp_core import
# all_reduce`` inside a function). Every call that returns normally appends a
# :class:`CollectiveRecord` to the log of this process; a call that raises
# (bad input) is not recorded, since nothing was issued. Recorders nest: an
# inner block's calls appear in the outer log too. Nothing here needs the
# hp-testing harness, so the recorder works under plain ``torchrun``.
@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveLog]:
    """Record, on this rank, every hp_core collective issued inside the block.

    ``with record_collectives() as log: ...`` then ``log.count("all_gather_into_tensor")``,
    ``log.nbytes("reduce_scatter_tensor")``, ``log.of("all_reduce", group_ranks=[0, 1])``
    or the records themselves ([Note: collective records]); point-to-point
    transfers with ``log.p2p_count("isend", peer=1)``, ``log.p2p_nbytes("received")``
    ([Note: p2p records]). The outermost block
    installs the wrappers and removes them on exit, exceptions included.
    """
    log = CollectiveLog()
    if not _ACTIVE:
        _INSTALLED.acquire()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)
        if not _ACTIVE:
            _INSTALLED.release()

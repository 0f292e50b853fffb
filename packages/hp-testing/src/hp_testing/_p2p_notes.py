"""What the program asked of each point-to-point op, for a backend that checks both ends itself.

NCCL ignores tags and orders a pair's ops, so the checks of those rules need
the tag, the batch and the user's line of every send and receive. The layer
drops the tag before the backend sees the op; in local mode the in-memory
backend sees both ends at once and checks there, so the layer's wrappers
leave it a note per op: [Note: p2p notes for the local backend].
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hp_testing._calls import Call, call_site, describe_p2p, global_peer

__all__ = ["Note", "enable", "issuing", "take"]


@dataclass(frozen=True)
class Note:
    """One op as the program issued it: described as the layer describes it, with its batch."""

    call: Call  # shown, site, the user's tag, the global peer
    batch: object | None = None  # shared by the ops of one batch_isend_irecv
    first: bool = False  # the batch's first op: NCCL creates the group's communicator there


class _Queue(threading.local):
    def __init__(self) -> None:
        self.notes: deque[Note] = deque()


# [Note: p2p notes for the local backend]
# The wrappers of ``send``/``recv``/``isend``/``irecv`` and ``batch_isend_irecv``
# describe each op before the layer's route runs (only while :func:`enable` is
# on, which local mode does for its run) and queue the notes on the calling
# thread; the route checks the rules, maps the tag to 0 under NCCL/HCCL and
# hands the ops to the backend in the same order, and the backend takes one
# note per op it receives. A rank is one thread and runs alone, so the queue
# holds exactly the ops of the call in flight; it is emptied when the call
# returns or raises, so a note never outlives its call.
_QUEUE = _Queue()
_enabled = False


def enable(on: bool) -> bool:
    """Turn the notes on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, on
    return previous


def _single(name: str, args: dict[str, Any]) -> list[Note]:
    call = describe_p2p(
        name, args["tensor"], global_peer(args, "send" in name), args.get("group"), args.get("tag", 0)
    )
    call.site = call_site(3)
    return [Note(call)]


def _batch(ops: list[Any], isend: Any) -> list[Note]:
    token = object()
    notes = []
    for index, op in enumerate(ops):
        send = getattr(op.op, "__hp_original__", op.op) in (isend, dist.isend)
        call = describe_p2p("isend" if send else "irecv", op.tensor, op.peer, op.group, op.tag)
        call.site = call_site(3)
        notes.append(Note(call, token, index == 0))
    return notes


@contextmanager
def issuing(name: str, payload: Any, isend: Any = None) -> Iterator[None]:
    """Queue the notes of one p2p call (``payload``: its bound arguments, or a batch's op list)."""
    if not _enabled:
        yield
        return
    _QUEUE.notes = deque(_batch(payload, isend) if name == "batch_isend_irecv" else _single(name, payload))
    try:
        yield
    finally:
        _QUEUE.notes = deque()


def take() -> Note | None:
    """The note of the next op the calling rank hands the backend (None: issued without the layer)."""
    queue = _QUEUE.notes
    return queue.popleft() if queue else None

"""Point-to-point transfers: tensors and picklable objects between two ranks.

Peers are global ranks, as in torch.distributed; a ``group`` only scopes the
communicator. The checks that matter most here are local ones that torch
reports late or not at all: sending to oneself deadlocks, a peer outside the
group hangs, and a non-contiguous tensor is silently corrupted by gloo.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_core import _issue
from hp_core._checks import check_group_rank, check_tag, check_tensor, resolve_group, short_repr
from hp_core.work import Work

__all__ = [
    "P2POp",
    "batch_isend_irecv",
    "irecv",
    "isend",
    "recv",
    "recv_object",
    "send",
    "send_object",
]


def _check_peer(fn: str, name: str, peer: int, pg: dist.ProcessGroup) -> None:
    check_group_rank(fn, name, peer, pg)
    me = dist.get_rank()
    if peer == me:
        raise ValueError(
            f"{fn}(): {name}={peer} is this rank itself; a rank cannot exchange messages with itself "
            "(it would wait forever). Copy the tensor locally instead."
        )


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` and return once it may be reused."""
    isend(tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src``; returns ``tensor``."""
    return irecv(tensor, src, group, tag).wait()


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Work[torch.Tensor]:
    """Start sending ``tensor`` to global rank ``dst``; do not modify it before ``wait()``."""
    fn = "isend"
    _issue.refuse_when_tracing(fn)
    check_tensor(fn, "tensor", tensor)
    check_tag(fn, tag)
    pg = resolve_group(fn, group)
    _check_peer(fn, "dst", dst, pg)
    return Work([dist.isend(tensor, dst, group=pg, tag=tag)], None, tensor)


def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Work[torch.Tensor]:
    """Start receiving into ``tensor`` from global rank ``src``; read it after ``wait()``."""
    fn = "irecv"
    _issue.refuse_when_tracing(fn)
    check_tensor(fn, "tensor", tensor)
    check_tag(fn, tag)
    pg = resolve_group(fn, group)
    _check_peer(fn, "src", src, pg)
    return Work([dist.irecv(tensor, src, group=pg, tag=tag)], None, tensor)


_OPS: dict[Any, Callable[..., Any]] = {
    "isend": dist.isend,
    "irecv": dist.irecv,
    "send": dist.isend,
    "recv": dist.irecv,
    isend: dist.isend,
    irecv: dist.irecv,
    dist.isend: dist.isend,
    dist.irecv: dist.irecv,
}


@dataclass(frozen=True)
class P2POp:
    """One transfer of a batch: ``op`` is ``"isend"``/``"irecv"`` (or the isend/irecv functions)."""

    op: str | Callable[..., Any]
    tensor: torch.Tensor
    peer: int
    group: Any = None
    tag: int = 0

    def __post_init__(self) -> None:
        # Checked where the op is written, not later inside batch_isend_irecv, so the traceback
        # points at the bad P2POp(...) (the batch checks again: a dataclass can be bypassed).
        try:
            known = _OPS.get(self.op) is not None
        except TypeError:  # an unhashable op
            known = False
        if not known:
            raise ValueError(
                f"P2POp: op={short_repr(self.op)} is not a transfer; use 'isend' or 'irecv' "
                "(or the hp_core / torch.distributed isend and irecv functions)."
            )
        if not isinstance(self.peer, int) or isinstance(self.peer, bool):
            raise TypeError(f"P2POp: peer must be an int (a global rank), got {short_repr(self.peer)}.")
        check_tag("P2POp", self.tag)


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> Work[list[torch.Tensor]]:
    """Start a batch of sends and receives together; ``wait()`` returns their tensors in order.

    Posting the whole batch before waiting lets ring and pipeline exchanges,
    where every rank both sends and receives, proceed without ordering
    deadlocks. Unlike torch, one :class:`Work` covers the batch.
    """
    fn = "batch_isend_irecv"
    _issue.refuse_when_tracing(fn)
    ops = list(p2p_op_list)
    if not ops:
        raise ValueError(f"{fn}(): the op list is empty; pass at least one P2POp.")
    torch_ops = []
    first_group: dist.ProcessGroup | None = None
    for index, item in enumerate(ops):
        if not isinstance(item, P2POp):
            raise TypeError(f"{fn}(): item {index} is a {type(item).__name__}, not an hp_core P2POp.")
        kind = _OPS.get(item.op)
        if kind is None:
            raise ValueError(f"{fn}(): item {index} has op={item.op!r}; use 'isend' or 'irecv'.")
        check_tensor(fn, f"the tensor of item {index}", item.tensor)
        check_tag(fn, item.tag)
        pg = resolve_group(fn, item.group)
        if first_group is None:
            first_group = pg
        elif pg is not first_group:
            raise ValueError(
                f"{fn}(): item {index} uses group {dist.get_process_group_ranks(pg)} but item 0 uses "
                f"{dist.get_process_group_ranks(first_group)}; a batch must use one group. Split it."
            )
        _check_peer(fn, f"the peer of item {index}", item.peer, pg)
        torch_ops.append(dist.P2POp(kind, item.tensor, item.peer, pg, item.tag))
    handles = dist.batch_isend_irecv(torch_ops)
    return Work(handles, None, [item.tensor for item in ops])


def send_object(obj: Any, dst: int, group: Any = None) -> None:
    """Send a picklable ``obj`` to global rank ``dst`` (e.g. shapes before a tensor transfer)."""
    fn = "send_object"
    pg = resolve_group(fn, group)
    _check_peer(fn, "dst", dst, pg)
    dist.send_object_list([obj], dst=dst, group=pg)


def recv_object(src: int, group: Any = None) -> Any:
    """Receive the object global rank ``src`` sent with :func:`send_object`."""
    fn = "recv_object"
    pg = resolve_group(fn, group)
    _check_peer(fn, "src", src, pg)
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=pg)
    return box[0]

"""The way each kind of call goes through the emulation layer, from the wrapper to gloo and back.

Each wrapped call goes through the steps of [Note: the route of a call].
Every function here runs nested ([Note: one call through the layer] in
:mod:`hp_testing._nesting`): calls it makes into ``torch.distributed`` pass
straight through, and its own tensor work is invisible to the strict read guard.
Point-to-point pairs are checked at issue ([Note: checking both ends at issue]);
async collectives where the backend allows ([Note: deferred async checks]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hp_testing._backend_emulation import AllWork, BatchPart, execute, transfer_view
from hp_testing._calls import Call, call_site, describe, describe_p2p, global_peer, object_p2p
from hp_testing._hazards import AsyncBuffers, CheckedWork, DoneWork
from hp_testing.profiles import check_call

if TYPE_CHECKING:
    from hp_testing._layer import Layer

__all__ = ["check_collective", "run_batch", "run_collective", "run_object_p2p", "run_p2p", "torch_op"]


# [Note: the route of a call]
# 1. describe it (:mod:`hp_testing._calls`) and find the user's call site;
# 2. apply the profile's rules (:mod:`hp_testing.profiles`);
# 3. fire a planned fault, if one is due (:mod:`hp_testing._fault_plan`);
# 4. compare its fingerprint with the other ranks' through the store
#    (:mod:`hp_testing._sidechannel`), or post/await its p2p other end;
# 5. in strict mode, refuse pending buffers, snapshot the inputs and watch
#    the buffers until ``wait()`` (:mod:`hp_testing._strict`);
# 6. run it on gloo, emulating what gloo lacks (:mod:`hp_testing._backend_emulation`).
def check_collective(layer: Layer, call: Call, *, defer: bool = False) -> Callable[[], None] | None:
    """Rules, faults and cross-rank checks of one collective, classic or functional (:mod:`._funcol`).

    Returns the deferred comparison for ``wait()`` when ``defer`` is set
    ([Note: deferred async checks]).
    """
    call.site = call_site(2)
    layer.calls += 1
    check_call(layer.profile, call)
    if layer.strict:
        layer.hazards.check_passed(call)
    layer.fire("collective")
    channel = layer.side_channel()
    if channel is not None:
        return channel.collective(call, defer=defer)
    return None


# [Note: deferred async checks]
# A collective is compared with the other ranks' calls at the same position
# of its group, and a blocking one waits there for all of them. An async one
# (``async_op=True``) does that only where the backend runs a rank's
# operations in one queue (``nccl-emu``, ``hccl-emu``: the op holds the queue
# until every rank has issued it, so waiting at issue finds the same
# deadlocks NCCL would). On gloo every operation progresses on its own, and
# a program may issue an async collective, go on with point-to-point work its
# peers need, and wait later; waiting at issue would report a deadlock that
# gloo never has. There the call is posted at issue (its position is fixed
# then), compared at once with the ranks that already posted (so of two ranks
# that disagree, the second sees it before gloo does, as with p2p above), and
# compared with all of them at ``wait()``, before the real wait.
def run_collective(layer: Layer, name: str, orig: Callable[..., Any], args: dict[str, Any]) -> Any:
    """One classic collective (``all_reduce``, ``all_gather_single``, the object collectives, ...)."""
    call = describe(name, args)
    finish = check_collective(layer, call, defer=call.async_op and not layer.profile.stream_ordered_p2p)
    buffers: AsyncBuffers | None = None
    if layer.strict and call.async_op and call.kind == "collective":
        buffers = layer.hazards.collective_buffers(name, call, dist.get_rank())
    result = execute(layer.profile, name, orig, args, call, _gather_single())
    if not call.async_op or (buffers is None and finish is None):
        return result
    return CheckedWork(
        result,
        [finish] if finish is not None else [],
        [buffers.settle] if buffers is not None else [],
        layer.hazards.watch(buffers, call.shown, call.site) if buffers is not None else None,
    )


def _gather_single() -> Callable[..., Any]:
    from hp_testing.emulation import original

    return original("all_gather_single")


# [Note: checking both ends at issue]
# gloo aborts the whole process when a message of the wrong size arrives, so a
# mismatched send/receive pair must never reach gloo on both sides. Each side
# posts its fingerprint first and then looks for the other's: whichever side
# posts second sees both, compares them, and raises before handing its op to
# gloo. Nothing waits here (waiting would add orderings gloo does not have);
# the rest of the checking happens at ``wait()``.
def run_p2p(layer: Layer, name: str, orig: Callable[..., Any], args: dict[str, Any]) -> Any:
    """One ``send``, ``recv``, ``isend`` or ``irecv``."""
    send = "send" in name
    tensor = args["tensor"]
    peer = global_peer(args, send)
    call = describe_p2p(name, tensor, peer, args.get("group"), args.get("tag", 0))
    call.site = call_site(3)
    layer.calls += 1
    check_call(layer.profile, call)
    if layer.strict:
        layer.hazards.check_passed(call)
    dropped = layer.fire("send") is not None if send else False
    channel = layer.side_channel()
    ticket = channel.p2p_issue(call, dropped=dropped) if channel is not None and peer is not None else None
    if not layer.profile.p2p_tags:
        args["tag"] = 0  # NCCL and HCCL ignore tags and match in order; make gloo do the same
    args["tensor"] = transfer_view(layer.profile, tensor)
    if name in ("send", "recv"):
        if ticket is not None and channel is not None:
            channel.p2p_wait(ticket)  # gloo's send also waits for its receive
        return None if dropped else orig(**args)
    buffers = layer.hazards.p2p_buffers(call, tensor, send=send) if layer.strict else None
    if ticket is not None and channel is not None and channel.posted(ticket):
        channel.p2p_wait(ticket)  # see [Note: checking both ends at issue]
    work: Any = DoneWork() if dropped else orig(**args)
    before: list[Callable[[], None]] = []
    if ticket is not None and channel is not None:
        before.append(functools.partial(channel.p2p_wait, ticket))
    if buffers is None and not before:
        return work
    return CheckedWork(
        work,
        before,
        [buffers.settle] if buffers is not None else [],
        layer.hazards.watch(buffers, call.shown, call.site) if buffers is not None else None,
    )


def torch_op(op: Any, tensor: Any = None, tag: int | None = None) -> Any:
    """``op`` as torch's own ``batch_isend_irecv`` needs it: with torch's isend/irecv, not our wrappers.

    torch's batch tells sends from receives by ``op.op is isend`` (its own
    function); our ``P2POp``s hold the wrappers ([Note: P2POp keeps the wrapper]
    in :mod:`hp_testing.emulation`). ``tensor``/``tag`` replace the op's own.
    """
    fn = getattr(op.op, "__hp_original__", op.op)
    tensor = op.tensor if tensor is None else tensor
    tag = op.tag if tag is None else tag
    if fn is op.op and tensor is op.tensor and tag == op.tag:
        return op
    return dist.P2POp(fn, tensor, op.peer, op.group, tag)


def run_batch(layer: Layer, orig: Callable[..., Any], ops: list[Any], isend: Callable[..., Any]) -> Any:
    """One ``batch_isend_irecv``: its ops progress together (one NCCL group); ``isend`` is torch's own."""
    channel = layer.side_channel()
    token = object()
    tickets = []
    real_ops = []
    buffers = AsyncBuffers("batch_isend_irecv", "") if layer.strict else None
    for index, op in enumerate(ops):
        send = getattr(op.op, "__hp_original__", op.op) in (isend, c10d.isend)
        call = describe_p2p("isend" if send else "irecv", op.tensor, op.peer, op.group, op.tag)
        call.site = call_site(3)
        check_call(layer.profile, call)
        if layer.strict:
            layer.hazards.check_passed(call)
        if index == 0 and channel is not None:
            channel.join_group(call, wait=True)  # [Note: the first batch on a group] in .profiles
        dropped = layer.fire("send") is not None if send else False
        ticket = channel.p2p_issue(call, batch=token, dropped=dropped) if channel is not None else None
        if ticket is not None:
            tickets.append(ticket)
        if dropped:
            continue
        if buffers is not None:
            buffers.site = buffers.site or call.site
            label = f"the buffer of {call.shown}"
            if send:
                buffers.input(label, op.tensor)
            else:
                buffers.output(label, op.tensor)
        tensor = transfer_view(layer.profile, op.tensor)
        tag = op.tag if layer.profile.p2p_tags else 0  # order matching, as on NCCL/HCCL
        if ticket is not None and channel is not None and channel.posted(ticket):
            channel.p2p_wait(ticket)  # see [Note: checking both ends at issue]
        real_ops.append(torch_op(op, tensor, tag))
    layer.calls += 1
    works = list(orig(real_ops)) if real_ops else []
    before: list[Callable[[], None]] = []
    if channel is not None:
        before = [functools.partial(channel.p2p_wait, t) for t in tickets]
    if not before and buffers is None:
        return works
    handles = works or [DoneWork()]
    # Waiting on any handle settles the whole batch: checks, every transfer, then the hand-over.
    first = CheckedWork(
        AllWork(handles),
        before,
        [buffers.settle] if buffers is not None else [],
        # a batch never waited is not reported (it never was): hp_core waits batches for the caller
        layer.hazards.watch(buffers, "batch_isend_irecv", buffers.site, unwaited=False)
        if buffers is not None
        else None,
    )
    return [first] + [CheckedWork(BatchPart(handle), [first.wait], [], None) for handle in handles[1:]]


def run_object_p2p(layer: Layer, name: str, orig: Callable[..., Any], args: dict[str, Any]) -> Any:
    """``send_object_list`` / ``recv_object_list``: matched like p2p, checked for the list length."""
    send = name == "send_object_list"
    peer = global_peer(args, send)
    call = object_p2p(name, peer, args.get("group"))
    call.site = call_site(3)
    call.key = ("object_p2p", "objects", len(args["object_list"]))
    check_call(layer.profile, call)
    channel = layer.side_channel()
    if channel is not None and peer is not None:
        ticket = channel.p2p_issue(call)
        if not send or layer.profile.stream_ordered_p2p:
            channel.p2p_wait(ticket)
    return orig(**args)

"""The ``hplocal`` c10d backend: collectives between the threads of one local world, in memory.

Every rank's group is its own ``ProcessGroup`` object (as in separate
processes); the ranks of one group meet in the world's ``pending`` table
under (group name, sequence number), which is how NCCL matches collectives
too: the k-th collective a rank issues on a group meets the k-th of each
peer. The last rank to arrive checks that all agree (the same collective,
reduce op, root, dtype and element counts), then computes every rank's output;
a disagreement fails it on every rank of the group with each rank's arguments.
Point-to-point messages match in issue order per (group, source, destination)
and tag, as gloo does (tags ignored under ``emulate="nccl"`` / ``"hccl"``, whose
other p2p rules :mod:`hp_testing._local_contract` checks); a send completes
when its receive took it. ``wait()`` passes the turn to the next rank (in rank
order) that can go on until the result is there (see [Note: cooperative ranks] in
:mod:`hp_testing._local_world`)."""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hp_testing import _p2p_notes
from hp_testing._local_contract import End, contract
from hp_testing._local_world import World, current
from hp_testing._sidechannel import CollectiveMismatchError, P2PMismatchError

__all__ = ["BACKEND", "register"]

BACKEND = "hplocal"

_REDUCE: dict[Any, tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
    dist.ReduceOp.SUM: ("sum", torch.add),
    dist.ReduceOp.AVG: ("avg", torch.add),
    dist.ReduceOp.MAX: ("max", torch.maximum),
    dist.ReduceOp.MIN: ("min", torch.minimum),
    dist.ReduceOp.PRODUCT: ("product", torch.mul),
    dist.ReduceOp.BAND: ("band", torch.bitwise_and),
    dist.ReduceOp.BOR: ("bor", torch.bitwise_or),
    dist.ReduceOp.BXOR: ("bxor", torch.bitwise_xor),
}


#: An error to raise on a rank at ``wait()``: the multi-process mode's error class for the rule, and the text.
Problem = tuple[type[RuntimeError], str]


def _reduce_name(op: Any) -> str:
    for key, (name, _) in _REDUCE.items():
        if op == key:
            return name
    raise ValueError(
        f"hp_testing local mode: reduce op {op!r} is not supported by the in-memory backend; use "
        "sum, avg, max, min, product, band, bor or bxor (hp_core emulates premul_sum over sum)"
    )


def _reduce(name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reduce in group-rank order, as a ring would visit them."""
    fn = next(fn for key, (n, fn) in _REDUCE.items() if n == name)
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        result = fn(result, tensor)
    if name == "avg":
        result = result / len(tensors) if result.is_floating_point() else result // len(tensors)
    return result


def _sig(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{tuple(tensor.shape)}"


def _count(tensor: torch.Tensor) -> str:
    """What must agree across ranks: the element count and dtype, not the shape, as NCCL and gloo
    see a buffer ([Note: what must match across ranks] in :mod:`hp_testing._calls`)."""
    return f"{tensor.dtype}[{tensor.numel()}]"


class LocalWork(dist.Work):
    """A handle whose ``wait()`` lets the other ranks run until the operation completed."""

    def __init__(
        self,
        world: World,
        done: Callable[[], bool],
        error: Callable[[], Problem | None],
        what: str,
    ):
        super().__init__()
        self._world, self._done, self._error, self._what = world, done, error, what

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._world.block_until(self._done, self._what)
        problem = self._error()
        if problem is not None:
            kind, text = problem
            raise kind(text)  # a fresh error per rank: each gets its own traceback
        return True

    def is_completed(self) -> bool:
        return self._done()

    def is_success(self) -> bool:
        return self._done() and self._error() is None


@dataclass
class _Call:
    """One rank's side of a collective: what it issued, and what must agree across ranks."""

    group_rank: int
    kind: str
    agree: tuple[Any, ...]
    shown: str
    payload: tuple[Any, ...]


@dataclass
class _Meeting:
    size: int
    calls: dict[int, _Call] = field(default_factory=dict)
    done: bool = False
    error: Problem | None = None


@dataclass
class _Message:
    tensor: torch.Tensor | None = None  # a send's data, until received
    buffer: torch.Tensor | None = None  # a receive's destination
    shown: str = ""
    done: bool = False
    error: Problem | None = None
    end: End | None = None  # what the contract checks know of this end


class LocalGroup(dist.ProcessGroup):
    """One rank's handle on a group of a local world.

    The methods override c10d's Python-overridable ``ProcessGroup`` with the
    argument lists ``torch.distributed`` calls them with; c10d's type stubs
    name those arguments differently, hence the ``override`` ignores.
    """

    def __init__(self, world: World, name: str, ranks: Sequence[int], group_rank: int) -> None:
        super().__init__(group_rank, len(ranks))  # type: ignore[call-arg, arg-type]
        self._world = world
        self._name = name
        self._ranks = tuple(ranks)
        self._group_rank = group_rank
        self._seq = 0
        # [Note: the local group's device type]
        # c10d keeps a ProcessGroup subclass returned by a backend's creator as the group itself and
        # registers no backend in it, so ``_device_types`` would be empty, and torch helpers that
        # read it fail (``_broadcast_tensors`` of ``set_model_state_dict(broadcast_from_rank0=True)``
        # takes ``_device_types[0]``). Registering the CPU device type, as a gloo group has it, with
        # no backend object behind it (c10d accepts None; a Python class cannot be a c10d Backend):
        # collectives still reach the methods below, and ``_get_backend("cpu")`` still raises.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, None)

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """c10d's name of the group (it names the groups it wraps, not a ProcessGroup it is given)."""
        return self._name

    # -- collectives: meet, agree, compute -----------------------------------------------------------

    def _meet(
        self,
        kind: str,
        agree: tuple[Any, ...],
        shown: str,
        payload: tuple[Any, ...],
        compute: Callable[[list[_Call]], str | None],
    ) -> LocalWork:
        self._seq += 1
        key = (self._name, self._seq)
        meeting = self._world.pending.setdefault(key, _Meeting(len(self._ranks)))
        meeting.calls[self._group_rank] = _Call(self._group_rank, kind, agree, shown, payload)
        contract(self._world).collective(self._name, self._ranks[self._group_rank], shown)
        where = f"collective #{self._seq} on group {list(self._ranks)}"
        if len(meeting.calls) == meeting.size:
            del self._world.pending[key]
            calls = [meeting.calls[r] for r in range(meeting.size)]
            if any((c.kind, c.agree) != (calls[0].kind, calls[0].agree) for c in calls):
                per_rank = "; ".join(f"rank {self._ranks[c.group_rank]}: {c.shown}" for c in calls)
                meeting.error = (
                    CollectiveMismatchError,
                    (
                        f"hp_testing local mode: the ranks disagree in {where}: {per_rank}. Every rank of "
                        "a group must issue the same collective, with the same op, root, dtype and element "
                        "counts, in the same order."
                    ),
                )
            else:
                problem = compute(calls)
                if problem is not None:
                    meeting.error = (
                        CollectiveMismatchError,
                        f"hp_testing local mode: {shown} ({where}): {problem}",
                    )
            meeting.done = True
            self._world.wake()
        return LocalWork(self._world, lambda: meeting.done, lambda: meeting.error, f"{shown} ({where})")

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> LocalWork:  # type: ignore[override]
        (tensor,) = tensors
        op = _reduce_name(opts.reduceOp)

        def compute(calls: list[_Call]) -> None:
            result = _reduce(op, [c.payload[0].reshape(-1) for c in calls])
            for c in calls:
                c.payload[0].copy_(result.view(c.payload[0].shape))

        return self._meet(
            "all_reduce", (op, _count(tensor)), f"all_reduce({_sig(tensor)}, {op})", (tensor,), compute
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> LocalWork:  # type: ignore[override]
        (tensor,) = tensors
        root = opts.rootRank

        def compute(calls: list[_Call]) -> None:
            source = calls[root].payload[0].reshape(-1).clone()
            for c in calls:
                c.payload[0].copy_(source.view(c.payload[0].shape))

        shown = f"broadcast({_sig(tensor)}, group_src={root})"
        return self._meet("broadcast", (root, _count(tensor)), shown, (tensor,), compute)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> LocalWork:  # type: ignore[override]
        def compute(calls: list[_Call]) -> None:
            gathered = torch.cat([c.payload[1].reshape(-1) for c in calls])
            for c in calls:
                c.payload[0].view(-1).copy_(gathered)

        shown = f"all_gather_into_tensor({_sig(input)} -> {_sig(output)})"
        return self._meet("all_gather", (_count(input), _count(output)), shown, (output, input), compute)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> LocalWork:
        (chunks,), (input,) = outputs, inputs

        def compute(calls: list[_Call]) -> None:
            for c in calls:
                for out, src in zip(c.payload[0], calls, strict=True):
                    out.copy_(src.payload[1])

        shown = f"all_gather([{len(chunks)} x], {_sig(input)})"
        return self._meet("all_gather_list", (_sig(input),), shown, (chunks, input), compute)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> LocalWork:
        op = _reduce_name(opts.reduceOp)

        def compute(calls: list[_Call]) -> None:
            result = _reduce(op, [c.payload[1].reshape(-1) for c in calls]).reshape(len(calls), -1)
            for c in calls:
                c.payload[0].view(-1).copy_(result[c.group_rank])

        shown = f"reduce_scatter_tensor({_sig(input)} -> {_sig(output)}, {op})"
        agree = (op, _count(input), _count(output))
        return self._meet("reduce_scatter", agree, shown, (output, input), compute)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> LocalWork:
        (output,), (chunks,) = outputs, inputs
        op = _reduce_name(opts.reduceOp)

        def compute(calls: list[_Call]) -> None:
            for c in calls:
                c.payload[0].copy_(_reduce(op, [src.payload[1][c.group_rank] for src in calls]))

        shown = f"reduce_scatter({_sig(output)}, {op})"
        return self._meet("reduce_scatter_list", (op, _sig(output)), shown, (output, chunks), compute)

    def all_to_all_single(  # type: ignore[override]
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> LocalWork:
        size = len(self._ranks)
        ins = list(input_split_sizes) or [input.shape[0] // size] * size
        outs = list(output_split_sizes) or [output.shape[0] // size] * size

        def compute(calls: list[_Call]) -> str | None:
            for c in calls:
                for src in calls:
                    sent, expected = src.payload[2][c.group_rank], c.payload[3][src.group_rank]
                    if sent != expected:
                        return (
                            f"rank {self._ranks[src.group_rank]} sends {sent} rows to rank "
                            f"{self._ranks[c.group_rank]}, which expects {expected} from it; rank i's "
                            "input_split_sizes[j] must equal rank j's output_split_sizes[i]"
                        )
            pieces = {c.group_rank: c.payload[1].split(c.payload[2]) for c in calls}
            for c in calls:
                torch.cat([pieces[src.group_rank][c.group_rank] for src in calls], out=c.payload[0])
            return None

        shown = f"all_to_all_single({_sig(input)} -> {_sig(output)}, in={ins}, out={outs})"
        payload = (output, input, ins, outs)
        return self._meet("all_to_all", (_sig(input[:0]),), shown, payload, compute)

    def alltoall(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> LocalWork:
        """``all_to_all`` of lists: rank i's ``inputs[j]`` lands in rank j's ``outputs[i]``."""

        def compute(calls: list[_Call]) -> str | None:
            for c in calls:
                for src in calls:
                    sent, expected = src.payload[1][c.group_rank], c.payload[0][src.group_rank]
                    if sent.numel() != expected.numel():
                        return (
                            f"rank {self._ranks[src.group_rank]} sends {sent.numel()} elements to rank "
                            f"{self._ranks[c.group_rank]}, which expects {expected.numel()} from it; "
                            "rank i's input_tensor_list[j] must match rank j's output_tensor_list[i]"
                        )
            for c in calls:
                for out, src in zip(c.payload[0], calls, strict=True):
                    out.copy_(src.payload[1][c.group_rank].reshape(out.shape))
            return None

        dtype = str(inputs[0].dtype).removeprefix("torch.") if inputs else "none"
        shown = f"all_to_all({len(inputs)} x {dtype})"
        return self._meet("all_to_all_list", (dtype,), shown, (outputs, inputs), compute)

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> LocalWork:
        (input,), root = inputs, opts.rootRank

        def compute(calls: list[_Call]) -> None:
            for out, src in zip(calls[root].payload[0], calls, strict=True):
                out.copy_(src.payload[1].reshape(out.shape))

        chunks = outputs[0] if outputs else []
        shown = f"gather({_sig(input)}, group_dst={root})"
        return self._meet("gather", (root, _count(input)), shown, (chunks, input), compute)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> LocalWork:
        (output,), root = outputs, opts.rootRank

        def compute(calls: list[_Call]) -> None:
            for c, piece in zip(calls, calls[root].payload[1], strict=True):
                c.payload[0].copy_(piece.reshape(c.payload[0].shape))

        chunks = inputs[0] if inputs else []
        shown = f"scatter({_sig(output)}, group_src={root})"
        return self._meet("scatter", (root, _count(output)), shown, (output, chunks), compute)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> LocalWork:  # type: ignore[override]
        (tensor,), root = tensors, opts.rootRank
        op = _reduce_name(opts.reduceOp)

        def compute(calls: list[_Call]) -> None:
            result = _reduce(op, [c.payload[0].reshape(-1) for c in calls])
            target = calls[root].payload[0]
            target.copy_(result.view(target.shape))

        shown = f"reduce({_sig(tensor)}, {op}, group_dst={root})"
        return self._meet("reduce", (op, root, _count(tensor)), shown, (tensor,), compute)

    def barrier(self, opts: Any = None) -> LocalWork:
        return self._meet("barrier", (), "barrier()", (), lambda calls: None)

    # -- point to point ---------------------------------------------------------------------------------

    def _channel(self, src: int, dst: int, tag: int) -> tuple[deque[_Message], deque[_Message]]:
        # gloo matches a receive by (peer, tag); NCCL and HCCL ignore tags and match in issue order
        key = (self._name, src, dst, tag if self._world.p2p_tags else None)
        return self._world.channels.setdefault(key, (deque(), deque()))

    def _pair(self, sends: deque[_Message], recvs: deque[_Message]) -> None:
        while sends and recvs:
            send, recv = sends.popleft(), recvs.popleft()
            assert send.tensor is not None and recv.buffer is not None
            if send.tensor.dtype != recv.buffer.dtype or send.tensor.numel() != recv.buffer.numel():
                problem = (
                    f"hp_testing local mode: a send and the receive it meets disagree: {send.shown} vs "
                    f"{recv.shown}; messages between two ranks (on one tag under gloo; on any tag under NCCL "
                    "and HCCL) match in issue order, so issue the receives in the order of the sends, "
                    "with matching sizes."
                )
                send.error = recv.error = P2PMismatchError, problem
            else:
                errors = self._contract_errors(send, recv)
                if errors is not None:
                    send.error, recv.error = ((type(e), str(e)) for e in errors)
                else:
                    recv.buffer.view(-1).copy_(send.tensor.reshape(-1))
            send.tensor = None
            send.done = recv.done = True
        self._world.wake()

    def _contract_errors(self, send: _Message, recv: _Message) -> tuple[RuntimeError, RuntimeError] | None:
        if send.end is None or recv.end is None:
            return None
        return contract(self._world).meet(self._name, send.end, recv.end)

    def _post(self, message: _Message, send: bool, peer: int, tag: int) -> LocalWork:
        """Post one end of a message; it meets its other end now or when that is posted.

        The contract's records come first: the op's note from the layer, NCCL's
        wait for the group's communicator at a first batch, its place among the
        pair's ops ([Note: p2p notes for the local backend] in :mod:`hp_testing._p2p_notes`).
        """
        note = _p2p_notes.take()
        me, other = self._ranks[self._group_rank], self._ranks[peer]
        record = contract(self._world)
        record.first_batch(self._world, self._name, self._ranks, me, note)
        message.end = record.end(self._name, me, other, send, note, message.shown, tag)
        src, dst = (self._group_rank, peer) if send else (peer, self._group_rank)
        sends, recvs = self._channel(src, dst, tag)
        (sends if send else recvs).append(message)
        self._pair(sends, recvs)
        if message.error is not None:
            kind, text = message.error
            raise kind(text)  # met its other end now: raised at issue, as the side channel does
        return LocalWork(self._world, lambda: message.done, lambda: message.error, message.shown)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> LocalWork:
        (tensor,) = tensors
        me, peer = self._ranks[self._group_rank], self._ranks[dst]
        message = _Message(tensor=tensor.clone(), shown=f"rank {me} send({_sig(tensor)}) to rank {peer}")
        return self._post(message, True, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> LocalWork:
        (tensor,) = tensors
        me, peer = self._ranks[self._group_rank], self._ranks[src]
        message = _Message(buffer=tensor, shown=f"rank {me} recv({_sig(tensor)}) from rank {peer}")
        return self._post(message, False, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> LocalWork:
        raise RuntimeError(
            "hp_testing local mode: recv() without src is not supported (NCCL and HCCL refuse it too); "
            "pass src="
        )


def _create(options: Any, backend_options: Any = None) -> LocalGroup:
    world, _ = current()
    ranks = list(options.global_ranks_in_group) or list(range(world.size))
    return LocalGroup(world, str(options.group_id), ranks, options.group_rank)


_registered = False


def register() -> None:
    """Make ``dist.init_process_group("hplocal")`` and ``new_group`` build :class:`LocalGroup` s."""
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        _registered = True

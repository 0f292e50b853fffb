"""Activation swap: a micro-batch's saved activations wait for its backward in host memory.

In 1F1B, stage ``s`` of ``p`` holds the saved activations of up to ``p - s``
micro-batches between their forward and their backward; stage 0 holds ``p``.
Most of that time they are idle. Swapping moves them to host memory after the
forward and brings them back just before the backward, so the device holds
only the micro-batches being worked on ([Note: swap parts] names the three
parts). Details in the [Note]s below: swap policy, where swaps go, what a
session manages, swap streams, activation accounting, counting without
swapping.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from hp_core import DeviceHandle, Platform, get_platform

from hp_pipeline.ir import MetaStep, MetaStepType, Order
from hp_pipeline.kinds import StepKind

if TYPE_CHECKING:
    from hp_pipeline._deps import OrderView

__all__ = [
    "SWAP_KINDS",
    "SwapError",
    "SwapPolicy",
    "SwapSession",
    "SwapStats",
    "attach_swap",
    "check_swap_platform",
    "insert_swaps",
]

# [Note: swap parts]
# * :class:`SwapPolicy` (frozen): which stages swap and which micro-batches stay
#   ([Note: swap policy]), checked against the pipeline and the platform before
#   any rank communicates.
# * :func:`insert_swaps`: a pure pass over an order that adds ``SWAP_OUT`` and
#   ``SWAP_IN`` steps where the policy says ([Note: where swaps go]).
# * :class:`SwapSession`: the mechanism, on
#   :class:`torch.autograd.graph.saved_tensors_hooks`, with the executor's
#   memory accounting ([Note: what a session manages], [Note: swap streams],
#   [Note: activation accounting]).


MicroKey = tuple[int, int]
"""``(stage_index, micro_index)``: whose activations."""

_STATE_KEY = "swap"  # the runner's state entry holding its SwapSession


class SwapError(ValueError):
    """A swap configuration that cannot work here; the message names the value and the fix."""


# -- policy --------------------------------------------------------------------


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # not bool, which is an int too


# [Note: swap policy]
# ``SwapPolicy(keep_newest=k, stages=None, min_bytes=1024)``: on every stage in
# ``stages`` (``None``: all), a micro-batch stays on the device while it is one
# of the ``k`` newest the stage has run forward for; once ``k`` newer forwards
# of its stage have run it moves to the host, and it comes back one compute
# step before its backward. ``k = 0`` swaps a micro-batch right after its own
# forward: on stage 0 of 1F1B the device then holds two micro-batches (the one
# in flight and the one prefetched for the next backward) instead of ``p``.
# A micro-batch is swapped only when something allocates while it would be
# away: a forward (of any stage of the rank) or the swap-in of an earlier
# micro-batch (decided first: micro-batches are taken in the order of their
# forwards). A backward only frees, so a swap with nothing but backwards inside
# it lowers no peak and would only cost copies. The last stage's ``F``
# followed at once by its ``B`` never swaps, nor does stage ``p-2`` of 1F1B,
# whose only step between a micro-batch's forward and its backward is another
# micro-batch's backward; the last micro-batches of stage 0, whose backwards
# come after the last forward, do, because the swap-ins prefetched for the
# backwards before theirs would otherwise pile up on the device. ``stages=()``
# swaps nothing but still installs the session, so the accounting measures the
# activations a schedule keeps (the baseline of a comparison).


@dataclass(frozen=True)
class SwapPolicy:
    """Which stages swap their saved activations to host memory, and which micro-batches stay.

    See [Note: swap policy]. Checked when built (types and ranges) and again by
    :meth:`check` against the pipeline and the platform, which the schedules
    call before they communicate.

    Attributes:
        keep_newest: how many of a stage's newest forwarded micro-batches stay
            on the device; ``0`` swaps each one right after its forward.
        stages: the stages that swap; ``None`` for every stage, ``()`` for
            none (accounting only).
        min_bytes: saved tensors smaller than this stay on the device.
    """

    keep_newest: int = 0
    stages: Collection[int] | None = None  # kept as a frozenset
    min_bytes: int = 1024

    def __post_init__(self) -> None:
        if not _is_count(self.keep_newest):
            raise SwapError(
                f"SwapPolicy.keep_newest must be an int >= 0 (how many of a stage's newest "
                f"micro-batches stay on the device), got {self.keep_newest!r}; e.g. keep_newest=0"
            )
        if not _is_count(self.min_bytes):
            raise SwapError(
                f"SwapPolicy.min_bytes must be an int >= 0, got {self.min_bytes!r}; e.g. min_bytes=1024"
            )
        if self.stages is None:
            return
        if isinstance(self.stages, (str, bytes)) or not isinstance(self.stages, Iterable):
            raise SwapError(
                f"SwapPolicy.stages must be None (every stage) or a collection of stage indices, "
                f"got {self.stages!r}; e.g. stages={{0, 1}}"
            )
        stages = tuple(self.stages)
        bad = [s for s in stages if not _is_count(s)]
        if bad:
            raise SwapError(
                f"SwapPolicy.stages must hold stage indices (ints >= 0), got {bad!r} in {stages!r}"
            )
        object.__setattr__(self, "stages", frozenset(stages))

    def swaps_stage(self, stage_index: int) -> bool:
        """Whether ``stage_index``'s micro-batches may be swapped."""
        return self.stages is None or stage_index in self.stages

    def check(self, num_stages: int, platform: Platform | None = None) -> None:
        """Refuse a policy this pipeline or platform cannot run, before anything communicates.

        Raises:
            SwapError: ``stages`` names a stage the pipeline does not have, or
                the platform has no host memory to swap to
                (:func:`check_swap_platform`).
        """
        if self.stages is not None:
            missing = sorted(s for s in self.stages if s >= num_stages)
            if missing:
                raise SwapError(
                    f"SwapPolicy.stages={sorted(self.stages)} names stage(s) {missing}, but the "
                    f"pipeline has stages 0 .. {num_stages - 1}; pass indices below {num_stages}, "
                    "or stages=None to swap on every stage"
                )
        check_swap_platform(get_platform() if platform is None else platform)


def check_swap_platform(platform: Platform) -> bool:
    """Whether swaps can use pinned host memory here; raise when there is no host memory at all.

    A swap copies device tensors into host memory and back. The ``meta``
    device holds no data, so there is nothing to copy and nowhere to bring it
    back to; a platform whose tensors live there is refused. Accelerators get
    pinned host buffers (what an asynchronous copy needs); on the CPU, the
    device and the host are the same memory and the buffers are plain tensors.

    Returns:
        ``True`` when host buffers are pinned.

    Raises:
        SwapError: the platform's tensors live on ``meta``.
    """
    kind = platform.tensor_device_type
    if kind == "meta":
        raise SwapError(
            f"activation swap needs host memory to copy saved activations into, but this platform's "
            f"tensors live on {kind!r} (Platform(device_type={platform.device_type!r}, "
            f"tensor_device_type={kind!r})), which holds no data; pass swap_policy=None, or run on a "
            "platform whose tensors live on a real device ('cuda', 'npu', 'xpu' or 'cpu')"
        )
    return platform.handle.is_accelerator


# -- the step kinds ------------------------------------------------------------


def _after_forward(view: OrderView, step: MetaStep) -> list[MetaStep]:
    return [MetaStep(step.micro_index, MetaStepType.FWD, step.stage_index)]


def _after_swap_out(view: OrderView, step: MetaStep) -> list[MetaStep]:
    return [MetaStep(step.micro_index, MetaStepType.SWAP_OUT, step.stage_index)]


def _swap_problems(view: OrderView, expected: set[int]) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each ``SWAP_OUT`` comes back (one ``SWAP_IN``), and each ``SWAP_IN`` comes before its backward."""
    problems: list[tuple[str, list[tuple[int, int]]]] = []
    for out in view.of_type.get(MetaStepType.SWAP_OUT, []):
        back = MetaStep(out.micro_index, MetaStepType.SWAP_IN, out.stage_index)
        if back not in view.position:
            problems.append(
                (
                    f"{out} moves stage {out.stage_index}'s micro-batch {out.micro_index} to host memory "
                    f"but no {back} brings it back before its backward; add {back} "
                    "(insert_swaps places both)",
                    [view.position[out]],
                )
            )
    for back in view.of_type.get(MetaStepType.SWAP_IN, []):
        assert back.micro_index is not None
        backward = view.backward_input(back.stage_index, back.micro_index)
        at, used = view.position[back], view.position.get(backward)
        if used is not None and used[1] <= at[1]:
            problems.append(
                (
                    f"{back} must come before {backward}, which reads the activations it brings back",
                    [at, used],
                )
            )
    return problems


def _run_swap(runner: Any, step: MetaStep) -> None:
    """The executor handler of ``SWAP_OUT`` / ``SWAP_IN`` ([Note: running a kind] in hp_pipeline.kinds)."""
    session = runner.state.get(_STATE_KEY)
    if session is None:
        raise RuntimeError(
            f"{step}: this runner has no swap session; build the schedule with "
            "swap_policy=SwapPolicy(...), or call hp_pipeline.swap.attach_swap(runner, policy) first"
        )
    assert step.micro_index is not None
    key = (step.stage_index, step.micro_index)
    if step.type is MetaStepType.SWAP_OUT:
        session.swap_out(key)
    else:
        session.swap_in(key)


#: The swap's kinds, registered by ``hp_pipeline._builtin_kinds.register_builtins``.
SWAP_KINDS = (
    StepKind(
        "SWAP_OUT",
        "SWAP_OUT",
        "activation swap: start moving the micro-batch's saved activations to host memory",
        group="swap",
        training_only=True,
        needs=_after_forward,
        check=_swap_problems,
        cost=0,  # copies on a side stream: the rank goes on computing ([Note: swap streams])
        colour="#d4a6c8",
        resident=-1,
        handler=_run_swap,
    ),
    StepKind(
        "SWAP_IN",
        "SWAP_IN",
        "activation swap: start bringing the micro-batch's saved activations back (prefetch)",
        group="swap",
        training_only=True,
        needs=_after_swap_out,
        check=_swap_problems,
        cost=0,
        colour="#9d7660",
        resident=+1,
        handler=_run_swap,
    ),
)


# -- the pass ------------------------------------------------------------------


def insert_swaps(order: Mapping[int, Sequence[MetaStep]], policy: SwapPolicy) -> Order:
    """Add ``SWAP_OUT`` / ``SWAP_IN`` steps to ``order`` as ``policy`` says; the input is not modified.

    Works on compute-only orders and on orders with communication (run it after
    :func:`~hp_pipeline.insert_comms`, so the swaps sit right before compute
    steps, after the transfers in front of them). Placement: [Note: where swaps
    go]. A micro-batch with no backward on the rank (a forward-only schedule)
    is never swapped.

    Raises:
        TypeError: ``policy`` is not a :class:`SwapPolicy`.
        ValueError: the order already has swap steps.
    """
    if not isinstance(policy, SwapPolicy):
        raise TypeError(f"insert_swaps needs a SwapPolicy, got {type(policy).__name__} ({policy!r})")
    result: Order = {}
    for rank, steps in order.items():
        present = [str(s) for s in steps if s.type in (MetaStepType.SWAP_OUT, MetaStepType.SWAP_IN)]
        if present:
            raise ValueError(
                f"insert_swaps: rank {rank} already has swap steps {present[:4]}; pass the order "
                "without them (insert_swaps places every swap itself)"
            )
        result[rank] = _swapped_list(list(steps), policy)
    return result


# [Note: where swaps go]
# Slots are the compute steps of a rank's list (``F``, ``B``, ``I``, ``W``,
# ``OVERLAP_F_B``, MPipe's ``PF``/``PB``). The ``SWAP_OUT`` of stage ``s``'s
# micro-batch ``i`` goes right before the compute step that follows the forward
# which pushed ``i`` out of the ``k`` newest (its own forward when ``k = 0``);
# its ``SWAP_IN`` goes right before the compute step that precedes ``i``'s
# first backward (``B`` or ``I``), so the copy back runs while that step
# computes (prefetched one slot early). When several swaps land before the same
# step, the swap-outs come first, so the device frees before it allocates. Both
# steps sit after the communication steps in front of their compute step, so the
# sends of the step before are posted first and the copies never delay a peer.


def _swapped_list(steps: list[MetaStep], policy: SwapPolicy) -> list[MetaStep]:
    """One rank's list with its swaps ([Note: where swaps go])."""
    slots = [pos for pos, step in enumerate(steps) if step.type.busy]  # F, B, I, W, pairs, PF, PB
    forward_slot: dict[MicroKey, int] = {}
    backward_slot: dict[MicroKey, int] = {}
    forwards_of: dict[int, list[int]] = {}  # stage -> slots of its forwards, in order
    forward_slots: set[int] = set()  # slots holding a forward of any stage
    for slot, pos in enumerate(slots):
        for part in steps[pos].parts:
            if part.micro_index is None:
                continue
            key = (part.stage_index, part.micro_index)
            if part.type is MetaStepType.FWD:
                forward_slot[key] = slot
                forwards_of.setdefault(part.stage_index, []).append(slot)
                forward_slots.add(slot)
            elif part.type.is_backward:  # B or I: the first to read the saved activations
                backward_slot.setdefault(key, slot)
    outs: dict[int, list[MetaStep]] = {}  # slot -> swaps placed right before that slot's step
    ins: dict[int, list[MetaStep]] = {}
    for key, f in sorted(forward_slot.items(), key=lambda item: item[1]):
        stage, micro = key
        b = backward_slot.get(key)
        if b is None or not policy.swaps_stage(stage):
            continue
        newer = [slot for slot in forwards_of[stage] if f < slot < b]
        if len(newer) < policy.keep_newest:
            continue  # still among the k newest at its backward
        pushed_at = f if policy.keep_newest == 0 else newer[policy.keep_newest - 1]
        out_slot, in_slot = pushed_at + 1, b - 1
        if not any(slot in forward_slots or slot in ins for slot in range(out_slot, in_slot)):
            continue  # nothing allocates while it would be away: the copies would lower no peak
        outs.setdefault(out_slot, []).append(MetaStep(micro, MetaStepType.SWAP_OUT, stage))
        ins.setdefault(in_slot, []).append(MetaStep(micro, MetaStepType.SWAP_IN, stage))
    at = {slots[slot]: outs.get(slot, []) + ins.get(slot, []) for slot in set(outs) | set(ins)}
    result: list[MetaStep] = []
    for pos, step in enumerate(steps):
        result.extend(at.get(pos, ()))
        result.append(step)
    return result


# -- the session ---------------------------------------------------------------


class _Where(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    RETURNING = "returning"  # copy back issued, maybe not finished


class _Handle:
    """One saved tensor owned by the session: on the device, on the host, or on its way back."""

    __slots__ = ("device_tensor", "event", "host", "key", "nbytes", "where")

    def __init__(self, key: MicroKey, tensor: torch.Tensor) -> None:
        self.key = key
        self.device_tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.event: Any = None
        self.nbytes = tensor.nbytes
        self.where = _Where.DEVICE


# [Note: activation accounting]
# The session counts the bytes of the saved tensors it manages that are on the
# compute device: a micro-batch's bytes join at the end of its forward, leave at
# its ``SWAP_OUT``, come back at its ``SWAP_IN`` and leave for good when the
# executor releases the micro-batch after its last backward (``B`` or ``W``).
# ``peak_bytes`` is the most resident at any of those points; transient
# tensors inside a forward or backward are not activations kept between steps
# and are not counted. The simulator walks an order the same way
# (``StepKind.resident``; [Note: device activations] in
# :mod:`hp_pipeline.simulate`), so the two agree exactly:
# ``simulate(order).peak_device_bytes(rank, stats.bytes_by_micro)`` equals the
# rank's measured ``peak_bytes``, and with micro-batches of equal size that is
# ``peak_device_activations_per_rank[rank]`` times one micro-batch's bytes.


@dataclass(frozen=True)
class SwapStats:
    """A snapshot of a session's accounting ([Note: activation accounting]).

    Attributes:
        resident_bytes: managed saved activations on the compute device now.
        peak_bytes: the most resident since the last :meth:`SwapSession.reset_peak`.
        host_bytes: managed saved activations in host memory now.
        swapped_out: micro-batches moved to the host since the last reset.
        swapped_in: micro-batches brought back since the last reset.
        bytes_by_micro: ``(stage, micro)`` -> its managed bytes, for the
            micro-batches recorded since the last reset.
    """

    resident_bytes: int
    peak_bytes: int
    host_bytes: int
    swapped_out: int
    swapped_in: int
    bytes_by_micro: dict[MicroKey, int]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_ptr(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _is_parameter_like(tensor: torch.Tensor) -> bool:
    """A parameter (trainable, frozen, or FSDP's gathered one), a stage's received input, or a view of one.

    Leaves that require grad are parameters and received inputs; a frozen
    parameter is a leaf that is an ``nn.Parameter``. A non-leaf of a view
    (``weight.t()``, saved by ``linear``) is judged by its base.
    """
    base = tensor._base
    if base is not None:
        tensor = base
    return tensor.is_leaf and (tensor.requires_grad or isinstance(tensor, torch.nn.Parameter))


# [Note: what a session manages]
# While a forward runs under :meth:`SwapSession.recording`, autograd hands every
# tensor it saves for the backward to the session's pack hook. The session
# leaves alone (returns the tensor itself) what swapping cannot free:
#
# * parameters, trainable or frozen, and views of them (``weight.t()`` saved
#   by ``linear``), and the stage's received inputs (leaves that require grad,
#   like parameters): the module and the stage hold them anyway;
# * the tensors the caller says are held elsewhere, ``recording(held=...)``:
#   the executor names the stage's inputs (stage 0's micro-batch) and outputs
#   (sent downstream and kept as the backward's roots), read when the forward
#   ends;
# * tensors under ``policy.min_bytes``: each one costs a copy and an event for
#   little memory.
#
# Everything else becomes a handle that the session owns. A tensor saved twice
# (``relu``'s result is also the next ``linear``'s input) is one handle, so it is
# copied and counted once; two different views of one storage are two handles
# (counted twice: the accounting errs high, never low).


# [Note: swap streams]
# ``swap_out`` copies on a side stream of the platform's device handle: the side
# stream first waits for the compute stream (the forward produced the tensors
# there), the copy goes into pinned host memory when the device is an
# accelerator (``non_blocking`` needs it to be asynchronous), an event marks its
# end, and the device tensor is marked as used by the side stream
# (``record_stream``) before the session drops it, so the caching allocator does
# not hand its memory out before the copy has read it. ``swap_in`` copies back on
# the same side stream; the unpack hook makes the consuming stream wait for that
# event, so the backward never reads a buffer the copy has not filled. On the CPU
# streams and events are no-ops and the copies are synchronous; the "host" copy
# is a separate CPU tensor, so the whole path (and its accounting) runs in tests.


# [Note: counting without swapping]
# Wrapping a saved tensor in a handle costs a Python object at pack time and a
# lookup at unpack time, on the compute thread. A micro-batch the order never
# swaps (the last stage's, those of stage ``p-2`` of 1F1B, every one under
# ``stages=()``) does
# not need one: it is recorded with ``count_only=True``, which selects the same
# tensors and counts the same bytes but hands autograd the tensors themselves.
# So the accounting covers every micro-batch while only those that move pay for
# moving.


class SwapSession:
    """Owns the saved activations of one rank's forwards; moves them to the host and back.

    A schedule with a ``swap_policy`` makes one for its runner
    (:func:`attach_swap`), which then calls, per micro-batch and stage:
    :meth:`recording` around the forward (holding the stage's inputs and
    outputs), :meth:`swap_out` / :meth:`swap_in` at the order's swap steps and
    :meth:`release` after the last backward. :meth:`end_step` forgets whatever
    a failed step left behind.

    Args:
        policy: the :class:`SwapPolicy`; its ``min_bytes`` decides which saved
            tensors are managed ([Note: what a session manages]).
        platform: where tensors compute; default ``hp_core.get_platform()``.
            Refused when it has no host memory (:func:`check_swap_platform`).
    """

    def __init__(self, policy: SwapPolicy, platform: Platform | None = None) -> None:
        if not isinstance(policy, SwapPolicy):
            raise TypeError(f"SwapSession needs a SwapPolicy, got {type(policy).__name__} ({policy!r})")
        platform = get_platform() if platform is None else platform
        self.policy = policy
        self._pin = check_swap_platform(platform)
        self._device: DeviceHandle = platform.handle
        self._accelerator = self._device.is_accelerator
        self._stream: Any = None  # the side stream, made on first use ([Note: swap streams])
        self._handles: dict[MicroKey, list[_Handle]] = {}
        self._counted: dict[MicroKey, int] = {}  # micro-batches recorded with count_only: their bytes
        self._swapped: set[MicroKey] = set()  # what the runner's order swaps (attach_swap fills it)
        self._resident = 0
        self._host = 0
        self._peak = 0
        self._out = self._in = 0
        self._bytes_by_micro: dict[MicroKey, int] = {}

    # -- accounting ------------------------------------------------------------

    @property
    def resident_bytes(self) -> int:
        return self._resident

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def stats(self) -> SwapStats:
        """The accounting now ([Note: activation accounting])."""
        return SwapStats(
            resident_bytes=self._resident,
            peak_bytes=self._peak,
            host_bytes=self._host,
            swapped_out=self._out,
            swapped_in=self._in,
            bytes_by_micro=dict(self._bytes_by_micro),
        )

    def reset_peak(self) -> None:
        """Restart the peak (and the counters) from what is resident now."""
        self._peak = self._resident
        self._out = self._in = 0
        self._bytes_by_micro = {}

    def _add_resident(self, nbytes: int) -> None:
        self._resident += nbytes
        self._peak = max(self._peak, self._resident)

    # -- recording -------------------------------------------------------------

    @contextmanager
    def recording(
        self,
        key: MicroKey,
        *,
        held: Iterable[Any] | Callable[[], Iterable[Any]] = (),
        count_only: bool = False,
    ) -> Iterator[None]:
        """Manage the tensors autograd saves inside the block as ``key``'s ([Note: what a session manages]).

        ``held``: the tensors kept elsewhere for the whole step (the stage's
        inputs and outputs), or a function giving them, called when the block
        ends (the outputs exist only then). Saved tensors that share storage
        with them stay unmanaged. The micro-batch's bytes join the resident
        count when the block ends. ``count_only``: a micro-batch the order
        never swaps; its tensors are counted but not wrapped, so its backward
        pays nothing for the session ([Note: counting without swapping]).
        """
        if key in self._handles or key in self._counted:
            raise RuntimeError(
                f"stage {key[0]} recorded the forward of micro-batch {key[1]} twice in one step; "
                "release it (after its backward) before recording it again"
            )
        if count_only:
            with self._counting(key, held):
                yield
            return
        managed: dict[int, _Handle] = {}  # id of the saved tensor -> its handle (held, so ids stay unique)
        min_bytes = self.policy.min_bytes

        def pack(tensor: torch.Tensor) -> Any:
            # Hot: every tensor autograd saves comes here. The same tensor saved twice
            # (relu's result, the next linear's input) gets its first handle back.
            handle = managed.get(id(tensor))
            if handle is not None:
                return handle
            if tensor.nbytes < min_bytes or _is_parameter_like(tensor) or tensor.is_meta:
                return tensor
            handle = managed[id(tensor)] = _Handle(key, tensor)
            return handle

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        tensors = held() if callable(held) else held
        skip = {_storage_ptr(t) for t in tensors if isinstance(t, torch.Tensor)}
        # A held tensor's handle keeps wrapping it (the backward unpacks it as is) but is
        # neither moved nor counted: moving it would free nothing.
        handles = [
            h
            for h in managed.values()
            if h.device_tensor is not None and _storage_ptr(h.device_tensor) not in skip
        ]
        self._handles[key] = handles
        total = sum(h.nbytes for h in handles)
        self._bytes_by_micro[key] = total
        self._add_resident(total)

    @contextmanager
    def _counting(self, key: MicroKey, held: Iterable[Any] | Callable[[], Iterable[Any]]) -> Iterator[None]:
        """``recording(count_only=True)``: the same selection and bytes, no handles."""
        seen: dict[int, torch.Tensor] = {}  # the graph keeps them alive, so ids stay unique
        min_bytes = self.policy.min_bytes

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in seen and not (
                tensor.nbytes < min_bytes or _is_parameter_like(tensor) or tensor.is_meta
            ):
                seen[id(tensor)] = tensor
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, _same):
            yield
        tensors = held() if callable(held) else held
        skip = {_storage_ptr(t) for t in tensors if isinstance(t, torch.Tensor)}
        total = sum(t.nbytes for t in seen.values() if _storage_ptr(t) not in skip)
        self._counted[key] = self._bytes_by_micro[key] = total
        self._add_resident(total)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        handle: _Handle = packed
        if handle.where is _Where.HOST:
            # No SWAP_IN before this backward (a hand-written order, or a backward
            # run outside the schedule): bring the micro-batch back now.
            self.swap_in(handle.key)
        tensor = handle.device_tensor
        assert tensor is not None
        if handle.where is _Where.RETURNING:
            stream = self._device.current_stream()
            if handle.event is not None:
                stream.wait_event(handle.event)
            if self._accelerator:
                # Allocated on the side stream, read on this one ([Note: swap streams]).
                tensor.record_stream(stream)  # type: ignore[arg-type]
            handle.event = None
            handle.where = _Where.DEVICE
        return tensor

    # -- moving ----------------------------------------------------------------

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = self._device.new_stream()
        return self._stream

    def _handles_of(self, key: MicroKey, kind: str) -> list[_Handle]:
        handles = self._handles.get(key)
        if handles is None and key in self._counted:
            raise RuntimeError(
                f"{kind} of stage {key[0]} micro-batch {key[1]}: its forward was recorded with "
                "count_only=True (the order had no swap for it), so its activations cannot move"
            )
        if handles is None:
            raise RuntimeError(
                f"{kind} of stage {key[0]} micro-batch {key[1]}: its forward was not recorded on this "
                f"rank; a {kind} must come after the forward of the same stage and micro-batch (and a "
                "SWAP_IN after its SWAP_OUT)"
            )
        return handles

    def swap_out(self, key: MicroKey) -> int:
        """Start copying ``key``'s managed activations to the host; returns the bytes moved.

        The device memory is released when the copies are done
        ([Note: swap streams]); the accounting counts it released now.
        """
        moving = [h for h in self._handles_of(key, "SWAP_OUT") if h.where is _Where.DEVICE]
        if not moving:
            return 0
        device, side, pin = self._device, self._side_stream(), self._pin
        side.wait_stream(device.current_stream())
        with device.stream(side):
            for handle in moving:
                tensor = handle.device_tensor
                assert tensor is not None
                host = torch.empty_like(tensor, device="cpu", pin_memory=pin)
                host.copy_(tensor, non_blocking=pin)
                if self._accelerator:
                    tensor.record_stream(side)
                handle.host, handle.device_tensor, handle.where = host, None, _Where.HOST
            event = side.record_event()
        nbytes = self._moved(moving, event)
        self._resident -= nbytes
        self._host += nbytes
        self._out += 1
        return nbytes

    def swap_in(self, key: MicroKey) -> int:
        """Start copying ``key``'s activations back (a prefetch); the backward waits for it.

        Returns the bytes brought back.
        """
        moving = [h for h in self._handles_of(key, "SWAP_IN") if h.where is _Where.HOST]
        if not moving:
            return 0
        device, side, pin = self._device, self._side_stream(), self._pin
        target = device.current_device()
        with device.stream(side):  # after the copies out: same stream
            for handle in moving:
                host = handle.host
                assert host is not None
                back = torch.empty_like(host, device=target)
                back.copy_(host, non_blocking=pin)
                handle.device_tensor, handle.host, handle.where = back, None, _Where.RETURNING
            event = side.record_event()
        nbytes = self._moved(moving, event)
        self._host -= nbytes
        self._add_resident(nbytes)
        self._in += 1
        return nbytes

    @staticmethod
    def _moved(handles: list[_Handle], event: Any) -> int:
        """Give ``handles`` the event that marks the end of their copies; their bytes."""
        for handle in handles:
            handle.event = event
        return sum(h.nbytes for h in handles)

    def release(self, key: MicroKey) -> None:
        """Forget ``key``'s handles after its last backward; its bytes leave the accounting."""
        self._resident -= self._counted.pop(key, 0)
        handles = self._handles.pop(key, None)
        if not handles:
            return
        for handle in handles:
            if handle.where is _Where.HOST:
                self._host -= handle.nbytes
            else:
                self._resident -= handle.nbytes
            handle.device_tensor = handle.host = handle.event = None

    def begin_step(self) -> None:
        """Start a step: forget what a failed step left behind and restart the peak."""
        self.end_step()
        self.reset_peak()

    def end_step(self) -> None:
        """Forget every micro-batch still held (a failed step stops between forward and backward)."""
        for key in [*self._handles, *self._counted]:
            self.release(key)

    def __repr__(self) -> str:
        return (
            f"SwapSession({self.policy}, resident={self._resident} B, peak={self._peak} B, "
            f"host={self._host} B)"
        )


# -- wiring into the executor ----------------------------------------------------


def attach_swap(runner: Any, policy: SwapPolicy, platform: Platform | None = None) -> SwapSession:
    """Give an executor runner (``StepRunner``) a :class:`SwapSession` for ``policy``; returns it.

    The session goes to ``runner.state["swap"]``, where the ``SWAP_OUT`` /
    ``SWAP_IN`` handlers find it. When the runner trains, every forward runs
    under :meth:`SwapSession.recording` (holding the stage's inputs and
    outputs) and every ``B`` and ``W`` releases its micro-batch when it ends,
    so the accounting runs whether or not the order swaps (``stages=()``).
    Call :meth:`SwapSession.begin_step` before each step (the schedules do).
    """
    session = SwapSession(policy, platform)
    swap_out = MetaStepType.SWAP_OUT
    session._swapped = {(s.stage_index, s.micro_index) for s in runner.steps if s.type is swap_out}
    runner.state[_STATE_KEY] = session
    if runner.training:
        runner.add_step_context([MetaStepType.FWD], _recording_context)
        runner.add_step_context([MetaStepType.BWD, MetaStepType.BWD_WEIGHT], _release_context)
    return session


def _recording_context(runner: Any, step: MetaStep) -> Any:
    session: SwapSession = runner.state[_STATE_KEY]
    stage, micro = runner.stages[step.stage_index], step.micro_index
    assert micro is not None

    def held() -> tuple[Any, ...]:
        state = stage._micro.get(micro)
        return () if state is None else (*state.inputs, *state.outputs)

    key = (step.stage_index, micro)
    return session.recording(key, held=held, count_only=key not in session._swapped)


@contextmanager
def _release_context(runner: Any, step: MetaStep) -> Iterator[None]:
    yield
    runner.state[_STATE_KEY].release((step.stage_index, step.micro_index))

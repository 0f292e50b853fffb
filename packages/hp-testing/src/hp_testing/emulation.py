"""The emulation layer: torch.distributed, wrapped inside the ranks, between the library and gloo.

:func:`install` replaces the public communication functions of
``torch.distributed`` (``all_reduce``, ``all_gather_single``, ``send``,
``batch_isend_irecv``, the object collectives, ...) with wrappers, injects the
profile's platform into hp_core (``cuda``/``nccl`` semantics with CPU tensors
under ``nccl-emu``, ``npu``/``hccl`` under ``hccl-emu``) and tells hp_core's
capability table which backend's semantics to assume. Library code, hp_core
and raw ``torch.distributed`` calls in user tests all pass through the
wrappers unchanged; only the harness ranks (and ``hp-run --emulate``) ever
call :func:`install`, so production code never pays for it.

Each wrapped call, in order (see [Note: one call through the layer]):

1. describe it (:mod:`hp_testing._calls`) and find the user's call site;
2. apply the profile's rules (:mod:`hp_testing.profiles`);
3. fire a planned fault, if one is due (:mod:`hp_testing.faults`);
4. compare its fingerprint with the other ranks' through the store
   (:mod:`hp_testing._sidechannel`), or post/await its p2p other end;
5. in strict mode, swap outputs for shadows and poison them (:mod:`hp_testing._hazards`);
6. run it on gloo, emulating what gloo lacks (``PREMUL_SUM``, fp8 moves,
   uneven all-gathers) with the real backend's result.

[Note: checking both ends at issue]
gloo aborts the whole process when a message of the wrong size arrives, so a
mismatched send/receive pair must never reach gloo on both sides. Each side
posts its fingerprint first and then looks for the other's: whichever side
posts second sees both, compares them, and raises before handing its op to
gloo. Nothing waits here (waiting would add orderings gloo does not have);
the rest of the checking happens at ``wait()``.

[Note: deferred async checks]
A collective is compared with the other ranks' calls at the same position
of its group, and a blocking one waits there for all of them. An async one
(``async_op=True``) does that only where the backend runs a rank's
operations in one queue (``nccl-emu``, ``hccl-emu``: the op holds the queue
until every rank has issued it, so waiting at issue finds the same
deadlocks NCCL would). On gloo every operation progresses on its own, and
a program may issue an async collective, go on with point-to-point work its
peers need, and wait later; waiting at issue would report a deadlock that
gloo never has. There the call is posted at issue (its position is fixed
then), compared at once with the ranks that already posted (so of two ranks
that disagree, the second sees it before gloo does, as with p2p above), and
compared with all of them at ``wait()``, before the real wait.

[Note: one call through the layer]
Nested calls (torch's ``all_gather_object`` calling ``all_gather``, our own
emulations calling gloo) pass straight through: a thread-local depth counter
makes only the outermost call count, so sequence numbers match what the user
wrote on every rank.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hp_testing._calls import Call, call_site, describe, describe_p2p, object_p2p
from hp_testing._funcol import install_functional, uninstall_functional
from hp_testing._funcol_ops import install_functional_ops, uninstall_functional_ops
from hp_testing._hazards import AsyncHazardError, CheckedWork, DoneWork, Shadows
from hp_testing._sidechannel import SideChannel
from hp_testing.faults import Fault, InjectedFault
from hp_testing.profiles import Profile, check_call, get_profile

__all__ = ["Layer", "active_layer", "install", "uninstall"]

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
P2P = ("send", "recv", "isend", "irecv")
OBJECT_P2P = ("send_object_list", "recv_object_list")
_MOVES = (
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
)
_FP8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)

_local = threading.local()
_LAYER: Layer | None = None
_ORIGINALS: dict[str, Any] = {}


def active_layer() -> Layer | None:
    """The installed layer of this process, if any."""
    return _LAYER


def _depth() -> int:
    return getattr(_local, "depth", 0)


class _Nested:
    def __enter__(self) -> None:
        _local.depth = _depth() + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth = _depth() - 1


def _world() -> Any:
    return dist.group.WORLD


def _bytes_view(value: Any) -> Any:
    """fp8 tensors (and lists of them) as uint8 views: gloo refuses fp8, NCCL moves its bytes."""
    if isinstance(value, torch.Tensor) and value.dtype in _FP8:
        return value.view(torch.uint8)
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [_bytes_view(v) for v in value]
    return value


class _AllWork:
    """Several torch works waited as one (a batch whose results are handed over together)."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def wait(self, timeout: Any = None) -> bool:
        for handle in self._handles:
            if timeout is None:
                handle.wait()
            else:
                handle.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)


class Layer:
    """The per-process emulation state: profile, checks, strict mode, faults, the current test."""

    def __init__(self, profile: Profile, *, checks: bool = True, strict: bool = False) -> None:
        self.profile = profile
        self.checks = checks
        self.strict = strict
        self.channel: SideChannel | None = None
        self.channel_factory: Callable[[], SideChannel | None] | None = None
        self.faults: tuple[Fault, ...] = ()
        self.fired: list[str] = []
        self.counts = {"collective": 0, "send": 0}
        self.unwaited: dict[int, tuple[str, str]] = {}
        self.calls = 0

    # -- per test ------------------------------------------------------------------

    def begin_test(
        self,
        store: Any,
        prefix: str,
        *,
        checks: bool,
        strict: bool,
        faults: tuple[Fault, ...] = (),
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.checks, self.strict, self.faults = checks, strict, tuple(faults)
        self.channel = (
            SideChannel(
                store,
                prefix,
                rank,
                world,
                stream_ordered=self.profile.stream_ordered_p2p,
                tags=self.profile.p2p_tags,
            )
            if checks and store is not None
            else None
        )
        self.fired = []
        self.counts = {"collective": 0, "send": 0}
        self.unwaited = {}

    def post_failure(self, text: str) -> None:
        """Tell the peers this rank failed, so their waits end with this rank's error."""
        channel = self.channel
        if channel is not None:
            try:
                channel.post_status("failed", text)
            except Exception:  # the store is gone: the pool reports the failure anyway
                pass

    def post_exit(self, code: int) -> None:
        """Tell the peers this rank ends now (``sys.exit`` in a test), so their waits end with its code."""
        channel = self.channel
        if channel is not None:
            try:
                channel.post_status("exited", "It called sys.exit() in the middle of the test.", code)
            except Exception:  # the store is gone: the pool reports the failure anyway
                pass

    def _unfired(self) -> list[Fault]:
        rank = dist.get_rank() if dist.is_initialized() else -1
        fired = set(self.fired)
        return [f for f in self.faults if f.rank == rank and f.kind != "delay" and f.describe() not in fired]

    def finish_test(self) -> None:
        """End-of-test checks on a rank whose body passed: never-waited work, unmatched p2p, faults."""
        unfired = self._unfired()
        if unfired:
            raise InjectedFault(
                "planned fault(s) never fired on this rank: "
                + "; ".join(f.describe() for f in unfired)
                + ". The test issued fewer calls than the fault's at=; lower it so the error path runs."
            )
        self.check_unwaited()
        if self.channel is not None:
            self.channel.finish()

    def check_unwaited(self) -> None:
        """Strict mode: raise for async work never waited (end of a test, or of an ``hp-run`` script)."""
        if self.unwaited:
            lines = "\n".join(f"  {what} at {site}" for what, site in self.unwaited.values())
            self.unwaited = {}
            raise AsyncHazardError(
                "async work issued with async_op=True was never waited:\n"
                + lines
                + "\nOn a GPU its result would be read (or its buffers reused) while the collective is "
                "still running. Call .wait() on every work handle."
            )

    def end_test(self) -> list[str]:
        """Forget the test; return the faults that fired plus the ones that never did."""
        report = list(self.fired)
        report += [f"did NOT fire: {f.describe()} (the rank issued fewer calls)" for f in self._unfired()]
        self.channel = None
        self.faults = ()
        self.fired = []
        self.unwaited = {}
        return report

    # -- pieces ----------------------------------------------------------------------

    def _channel(self) -> SideChannel | None:
        if self.channel is None and self.checks and self.channel_factory is not None:
            self.channel = self.channel_factory()
        return self.channel

    def _fault(self, kind: str) -> Fault | None:
        if not self.faults:
            return None
        rank = dist.get_rank()
        index = self.counts[kind]
        self.counts[kind] = index + 1
        for fault in self.faults:
            if fault.rank != rank:
                continue
            if kind == "send" and fault.kind == "drop" and fault.at == index:
                self.fired.append(fault.describe())
                return fault
            if kind == "collective" and fault.kind != "drop" and (fault.at is None or fault.at == index):
                if fault.kind == "delay":
                    if fault.describe() not in self.fired:
                        self.fired.append(fault.describe())
                    time.sleep(fault.seconds)
                    continue
                self.fired.append(fault.describe())
                if fault.kind == "kill":
                    os._exit(fault.exit_code)
                message = f"injected fault: {fault.describe()}"
                self.post_failure(message)
                raise InjectedFault(message)
        return None

    def _track(self, call: Call) -> Callable[[CheckedWork], None]:
        token = object()
        self.unwaited[id(token)] = (call.shown, call.site)

        def waited(_: CheckedWork) -> None:
            self.unwaited.pop(id(token), None)

        return waited

    # -- collectives -----------------------------------------------------------------

    def run_collective(self, name: str, orig: Callable[..., Any], args: dict[str, Any]) -> Any:
        call = describe(name, args)
        # [Note: deferred async checks]
        finish = self.check_collective(call, defer=call.async_op and not self.profile.stream_ordered_p2p)
        shadows: Shadows | None = None
        if self.strict and call.async_op and call.kind == "collective":
            shadows = self._shadow(name, call, args)
        with _Nested():
            result = self._execute(name, orig, args, call)
        if not call.async_op:
            return result
        if shadows is None and finish is None:
            return result
        if shadows is not None:
            shadows.poison()
        return CheckedWork(
            result,
            [finish] if finish is not None else [],
            [shadows.settle] if shadows is not None else [],
            self._track(call) if shadows is not None else None,
        )

    def check_collective(self, call: Call, *, defer: bool = False) -> Callable[[], None] | None:
        """Rules, faults and cross-rank checks of one collective, classic or functional (:mod:`._funcol`).

        With ``defer`` the cross-rank comparison is returned for ``wait()``
        instead of made now ([Note: deferred async checks]).
        """
        call.site = call_site(2)
        self.calls += 1
        check_call(self.profile, call)
        self._fault("collective")
        channel = self._channel()
        if channel is not None:
            return channel.collective(call, defer=defer)
        return None

    def _shadow(self, name: str, call: Call, args: dict[str, Any]) -> Shadows:
        shadows = Shadows(call.shown, call.site)
        if name in ("all_reduce", "reduce") or (name == "broadcast" and call.root != dist.get_rank()):
            args["tensor"] = shadows.shadow_output("tensor", args["tensor"])
        elif name in ("all_gather_single", "all_gather_into_tensor"):
            args["output_tensor"] = shadows.shadow_output("output_tensor", args["output_tensor"])
        elif name in (
            "reduce_scatter_single",
            "reduce_scatter_tensor",
            "reduce_scatter",
            "all_to_all_single",
        ):
            args["output"] = shadows.shadow_output("output", args["output"])
        elif name == "all_gather":
            args["tensor_list"] = [
                shadows.shadow_output(f"tensor_list[{i}]", t) for i, t in enumerate(args["tensor_list"])
            ]
        elif name == "all_to_all":
            args["output_tensor_list"] = [
                shadows.shadow_output(f"output_tensor_list[{i}]", t)
                for i, t in enumerate(args["output_tensor_list"])
            ]
        for label, tensor in call.inputs:
            aliased = shadows.alias_in_shadow(tensor)
            if aliased is not None and label in args:
                args[label] = aliased  # an in-place collective's input: read it from the shadow
                continue
            shadows.snapshot_input(label, tensor)
        return shadows

    def _execute(self, name: str, orig: Callable[..., Any], args: dict[str, Any], call: Call) -> Any:
        if call.reduce_op == "premul_sum" and self.profile.emulated:
            self._emulate_premul(name, args, call)
        if self.profile.name == "nccl-emu" and call.dtype in _FP8 and name in _MOVES:
            for key, value in list(args.items()):
                args[key] = _bytes_view(value)
        if name == "all_gather" and call.uneven is not None:
            return self._uneven_all_gather(args, call)
        return orig(**args)

    def _emulate_premul(self, name: str, args: dict[str, Any], call: Call) -> None:
        """NCCL's PREMUL_SUM on gloo: scale locally, then SUM (the same result, see ReduceOp docs)."""
        factor = call.premul_factor if call.premul_factor is not None else 1.0
        args["op"] = dist.ReduceOp.SUM
        with torch.no_grad():
            if name in ("all_reduce", "reduce"):
                args["tensor"].mul_(factor)
            elif name in ("reduce_scatter_single", "reduce_scatter_tensor"):
                args["input"] = args["input"] * factor
            elif name == "reduce_scatter":
                args["input_list"] = [t * factor for t in args["input_list"]]

    def _uneven_all_gather(self, args: dict[str, Any], call: Call) -> Any:
        """NCCL and HCCL gather uneven lists; gloo refuses. Pad, gather once, slice out."""
        outputs: list[torch.Tensor] = list(args["tensor_list"])
        source: torch.Tensor = args["tensor"]
        largest = max(t.numel() for t in outputs)
        padded = source.new_zeros(largest)
        padded[: source.numel()].copy_(source.reshape(-1))
        buffer = source.new_empty(largest * len(outputs))
        _ORIGINALS["all_gather_single"](buffer, padded, group=call.group)
        for index, out in enumerate(outputs):
            out.copy_(buffer[index * largest : index * largest + out.numel()].view_as(out))
        return DoneWork() if call.async_op else None

    # -- point to point --------------------------------------------------------------

    def run_p2p(self, name: str, orig: Callable[..., Any], args: dict[str, Any]) -> Any:
        send = "send" in name
        tensor = args["tensor"]
        peer = args.get("dst" if send else "src")
        group_peer = args.get("group_dst" if send else "group_src")
        group = args.get("group")
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(group or _world(), group_peer)
        call = describe_p2p(name, tensor, peer, group, args.get("tag", 0))
        call.site = call_site(3)
        self.calls += 1
        check_call(self.profile, call)
        dropped = self._fault("send") is not None if send else False
        channel = self._channel()
        ticket = (
            channel.p2p_issue(call, dropped=dropped) if channel is not None and peer is not None else None
        )
        blocking = name in ("send", "recv")
        if not self.profile.p2p_tags:
            args["tag"] = 0  # NCCL and HCCL ignore tags and match in order; make gloo do the same
        if self.profile.name == "nccl-emu" and tensor.dtype in _FP8:
            args["tensor"] = tensor.view(torch.uint8)
        if blocking:
            if ticket is not None and channel is not None:
                channel.p2p_wait(ticket)  # gloo's send also waits for its receive
            if dropped:
                return None
            with _Nested():
                return orig(**args)
        shadows = None
        if self.strict:
            shadows = Shadows(call.shown, call.site)
            if send:
                shadows.snapshot_input("tensor", tensor)
            else:
                args["tensor"] = shadows.shadow_output("tensor", args["tensor"])
        before: list[Callable[[], None]] = []
        if ticket is not None and channel is not None and channel.posted(ticket):
            channel.p2p_wait(ticket)  # see [Note: checking both ends at issue]
        if dropped:
            work: Any = DoneWork()
        else:
            with _Nested():
                work = orig(**args)
        if ticket is not None and channel is not None:
            before.append(functools.partial(channel.p2p_wait, ticket))
        after = []
        if shadows is not None:
            shadows.poison()
            after.append(shadows.settle)
        if not before and not after:
            return work
        return CheckedWork(work, before, after, self._track(call) if self.strict else None)

    def run_batch(self, orig: Callable[..., Any], ops: list[Any]) -> Any:
        channel = self._channel()
        token = object()
        tickets = []
        real_ops = []
        shadows = Shadows("batch_isend_irecv", "") if self.strict else None
        for op in ops:
            send = op.op is _ORIGINALS["isend"] or op.op is c10d.isend
            name = "isend" if send else "irecv"
            call = describe_p2p(name, op.tensor, op.peer, op.group, op.tag)
            call.site = call_site(3)
            check_call(self.profile, call)
            dropped = self._fault("send") is not None if send else False
            ticket = channel.p2p_issue(call, batch=token, dropped=dropped) if channel is not None else None
            if ticket is not None:
                tickets.append(ticket)
            if dropped:
                continue
            tensor = op.tensor
            if shadows is not None:
                shadows.site = shadows.site or call.site
                if send:
                    shadows.snapshot_input(f"the tensor of {call.shown}", tensor)
                else:
                    tensor = shadows.shadow_output(f"the tensor of {call.shown}", tensor)
            if self.profile.name == "nccl-emu" and tensor.dtype in _FP8:
                tensor = tensor.view(torch.uint8)
            tag = op.tag if self.profile.p2p_tags else 0  # order matching, as on NCCL/HCCL
            if ticket is not None and channel is not None and channel.posted(ticket):
                channel.p2p_wait(ticket)  # see [Note: checking both ends at issue]
            if tensor is not op.tensor or tag != op.tag:
                op = dist.P2POp(op.op, tensor, op.peer, op.group, tag)
            real_ops.append(op)
        self.calls += 1
        with _Nested():
            works = list(orig(real_ops)) if real_ops else []
        before: list[Callable[[], None]] = []
        if channel is not None:
            before = [functools.partial(channel.p2p_wait, t) for t in tickets]
        after: list[Callable[[], object]] = []
        if shadows is not None:
            shadows.poison()
            after.append(shadows.settle)
        if not before and len(after) == 0:
            return works
        handles = works or [DoneWork()]
        # Waiting on any handle settles the whole batch: checks, every transfer, then the hand-over.
        first = CheckedWork(_AllWork(handles), before, after, None)
        # (the others must not wait their torch work again: a gloo send waited twice blocks forever)
        return [first] + [CheckedWork(DoneWork(), [first.wait], [], None) for _ in handles[1:]]

    def run_object_p2p(self, name: str, orig: Callable[..., Any], args: dict[str, Any]) -> Any:
        send = name == "send_object_list"
        peer = args.get("dst" if send else "src")
        group_peer = args.get("group_dst" if send else "group_src")
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(args.get("group") or _world(), group_peer)
        call = object_p2p(name, peer, args.get("group"))
        call.site = call_site(3)
        call.key = ("object_p2p", "objects", len(args["object_list"]))
        check_call(self.profile, call)
        channel = self._channel()
        if channel is not None and peer is not None:
            ticket = channel.p2p_issue(call)
            if not send or self.profile.stream_ordered_p2p:
                channel.p2p_wait(ticket)
        with _Nested():
            return orig(**args)


# -- installation -----------------------------------------------------------------------


def _wrap(name: str, orig: Callable[..., Any], runner: str) -> Callable[..., Any]:
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        layer = _LAYER
        if layer is None or _depth():
            return orig(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return getattr(layer, runner)(name, orig, dict(bound.arguments))

    wrapper.__hp_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _wrap_batch(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
        layer = _LAYER
        if layer is None or _depth():
            return orig(p2p_op_list)
        c10d._check_p2p_op_list(p2p_op_list)
        return layer.run_batch(orig, list(p2p_op_list))

    return batch_isend_irecv


def _emulated_backend(backend: Any) -> Any:
    """Map nccl/hccl (what library code asks for under emulation) back to gloo."""
    if isinstance(backend, str) and backend.lower() in ("nccl", "hccl"):
        return "gloo"
    return backend


def _wrap_group_factory(orig: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _LAYER is not None and _LAYER.profile.emulated:
            bound = signature.bind(*args, **kwargs)
            if "backend" in bound.arguments:
                bound.arguments["backend"] = _emulated_backend(bound.arguments["backend"])
            return orig(*bound.args, **bound.kwargs)
        return orig(*args, **kwargs)

    return factory


def install(profile_name: str, *, checks: bool = True, strict: bool = False) -> Layer:
    """Install the layer for ``profile_name`` in this process (idempotent); returns it."""
    global _LAYER
    profile = get_profile(profile_name)
    if _LAYER is not None:
        _LAYER.profile, _LAYER.checks, _LAYER.strict = profile, checks, strict
        _inject(profile)
        return _LAYER
    for name in (*COLLECTIVES, *P2P, *OBJECT_P2P):
        orig = getattr(dist, name, None)
        if orig is None:
            continue
        _ORIGINALS[name] = orig
        runner = "run_collective" if name in COLLECTIVES else "run_p2p" if name in P2P else "run_object_p2p"
        setattr(dist, name, _wrap(name, orig, runner))
    _ORIGINALS["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _wrap_batch(dist.batch_isend_irecv)
    for name in ("new_group", "init_process_group", "new_subgroups"):
        orig = getattr(dist, name, None)
        if orig is not None:
            _ORIGINALS[name] = orig
            setattr(dist, name, _wrap_group_factory(orig))
    _patch_p2pop()
    _LAYER = Layer(profile, checks=checks, strict=strict)
    install_functional(_LAYER.check_collective)
    install_functional_ops()  # a compiled graph's collectives, at every run ([Note: compiled graphs ...])
    _inject(profile)
    return _LAYER


def _patch_p2pop() -> None:
    """``dist.P2POp(dist.isend, ...)`` with our wrapper must still look like torch's isend."""
    originals = {dist.isend: _ORIGINALS["isend"], dist.irecv: _ORIGINALS["irecv"]}
    check = c10d._check_op
    init = c10d.P2POp.__init__
    _ORIGINALS["_check_op"] = check
    _ORIGINALS["P2POp.__init__"] = init

    def _check_op(op: Any) -> None:
        check(originals.get(op, op))

    def __init__(self: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        init(self, originals.get(op, op), *args, **kwargs)

    c10d._check_op = _check_op
    c10d.P2POp.__init__ = __init__  # type: ignore[method-assign]


def _inject(profile: Profile) -> None:
    """Platform and capability semantics of the profile (nothing for plain gloo)."""
    import hp_core
    from hp_core.capabilities import set_backend_semantics

    if profile.emulated:
        hp_core.set_platform(hp_core.Platform(profile.device_type, profile.backend, "cpu"))
        set_backend_semantics("gloo", profile.backend)
    else:
        hp_core.set_platform(None)
        set_backend_semantics("gloo", None)


def reinject() -> None:
    """Restore the profile's platform after a test (a test may have called set_platform)."""
    if _LAYER is not None and _LAYER.profile.emulated:
        _inject(_LAYER.profile)


def uninstall() -> None:
    """Undo :func:`install` (used by tests of the layer itself)."""
    global _LAYER
    if _LAYER is None:
        return
    for name, orig in _ORIGINALS.items():
        if name == "_check_op":
            c10d._check_op = orig
        elif name == "P2POp.__init__":
            c10d.P2POp.__init__ = orig  # type: ignore[method-assign]
        else:
            setattr(dist, name, orig)
    _ORIGINALS.clear()
    uninstall_functional()
    uninstall_functional_ops()
    _LAYER = None
    import hp_core
    from hp_core.capabilities import set_backend_semantics

    hp_core.set_platform(None)
    set_backend_semantics("gloo", None)

"""The communication of one unit: all-gather parameters in, reduce gradients out.

Per unit one all-gather in, one reduce-scatter out (and for HSDP one
all-reduce), fused into one buffer per direction ([Note: fused buckets],
beside :func:`all_gather_params`). Every reduction carries per-parameter
gradient flags and the unit's tag ([Note: gradient flags], [Note: one unit's
reduction met another's]).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import hp_core.collectives as hc
import torch

from hp_fsdp._profiling import labelled, of_kwarg, of_self
from hp_fsdp.param import FSDPParam
from hp_fsdp.post_forward import PostForwardMesh

__all__ = [
    "AllGatherHandle",
    "ReduceHandle",
    "ReducePlan",
    "Trailer",
    "all_gather_params",
    "all_reduce_replicated",
    "reduce_grads",
    "tag_of",
]


@contextlib.contextmanager
def _preserve_versions(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Refill gathered buffers without bumping their autograd version counters.

    Autograd saved views of these buffers in forward; refilling them with the
    same values before backward is not a modification it needs to know about
    (see [Note: stable unsharded views] in :mod:`hp_fsdp.param`).
    """
    # What torch.autograd._unsafe_preserve_version_counter does, for all tensors at once (one
    # context instead of one per tensor: this runs for every unit on every gather).
    versions = tuple(t._version for t in tensors)
    try:
        yield
    finally:
        torch._C._autograd._unsafe_set_version_counter(tuple(tensors), versions)


# -- all-gather ---------------------------------------------------------------------------


@dataclass
class AllGatherHandle:
    """An all-gather in flight; :meth:`finish` waits and copies out (once)."""

    params: list[FSDPParam]
    works: list[Any]
    output: torch.Tensor | None  # the fused W x S buffer, None when unfused
    sizes: list[int]
    world: int = 1  # ranks in the gather's group (the shard group, or a post-forward group)
    done: bool = False
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    fqn: str = ""  # the unit's, for its profiler label ([Note: profiler labels])

    @labelled("FSDP::all_gather_copy_out", of_self("fqn"))
    def finish(self) -> None:
        """Wait for the data and make every parameter's gathered view valid."""
        if self.done:
            return
        for work in self.works:
            work.wait()
        if self.versions:
            # The backend may write the output from its own thread at any time
            # before wait() returns: restore the versions seen at issue time.
            torch._C._autograd._unsafe_set_version_counter(
                tuple(b for b, _ in self.versions), tuple(v for _, v in self.versions)
            )
        if self.output is not None:
            world = self.world
            buffers = [p.alloc_unsharded(self.output.dtype) for p in self.params if not p.replicate]
            outs = [b.view(world, -1) for b in buffers]
            with _preserve_versions(buffers):
                torch.split_with_sizes_copy(self.output.view(world, -1), self.sizes, dim=1, out=outs)
            _release(self.output)
        for p in self.params:
            p.finish_copy_out()
        self.output = None
        self.works = []
        self.done = True


# [Note: fused buckets]
# With ``comm_fusion=True`` a unit issues one collective per direction no matter
# how many parameters it holds:
#
# * all-gather: each rank copies its padded shards of every parameter, cast to
#   the compute dtype, into its own segment of one flat output buffer
#   (*copy-in*; the all-gather input aliases that segment, so no separate input
#   buffer exists), gathers once, and then splits the ``W x S`` result into each
#   parameter's stable gathered buffer with one ``split_with_sizes_copy``
#   (*copy-out*, see [Note: stable unsharded views] in :mod:`hp_fsdp.param`);
# * reduce-scatter: the full gradients are chunked (padded like the shards) and
#   interleaved into one ``W x S`` buffer in the reduce dtype with one
#   ``_chunk_cat``, reduce-scattered once, and each parameter's gradient shard
#   is a slice of the ``S``-element result;
# * HSDP all-reduce: that ``S``-element result is all-reduced once across the
#   replicate dim.
#
# ``comm_fusion=False`` runs the same steps parameter by parameter (one
# collective per parameter) on the same padded layout, so both paths produce
# bit-identical numbers; it exists as a fallback and to measure what fusion
# buys.


@labelled("FSDP::all_gather", of_kwarg("fqn"))
def all_gather_params(
    params: Sequence[FSDPParam],
    group: Any,
    dtype_of: Callable[[FSDPParam], torch.dtype],
    *,
    fused: bool,
    post_forward: PostForwardMesh | None = None,
    fqn: str = "",
) -> AllGatherHandle:
    """Start gathering ``params`` (asynchronously); replicate params only get their local copy.

    ``dtype_of`` gives the gathered dtype of each param (the mixed-precision
    ``param_dtype`` or its own dtype). A fused gather needs one dtype, so a
    unit whose params would gather in different dtypes falls back to the
    unfused path (see [Note: fused buckets]). With ``post_forward`` the
    inputs are the pieces kept after forward and the gather runs over that
    smaller group instead of ``group``; the output is the same buffer
    ([Note: reshard to groups of N ranks] in :mod:`hp_fsdp.post_forward`).
    ``fqn`` names the unit in profiler labels.
    """
    sharded = [p for p in params if not p.replicate]
    for p in params:
        if p.replicate:
            buffer = p.alloc_unsharded(dtype_of(p))
            with _preserve_versions([buffer]):
                p.copy_in(buffer)
    if not sharded:
        return AllGatherHandle(list(params), [], None, [], done=False, fqn=fqn)
    if post_forward is None:
        world, rank = sharded[0].world, sharded[0].shard_rank
        sizes = [p.padded_numel for p in sharded]
        fill = FSDPParam.copy_in
    else:
        world, rank, group = post_forward.size, post_forward.rank, post_forward.group
        sizes = [p.padded_numel * (p.world // world) for p in sharded]
        fill = FSDPParam.copy_in_post_forward
    dtypes = {dtype_of(p) for p in sharded}
    if fused and len(dtypes) == 1:
        dtype = dtypes.pop()
        total = sum(sizes)
        device = sharded[0].device
        output = torch.empty(world * total, dtype=dtype, device=device)
        segment = output[rank * total : (rank + 1) * total]
        offset = 0
        for p, size in zip(sharded, sizes, strict=True):
            fill(p, segment[offset : offset + size])
            offset += size
        work = hc.all_gather_into_tensor(output, segment, group, async_op=True)
        return AllGatherHandle(list(params), [work], output, sizes, world, fqn=fqn)
    works = []
    versions = []
    for p, size in zip(sharded, sizes, strict=True):
        buffer = p.alloc_unsharded(dtype_of(p))
        versions.append((buffer, buffer._version))
        slot = p.slot(rank, size)
        with _preserve_versions([buffer]):
            fill(p, slot)
            works.append(hc.all_gather_into_tensor(buffer, slot, group, async_op=True))
    return AllGatherHandle(list(params), works, None, [], world, versions=versions, fqn=fqn)


# -- gradient reduction ---------------------------------------------------------------------


@dataclass(frozen=True)
class ReducePlan:
    """How gradients are reduced: ops and scale for the shard dim, the replicate dim and replicate params.

    See :meth:`hp_fsdp.param_group.FSDPParamGroup.reduce_plan` for how the
    user's reduce op type and divide factor map onto these.
    """

    shard_op: str
    shard_scale: float | None
    replicate_op: str
    replicate_scale: float | None
    full_op: str  # for replicate (DDP-style) params, over the whole data-parallel group
    full_scale: float | None


def _scaled(op: str, scale: float | None) -> dict[str, Any]:
    return {"op": op, "scale": scale} if op == "premul_sum" else {"op": op}


@dataclass
class ReduceHandle:
    """A reduce-scatter in flight for one unit; :meth:`finish` waits, all-reduces, assigns grads.

    Each output ends with its :class:`Trailer` ([Note: gradient flags],
    [Note: one unit's reduction met another's]); ``on_done`` receives, per
    parameter, whether it got a gradient on any rank, or None when the
    gradients stay pending (HSDP without the all-reduce).
    """

    params: list[FSDPParam]
    has_grad: list[bool]
    trainable: list[bool]
    works: list[Any]
    outputs: list[torch.Tensor]  # one fused buffer, or one per param
    offsets: list[int]
    trailers: list[Trailer]
    replicate_group: Any
    all_reduce: bool
    plan: ReducePlan
    main_grad: bool
    partial: Callable[[list[torch.Tensor], bool], list[torch.Tensor] | None]
    on_done: Callable[[list[bool] | None], None] | None = None
    done: bool = field(default=False)
    inputs: list[torch.Tensor] = field(default_factory=list)  # send buffers, freed once waited
    fqn: str = ""  # the unit's, for its profiler label ([Note: profiler labels])

    @labelled("FSDP::post_backward_rs_wait", of_self("fqn"))
    def finish(self) -> None:
        """Complete the reduction and accumulate every shard's gradient."""
        if self.done:
            return
        self.done = True
        for work in self.works:
            work.wait()
        self.works = []
        for send in self.inputs:
            _release(send)
        self.inputs = []
        for trailer in self.trailers:  # before anything adds to the outputs
            trailer.check_paired(self.params[0].world, self.plan.shard_op, self.plan.shard_scale)
        if self.replicate_group is not None:
            ready = self.partial(self.outputs, self.all_reduce)
            if ready is None:
                self._finish_callback(None)
                return  # grads stay pending in the partial buffer until an all-reducing step
            self.outputs = ready  # the same tensors, the earlier rows' partial sums added in
            for out in self.outputs:
                hc.all_reduce(
                    out,
                    group=self.replicate_group,
                    **_scaled(self.plan.replicate_op, self.plan.replicate_scale),
                )
        flags = [flag for trailer in self.trailers for flag in trailer.flags.unbind()]
        received = _received(self.has_grad, self.trainable, flags)
        for index, p in enumerate(self.params):
            if not received[index]:
                continue
            if len(self.outputs) == 1:
                flat = self.outputs[0][self.offsets[index] : self.offsets[index] + p.padded_numel]
            else:
                flat = self.outputs[index][: p.padded_numel]
            local = flat.view(p.padded_shape).narrow(p.shard_dim, 0, p.local_rows)
            p.accumulate_sharded_grad(local, main_grad=self.main_grad)
        self._finish_callback(received)

    def _finish_callback(self, received: list[bool] | None) -> None:
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done(received)


# [Note: gradient flags]
# A parameter may get a gradient on some ranks and not on others (a branch or
# an expert only some ranks' data take). The reduction is a collective every
# rank joins with the same buffer: a rank without a gradient contributes
# zeros. What it must then do with the reduced shard depends on the *other*
# ranks: if any had a gradient, the reduced shard is this rank's part of the
# true gradient and becomes ``.grad`` (keeping ``.grad`` unset there would
# leave the shard untrained and the ranks' shards inconsistent); if none had
# one, the parameter was unused everywhere and ``.grad`` stays unset, as
# after a single-process backward (an optimizer such as AdamW skips it; a
# zero gradient would still decay it).
#
# So every rank appends one element per parameter to its chunk of the send
# buffer: 1 where it has a gradient, 0 where not. The reduction sums (or
# averages, or scales) them with the gradients, so each rank receives, per
# parameter, a value that is positive exactly when some rank had a gradient
# (for HSDP the replicate-dim all-reduce folds in the other rows the same
# way). No extra collective: a few elements more in the one that runs anyway.
# They are read only when this rank lacks the gradient of a trainable
# parameter (reading is a device-to-host copy, which on an accelerator waits
# for the reduction); the common case, every trainable parameter with a local
# gradient, assigns without looking.
#
# [Note: one unit's reduction met another's]
# Whether a unit reduces is decided alike on every rank from its hooks, so the
# ranks' reductions pair up unit by unit, with one exception no rank can see
# locally: a unit whose forward ran on every rank but whose output reached
# the loss on some ranks only (``e = expert(h); if use: h = h + e``). Its
# backward, and so its reduction, then runs on those ranks only, and each
# later reduction meets a different unit's on the other ranks: mixed-up
# gradients of equal-sized units, or a hang. (An output unused on *every*
# rank is legitimate, and a rank cannot tell the two apart by itself.) So
# every reduction also carries the unit's tag, 16 elements of +1 or -1
# spelling a hash of the unit's name, which is the same on every rank (the
# names are compared by [Note: fully_shard agreement] in agreement.py). After
# the reduction an element is +-1 times the op's scale exactly when every rank
# put the same sign there; a rank that sent another unit's tag pulls it
# towards zero by 2/W of it, on every rank of the collective, so every rank
# raises, naming the unit, instead of training on mixed-up data. The check
# reads the tag, so it runs where the host has already waited for the result
# (buffers on the CPU); on an accelerator it would stall the host on every
# reduction, so there it is skipped (as in FSDP2, such a run hangs or
# aborts). It also needs a dtype fine enough to tell 1 from 1 - 2/W.

TAG_BITS = 16


def tag_of(name: str) -> int:
    """The 16-bit tag of a unit's name ([Note: one unit's reduction met another's])."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big")


@dataclass
class Trailer:
    """The elements after one output's gradients: a flag per parameter, then the unit's tag.

    ``flags`` and ``tag`` are views of the output; ``unit`` names the unit in errors.
    """

    flags: torch.Tensor
    tag: torch.Tensor
    tag_value: int
    unit: str

    @staticmethod
    def values(has_grad: list[bool], tag: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What this rank sends: 1 / 0 per parameter ([Note: gradient flags]), then the tag's signs.

        Only ever read (copied into send buffers), so it is built once per
        pattern: in steady training every step sends the same trailer, and no
        small host-to-device copy is issued per reduction.
        """
        return _trailer_values(tuple(has_grad), tag, dtype, torch.device(device))

    @classmethod
    def view(cls, out: torch.Tensor, start: int, count: int, tag: int, unit: str) -> Trailer:
        """The trailer of ``count`` parameters that starts at ``start`` of ``out``."""
        return cls(out[start : start + count], out[start + count : start + count + TAG_BITS], tag, unit)

    def check_paired(self, world: int, op: str, scale: float | None) -> None:
        """Raise if some rank's reduction was another unit's ([Note: one unit's reduction met another's])."""
        if world == 1 or self.tag.device.type != "cpu" or 4 * torch.finfo(self.tag.dtype).eps * world >= 1:
            return
        magnitude = {"avg": 1.0, "sum": float(world)}.get(op, world * (scale or 1.0))
        signs = Trailer.values([], self.tag_value, torch.float64, self.tag.device)
        agreed = self.tag.double() * signs >= magnitude * (1 - 1 / world)
        if bool(agreed.all()):
            return
        raise RuntimeError(
            f"hp_fsdp: the gradient reduction of unit {self.unit!r} met another unit's reduction on some "
            "rank: the ranks ran the backward of different units. A unit whose forward runs on every rank "
            "but whose output reaches the loss on some ranks only (e.g. `e = expert(h); if use: h = h + e`) "
            "runs its backward, and reduces, on those ranks only, so the ranks' collectives pair up wrongly "
            "(mixed-up gradients, or a hang). Let the output reach the loss on every rank (e.g. "
            "`h = h + e * use`, or add `0 * e.sum()` to the loss where it is unused), or run the unit's "
            "forward on every rank under the same condition. See [Note: one unit's reduction met another's]."
        )


@functools.lru_cache(maxsize=1024)
def _trailer_values(
    has_grad: tuple[bool, ...], tag: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    signs = [1.0 if tag >> bit & 1 else -1.0 for bit in range(TAG_BITS)]
    return torch.tensor([float(h) for h in has_grad] + signs, dtype=dtype, device=device)


def _received(has_grad: list[bool], trainable: list[bool], flags: Sequence[torch.Tensor]) -> list[bool]:
    """Per parameter: did any rank have a gradient ([Note: gradient flags])?"""
    if all(h or not t for h, t in zip(has_grad, trainable, strict=True)):
        return list(has_grad)  # every trainable parameter has a local gradient: nothing to read
    values = torch.stack([f.detach() for f in flags]).tolist() if flags else []
    return [h or v > 0 for h, v in zip(has_grad, values, strict=True)]


def _release(buffer: torch.Tensor) -> None:
    """Free a communication buffer's storage now that its collective has completed.

    [Note: releasing communication buffers]
    A backend's work object (gloo's, run from its own threads) may keep
    references to its input and output tensors a little after ``wait()``
    returns; when it drops them is up to the thread schedule. Dropping our own
    reference is then not enough to free a unit-sized buffer before the next
    unit allocates, which showed as a peak one block above torch's in some
    benchmark runs. The collective is complete, so the storage is released
    here explicitly; the tensor object may linger, empty.
    """
    buffer.untyped_storage().resize_(0)


def _padded_chunks(p: FSDPParam, grad: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``grad`` chunked over the ranks, each chunk zero-padded, into ``out`` (``W x padded_numel``).

    ``out`` may be a column slice of a wider send buffer (rows not contiguous
    with each other); each row is contiguous.
    """
    shaped = out.view(p.world, *p.padded_shape)
    if p.shard_dim == 0 and out.is_contiguous():
        torch._chunk_cat([grad], 0, p.world, out=out)
        return
    shaped.zero_()
    start = 0
    step = p.padded_shape[p.shard_dim]
    for rank in range(p.world):
        rows = max(0, min(step, p.shape[p.shard_dim] - start))
        if rows:
            shaped[rank].narrow(p.shard_dim, 0, rows).copy_(grad.narrow(p.shard_dim, start, rows))
        start += step


@labelled("FSDP::post_backward_reduce", of_kwarg("fqn"))
def reduce_grads(
    params: Sequence[FSDPParam],
    grads: list[torch.Tensor | None],
    *,
    shard_group: Any,
    replicate_group: Any,
    all_reduce: bool,
    plan: ReducePlan,
    reduce_dtype_of: Callable[[FSDPParam], torch.dtype],
    fused: bool,
    main_grad: bool,
    partial: Callable[[list[torch.Tensor], bool], list[torch.Tensor] | None],
    unit: str = "",
    fqn: str = "",
) -> ReduceHandle:
    """Start the reduce-scatter of the sharded params' full gradients (async), with their trailer.

    Issued whether or not this rank has any gradient (every rank must issue
    the same collective): a param without a gradient here contributes zeros,
    and the flags after each rank's chunk tell every rank which params got a
    gradient anywhere ([Note: gradient flags]); the unit's tag after them
    catches a reduction paired with another unit's ([Note: one unit's
    reduction met another's]). ``grads`` is emptied once copied into the send
    buffer, so the full gradients are freed before the output is allocated
    (the peak of backward is here, at the largest unit). ``unit`` is the
    name the tag spells, ``fqn`` the one profiler labels show.
    """
    has_grad = [g is not None for g in grads]
    trainable = [p.sharded_param.requires_grad for p in params]
    world = params[0].world
    tag = tag_of(unit)
    dtypes = {reduce_dtype_of(p) for p in params}
    # stand-ins for missing gradients in the dtype of the present ones (the compute dtype under mixed
    # precision), so the fused copy-in sees one input dtype
    like = next((g.dtype for g in grads if g is not None), None)
    full_grads: list[torch.Tensor] = [
        g if g is not None else torch.zeros(p.shape, dtype=like or reduce_dtype_of(p), device=p.device)
        for p, g in zip(params, grads, strict=True)
    ]
    grads.clear()
    if fused and len(dtypes) == 1:
        dtype = dtypes.pop()
        if len({g.dtype for g in full_grads}) > 1:  # e.g. accumulated (reduce dtype) beside fresh ones
            full_grads = [g.to(dtype) for g in full_grads]
        sizes = [p.padded_numel for p in params]
        total = sum(sizes)
        extra = len(params) + TAG_BITS
        device = full_grads[0].device
        send = torch.empty(world, total + extra, dtype=dtype, device=device)
        if all(p.shard_dim == 0 for p in params):
            # _chunk_cat casts into ``send`` but wants its inputs in one dtype: the gradients' (the trailer's
            # values are exact in any floating dtype)
            trailer = Trailer.values(has_grad, tag, full_grads[0].dtype, device).expand(world, extra)
            torch._chunk_cat([*full_grads, trailer], 0, world, out=send)
        else:
            offset = 0
            for p, g, size in zip(params, full_grads, sizes, strict=True):
                _padded_chunks(p, g, send[:, offset : offset + size])
                offset += size
            send[:, total:].copy_(Trailer.values(has_grad, tag, dtype, device))
        full_grads.clear()
        recv = torch.empty(total + extra, dtype=dtype, device=device)
        work = hc.reduce_scatter_tensor(
            recv, send.view(-1), group=shard_group, async_op=True, **_scaled(plan.shard_op, plan.shard_scale)
        )
        offsets = []
        offset = 0
        for size in sizes:
            offsets.append(offset)
            offset += size
        return ReduceHandle(
            list(params),
            has_grad,
            trainable,
            [work],
            [recv],
            offsets,
            [Trailer.view(recv, total, len(params), tag, unit)],
            replicate_group,
            all_reduce,
            plan,
            main_grad,
            partial,
            inputs=[send],
            fqn=fqn,
        )
    works = []
    outputs = []
    trailers = []
    for index, p in enumerate(params):
        g = full_grads[index]
        dtype = reduce_dtype_of(p)
        n = p.padded_numel
        send = torch.empty(world, n + 1 + TAG_BITS, dtype=dtype, device=g.device)
        values = Trailer.values([has_grad[index]], tag, g.dtype, g.device).expand(world, 1 + TAG_BITS)
        if p.shard_dim == 0:
            torch._chunk_cat([g, values], 0, world, out=send)
        else:
            _padded_chunks(p, g.to(dtype), send[:, :n])
            send[:, n:].copy_(values)
        del g
        full_grads[index] = send  # drop the full gradient; the send buffer is kept by the work anyway
        recv = torch.empty(n + 1 + TAG_BITS, dtype=dtype, device=send.device)
        works.append(
            hc.reduce_scatter_tensor(
                recv,
                send.view(-1),
                group=shard_group,
                async_op=True,
                **_scaled(plan.shard_op, plan.shard_scale),
            )
        )
        outputs.append(recv)
        trailers.append(Trailer.view(recv, n, 1, tag, unit))
    sends = list(full_grads)
    full_grads.clear()
    return ReduceHandle(
        list(params),
        has_grad,
        trainable,
        works,
        outputs,
        [],
        trailers,
        replicate_group,
        all_reduce,
        plan,
        main_grad,
        partial,
        inputs=sends,
        fqn=fqn,
    )


def all_reduce_replicated(
    params: Sequence[FSDPParam],
    grads: Sequence[torch.Tensor | None],
    *,
    group: Any,
    plan: ReducePlan,
    reduce_dtype_of: Callable[[FSDPParam], torch.dtype],
    fused: bool,
    main_grad: bool,
    unit: str = "",
) -> list[bool]:
    """DDP-style: all-reduce the full gradients of replicate params over the data-parallel group.

    Issued whether or not this rank has any gradient, with the same trailer as
    a reduce-scatter; returns, per param, whether any rank had a gradient
    ([Note: gradient flags]).
    """
    has_grad = [g is not None for g in grads]
    trainable = [p.sharded_param.requires_grad for p in params]
    tag = tag_of(unit)
    world = group.size() if group is not None else 1
    dtypes = {reduce_dtype_of(p) for p in params}
    full = [
        (g if g is not None else torch.zeros(p.shape, dtype=reduce_dtype_of(p), device=p.device))
        for p, g in zip(params, grads, strict=True)
    ]
    kwargs = _scaled(plan.full_op, plan.full_scale)
    if fused and len(dtypes) == 1:
        dtype = dtypes.pop()
        values = Trailer.values(has_grad, tag, dtype, full[0].device)
        flat = torch.cat([*(g.reshape(-1).to(dtype) for g in full), values])
        if group is not None:
            hc.all_reduce(flat, group=group, **kwargs)
        sizes = [p.numel for p in params]
        pieces: list[torch.Tensor] = list(flat.split([*sizes, len(values)])[:-1])
        trailers = [Trailer.view(flat, sum(sizes), len(params), tag, unit)]
    else:
        pieces, trailers = [], []
        for p, g, h in zip(params, full, has_grad, strict=True):
            dtype = reduce_dtype_of(p)
            buf = torch.cat([g.reshape(-1).to(dtype), Trailer.values([h], tag, dtype, g.device)])
            if group is not None:
                hc.all_reduce(buf, group=group, **kwargs)
            pieces.append(buf[: p.numel])
            trailers.append(Trailer.view(buf, p.numel, 1, tag, unit))
    for trailer in trailers:
        trailer.check_paired(world, plan.full_op, plan.full_scale)
    flags = [flag for trailer in trailers for flag in trailer.flags.unbind()]
    received = _received(has_grad, trainable, flags)
    for p, piece, flag in zip(params, pieces, received, strict=True):
        if flag:
            p.accumulate_sharded_grad(piece.view(p.shape), main_grad=main_grad)
    return received

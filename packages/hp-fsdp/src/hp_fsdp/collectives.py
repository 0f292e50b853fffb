"""The communication of one unit: all-gather parameters in, reduce gradients out.

[Note: fused buckets]
With ``comm_fusion=True`` a unit issues one collective per direction no matter
how many parameters it holds:

* all-gather: each rank copies its padded shards of every parameter, cast to
  the compute dtype, into its own segment of one flat output buffer
  (*copy-in*; the all-gather input aliases that segment, so no separate input
  buffer exists), gathers once, and then splits the ``W x S`` result into each
  parameter's stable gathered buffer with one ``split_with_sizes_copy``
  (*copy-out*, see [Note: stable unsharded views] in :mod:`hp_fsdp.param`);
* reduce-scatter: the full gradients are chunked (padded like the shards) and
  interleaved into one ``W x S`` buffer in the reduce dtype with one
  ``_chunk_cat``, reduce-scattered once, and each parameter's gradient shard
  is a slice of the ``S``-element result;
* HSDP all-reduce: that ``S``-element result is all-reduced once across the
  replicate dim.

``comm_fusion=False`` runs the same steps parameter by parameter (one
collective per parameter) on the same padded layout, so both paths produce
bit-identical numbers; it exists as a fallback and to measure what fusion
buys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import hp_core.collectives as hc
import torch

from hp_fsdp._profiling import labelled
from hp_fsdp.param import FSDPParam
from hp_fsdp.post_forward import PostForwardMesh

__all__ = ["AllGatherHandle", "ReduceHandle", "ReducePlan", "all_gather_params", "reduce_grads"]


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

    @labelled("FSDP::all_gather_copy_out")
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


@labelled("FSDP::all_gather")
def all_gather_params(
    params: Sequence[FSDPParam],
    group: Any,
    dtype_of: Callable[[FSDPParam], torch.dtype],
    *,
    fused: bool,
    post_forward: PostForwardMesh | None = None,
) -> AllGatherHandle:
    """Start gathering ``params`` (asynchronously); replicate params only get their local copy.

    ``dtype_of`` gives the gathered dtype of each param (the mixed-precision
    ``param_dtype`` or its own dtype). A fused gather needs one dtype, so a
    unit whose params would gather in different dtypes falls back to the
    unfused path (see [Note: fused buckets]). With ``post_forward`` the
    inputs are the pieces kept after forward and the gather runs over that
    smaller group instead of ``group``; the output is the same buffer
    ([Note: reshard to groups of N ranks] in :mod:`hp_fsdp.post_forward`).
    """
    sharded = [p for p in params if not p.replicate]
    for p in params:
        if p.replicate:
            buffer = p.alloc_unsharded(dtype_of(p))
            with _preserve_versions([buffer]):
                p.copy_in(buffer)
    if not sharded:
        return AllGatherHandle(list(params), [], None, [], done=False)
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
        return AllGatherHandle(list(params), [work], output, sizes, world)
    works = []
    versions = []
    for p, size in zip(sharded, sizes, strict=True):
        buffer = p.alloc_unsharded(dtype_of(p))
        versions.append((buffer, buffer._version))
        slot = p.slot(rank, size)
        with _preserve_versions([buffer]):
            fill(p, slot)
            works.append(hc.all_gather_into_tensor(buffer, slot, group, async_op=True))
    return AllGatherHandle(list(params), works, None, [], world, versions=versions)


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
    """A reduce-scatter in flight for one unit; :meth:`finish` waits, all-reduces, assigns grads."""

    params: list[FSDPParam]
    has_grad: list[bool]
    works: list[Any]
    outputs: list[torch.Tensor]  # one fused buffer, or one per param
    offsets: list[int]
    replicate_group: Any
    all_reduce: bool
    plan: ReducePlan
    main_grad: bool
    partial: Callable[[list[torch.Tensor], bool], list[torch.Tensor] | None]
    on_done: Callable[[], None] | None = None
    done: bool = field(default=False)
    inputs: list[torch.Tensor] = field(default_factory=list)  # send buffers, freed once waited

    @labelled("FSDP::post_backward_rs_wait")
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
        if self.replicate_group is not None:
            ready = self.partial(self.outputs, self.all_reduce)
            if ready is None:
                self._finish_callback()
                return  # grads stay pending in the partial buffer until an all-reducing step
            self.outputs = ready
            for out in self.outputs:
                hc.all_reduce(
                    out,
                    group=self.replicate_group,
                    **_scaled(self.plan.replicate_op, self.plan.replicate_scale),
                )
        for index, p in enumerate(self.params):
            if not self.has_grad[index]:
                continue
            if len(self.outputs) == 1:
                flat = self.outputs[0][self.offsets[index] : self.offsets[index] + p.padded_numel]
            else:
                flat = self.outputs[index]
            local = flat.view(p.padded_shape).narrow(p.shard_dim, 0, p.local_rows)
            p.accumulate_sharded_grad(local, main_grad=self.main_grad)
        self._finish_callback()

    def _finish_callback(self) -> None:
        if self.on_done is not None:
            self.on_done()
            self.on_done = None


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
    """Write ``grad`` chunked over the ranks, each chunk zero-padded, into ``out`` (``W x padded_numel``)."""
    if p.shard_dim == 0:
        torch._chunk_cat([grad], 0, p.world, out=out)
        return
    shaped = out.view(p.world, *p.padded_shape)
    shaped.zero_()
    start = 0
    step = p.padded_shape[p.shard_dim]
    for rank in range(p.world):
        rows = max(0, min(step, p.shape[p.shard_dim] - start))
        if rows:
            shaped[rank].narrow(p.shard_dim, 0, rows).copy_(grad.narrow(p.shard_dim, start, rows))
        start += step


@labelled("FSDP::post_backward_reduce")
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
) -> ReduceHandle | None:
    """Start the reduce-scatter of the sharded params' full gradients (async); None if no grads.

    A param without a gradient on this rank contributes zeros (every rank must
    issue the same collective) and keeps ``.grad`` unset. ``grads`` is emptied
    once copied into the send buffer, so the full gradients are freed before
    the output is allocated (the peak of backward is here, at the largest unit).
    """
    has_grad = [g is not None for g in grads]
    if not any(has_grad):
        return None
    world = params[0].world
    dtypes = {reduce_dtype_of(p) for p in params}
    full_grads: list[torch.Tensor] = [
        g if g is not None else torch.zeros(p.shape, dtype=reduce_dtype_of(p), device=p.device)
        for p, g in zip(params, grads, strict=True)
    ]
    grads.clear()
    if fused and len(dtypes) == 1:
        dtype = dtypes.pop()
        sizes = [p.padded_numel for p in params]
        total = sum(sizes)
        device = full_grads[0].device
        send = torch.empty(world, total, dtype=dtype, device=device)
        if all(p.shard_dim == 0 for p in params):
            torch._chunk_cat(full_grads, 0, world, out=send)
        else:
            offset = 0
            for p, g, size in zip(params, full_grads, sizes, strict=True):
                block = torch.empty(world, size, dtype=dtype, device=device)
                _padded_chunks(p, g, block)
                send[:, offset : offset + size].copy_(block)
                offset += size
        full_grads.clear()
        recv = torch.empty(total, dtype=dtype, device=device)
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
            [work],
            [recv],
            offsets,
            replicate_group,
            all_reduce,
            plan,
            main_grad,
            partial,
            inputs=[send],
        )
    works = []
    outputs = []
    for index, p in enumerate(params):
        g = full_grads[index]
        dtype = reduce_dtype_of(p)
        send = torch.empty(world, p.padded_numel, dtype=dtype, device=g.device)
        _padded_chunks(p, g.to(dtype), send)
        del g
        full_grads[index] = send  # drop the full gradient; the send buffer is kept by the work anyway
        recv = torch.empty(p.padded_numel, dtype=dtype, device=send.device)
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
    sends = list(full_grads)
    full_grads.clear()
    return ReduceHandle(
        list(params),
        has_grad,
        works,
        outputs,
        [],
        replicate_group,
        all_reduce,
        plan,
        main_grad,
        partial,
        inputs=sends,
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
) -> None:
    """DDP-style: all-reduce the full gradients of replicate params over the data-parallel group."""
    has_grad = [g is not None for g in grads]
    if not any(has_grad):
        return
    dtypes = {reduce_dtype_of(p) for p in params}
    full = [
        (g if g is not None else torch.zeros(p.shape, dtype=reduce_dtype_of(p), device=p.device))
        for p, g in zip(params, grads, strict=True)
    ]
    kwargs = _scaled(plan.full_op, plan.full_scale)
    if fused and len(dtypes) == 1:
        dtype = dtypes.pop()
        flat = torch.cat([g.reshape(-1).to(dtype) for g in full])
        if group is not None:
            hc.all_reduce(flat, group=group, **kwargs)
        pieces = flat.split([p.numel for p in params])
    else:
        reduced = []
        for p, g in zip(params, full, strict=True):
            buf = g.to(reduce_dtype_of(p)).contiguous().clone()
            if group is not None:
                hc.all_reduce(buf, group=group, **kwargs)
            reduced.append(buf.view(-1))
        pieces = tuple(reduced)
    for p, piece, flag in zip(params, pieces, has_grad, strict=True):
        if flag:
            p.accumulate_sharded_grad(piece.view(p.shape), main_grad=main_grad)

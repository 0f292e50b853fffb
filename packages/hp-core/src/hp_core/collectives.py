"""Collectives as thin functions over torch.distributed, with emulation where a backend falls short.

Signatures follow torch.distributed (same names, same argument order), with
three differences that exist for a reason:

* Synchronous calls return the result tensor instead of ``None`` so they
  compose (``all_reduce(t).sum()``); ``async_op=True`` returns a
  :class:`~hp_core.work.Work` whose ``wait()`` returns that tensor once it is
  final, including any post-processing an emulation needs.
* Reduce ops are named by strings: [Note: reduce op names].
* ``group`` may be a ``ProcessGroup``, a 1-D :class:`hp_core.mesh.DeviceMesh`
  or ``None`` (the default group).

Whether an operation runs natively or emulated is decided by
:mod:`hp_core.capabilities` ([Note: capability table]); every argument is
checked before any communication starts (see :mod:`hp_core._checks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from hp_core import _issue
from hp_core._checks import (
    check_async_op,
    check_group_rank,
    check_same_dtype,
    check_tensor,
    group_facts,
    object_device_ready,
    resolve_group,
)
from hp_core.capabilities import REDUCE_OPS, BackendCapabilities, capabilities_for
from hp_core.carriers import Carrier, carrier_for
from hp_core.work import Work

__all__ = [
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object",
    "reduce_scatter_tensor",
]

# [Note: reduce op names]
# Reduce ops are named by strings (``"sum"``, ``"avg"``, ``"max"``, ``"min"``,
# ``"product"``, ``"premul_sum"``); torch ``ReduceOp`` values for the first
# five are accepted too. ``premul_sum`` takes ``scale=``; a gradient divide
# factor ``f`` is ``op="premul_sum", scale=1 / f``.
ReduceOpLike = str | dist.ReduceOp | dist.ReduceOp.RedOpType

_NATIVE_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
_OP_NAMES = {value: key for key, value in _NATIVE_OPS.items()}


@dataclass(frozen=True)
class _ReducePlan:
    """How one reduction runs: the op handed to torch, and the emulation around it."""

    op: Any
    pre_scale: float | None = None  # multiply inputs by this before summing (emulated premul_sum)
    divide_by: int | None = None  # divide the result by this on wait() (emulated avg)


def _op_name(fn: str, op: Any) -> str:
    if isinstance(op, str):
        name = op.lower()
        if name in REDUCE_OPS:
            return name
    else:
        try:
            found = _OP_NAMES.get(op)
        except TypeError:  # unhashable ReduceOp objects (e.g. a premul_sum built by torch)
            found = None
        if found is not None:
            return found
    raise ValueError(
        f"{fn}(): unsupported reduce op {op!r}; use one of {list(REDUCE_OPS)} "
        "(for a pre-multiplied sum pass op='premul_sum', scale=factor)."
    )


def _plan_reduce(
    fn: str,
    op: ReduceOpLike,
    scale: float | None,
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    caps: BackendCapabilities,
) -> _ReducePlan:
    name = _op_name(fn, op)
    if name == "premul_sum":
        if scale is None or isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(
                f"{fn}(): op='premul_sum' needs a numeric scale=, got {scale!r}; "
                "e.g. scale=1 / world_size for a mean."
            )
    elif scale is not None:
        raise ValueError(
            f"{fn}(): scale={scale!r} only applies to op='premul_sum', but op={name!r}; "
            "drop scale or use op='premul_sum'."
        )
    if name in ("avg", "premul_sum") and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(
            f"{fn}(): op={name!r} needs a floating-point tensor, got dtype {tensor.dtype}; "
            "use op='sum' and divide yourself, or cast to a floating dtype first."
        )
    if name in caps.reduce_ops:
        if name == "premul_sum":
            return _ReducePlan(dist._make_nccl_premul_sum(float(scale)))  # type: ignore[arg-type]
        return _ReducePlan(_NATIVE_OPS[name])
    if name == "avg":
        return _ReducePlan(dist.ReduceOp.SUM, divide_by=group_facts(group).size)
    if name == "premul_sum":
        return _ReducePlan(dist.ReduceOp.SUM, pre_scale=float(scale))  # type: ignore[arg-type]
    raise ValueError(
        f"{fn}(): backend {caps.backend!r} cannot run op={name!r} natively and hp_core has no "
        f"emulation for it; use one of {sorted(caps.reduce_ops | {'avg', 'premul_sum'})}."
    )


def _finish(work: Work[Any], async_op: bool) -> Any:
    return work if async_op else work.wait()


def _check_sizes(fn: str, name: str, sizes: Sequence[int], world_size: int) -> list[int]:
    values = list(sizes)
    if len(values) != world_size:
        raise ValueError(
            f"{fn}(): {name} has {len(values)} entries {values} but the group has {world_size} ranks; "
            "pass one size per rank of the group, in group-rank order."
        )
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{fn}(): {name}={values} must hold non-negative ints; {value!r} is not one.")
    return values


def _moved(fn: str, caps: BackendCapabilities, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors of a data-moving collective as the backend carries them ([Note: dtype carriers]).

    Moving never looks at values, so an unsupported dtype travels as a
    same-width view of the same memory: the results land in the caller's
    tensors with no copy, and a supported dtype is passed through untouched.
    """
    carrier = carrier_for(fn, caps.backend, tensors[0].dtype)
    if carrier is None:
        return tensors
    return tuple(carrier.there(t) for t in tensors)


def _wire_out(carrier: Carrier | None, output: torch.Tensor) -> torch.Tensor:
    """Where a reduction's result travels: the output itself, a view of it, or a fresh carrier buffer."""
    if carrier is None:
        return output
    if carrier.shares_memory:
        return output.view(carrier.dtype)
    return torch.empty(output.shape, dtype=carrier.dtype, device=output.device)


# -- all_reduce ---------------------------------------------------------------


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
    *,
    scale: float | None = ...,
) -> torch.Tensor: ...


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
    scale: float | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike,
    group: Any,
    async_op: Literal[True],
    *,
    scale: float | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = ...,
    group: Any = ...,
    async_op: bool = ...,
    *,
    scale: float | None = ...,
) -> torch.Tensor | Work[torch.Tensor]: ...


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = "sum",
    group: Any = None,
    async_op: bool = False,
    *,
    scale: float | None = None,
) -> torch.Tensor | Work[torch.Tensor]:
    """Reduce ``tensor`` in place across the group; returns it (or a :class:`Work` for it).

    ``avg`` and ``premul_sum`` are emulated where the backend lacks them (see
    [Note: capability table]); with ``async_op=True`` the emulated divide runs
    inside ``wait()``, so read the tensor only after waiting.
    """
    fn = "all_reduce"
    check_async_op(fn, async_op)
    check_tensor(fn, "tensor", tensor)
    pg = resolve_group(fn, group)
    caps = capabilities_for(pg, tensor.device.type)
    plan = _plan_reduce(fn, op, scale, tensor, pg, caps)
    carrier = carrier_for(fn, caps.backend, tensor.dtype, _op_name(fn, op))
    wire = tensor
    if carrier is not None:
        wire = carrier.there(tensor)
        if carrier.op is not None:
            plan = _plan_reduce(fn, carrier.op, scale, wire, pg, caps)
    if plan.pre_scale is not None:
        wire.mul_(plan.pre_scale)
    handle = _issue.all_reduce(wire, plan.op, pg)
    divide_by = plan.divide_by
    if divide_by is None and (carrier is None or carrier.shares_memory):
        return _finish(Work([handle], None, tensor), async_op)

    def post() -> None:
        if divide_by is not None:
            wire.div_(divide_by)
        if carrier is not None:
            carrier.back(wire, tensor)

    return _finish(Work([handle], post, tensor), async_op)


# -- all_gather ---------------------------------------------------------------


def _gather_even(
    output: torch.Tensor,
    input: torch.Tensor,
    pg: dist.ProcessGroup,
    world_size: int,
    caps: BackendCapabilities,
) -> Any:
    if caps.all_gather_into_tensor:
        # Backends disagree on the output layouts they accept (gloo wants exactly
        # (world_size * d0, ...), NCCL also takes (world_size, d0, ...)); hand
        # every backend the concatenated view of the same memory.
        if input.dim() == 0:
            concatenated = output.view(world_size)
        else:
            concatenated = output.view(world_size * input.shape[0], *input.shape[1:])
        # all_gather_single / reduce_scatter_single are torch 2.13's names for the
        # fused *_tensor collectives, which now warn as deprecated.
        return _issue.all_gather(concatenated, input, pg)
    if _issue.tracing():  # the functional gather needs no fused c10d support
        return _issue.all_gather(output.view(world_size, *input.shape), input, pg)
    # Views of a contiguous output split along its first dimension are contiguous.
    chunks = list(output.view(world_size, *input.shape).unbind(0))
    return dist.all_gather(chunks, input, group=pg, async_op=True)


@overload
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = ...,
    async_op: Literal[False] = ...,
    *,
    input_sizes: Sequence[int] | None = ...,
) -> torch.Tensor: ...


@overload
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = ...,
    *,
    async_op: Literal[True],
    input_sizes: Sequence[int] | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any,
    async_op: Literal[True],
    *,
    input_sizes: Sequence[int] | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = ...,
    async_op: bool = ...,
    *,
    input_sizes: Sequence[int] | None = ...,
) -> torch.Tensor | Work[torch.Tensor]: ...


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    input_sizes: Sequence[int] | None = None,
) -> torch.Tensor | Work[torch.Tensor]:
    """Concatenate every rank's ``input_tensor`` along dim 0 into ``output_tensor``.

    Even case (``input_sizes=None``): ``output_tensor`` holds ``world_size``
    times the input's elements, as in torch. Uneven case: ``input_sizes[r]``
    is group rank ``r``'s size along dim 0 (every rank passes the same list),
    and ``output_tensor`` has shape ``(sum(input_sizes), *input.shape[1:])``.
    Uneven inputs are padded to the largest size, gathered once, and sliced
    into ``output_tensor`` on ``wait()``.
    """
    fn = "all_gather_into_tensor"
    check_async_op(fn, async_op)
    check_tensor(fn, "output_tensor", output_tensor)
    check_tensor(fn, "input_tensor", input_tensor)
    check_same_dtype(fn, "input_tensor", input_tensor, "output_tensor", output_tensor)
    pg = resolve_group(fn, group)
    world_size = group_facts(pg).size
    caps = capabilities_for(pg, input_tensor.device.type)
    result = output_tensor
    output_tensor, input_tensor = _moved(fn, caps, output_tensor, input_tensor)

    if input_sizes is None:
        expected = world_size * input_tensor.numel()
        if output_tensor.numel() != expected:
            raise ValueError(
                f"{fn}(): output_tensor has {output_tensor.numel()} elements (shape "
                f"{tuple(output_tensor.shape)}) but {world_size} ranks x input shape "
                f"{tuple(input_tensor.shape)} gather {expected}; allocate "
                f"torch.empty(({world_size} * {input_tensor.shape[0] if input_tensor.dim() else 1}, ...)), "
                "or pass input_sizes= if the ranks' sizes differ."
            )
        handle = _gather_even(output_tensor, input_tensor, pg, world_size, caps)
        return _finish(Work([handle], None, result), async_op)

    sizes = _check_sizes(fn, "input_sizes", input_sizes, world_size)
    if input_tensor.dim() == 0:
        raise ValueError(
            f"{fn}(): input_sizes= needs at least a 1-D input_tensor, got a 0-D tensor; use .view(1)."
        )
    group_rank = group_facts(pg).rank
    if input_tensor.shape[0] != sizes[group_rank]:
        raise ValueError(
            f"{fn}(): input_sizes[{group_rank}]={sizes[group_rank]} (this rank's entry) but input_tensor has "
            f"size {input_tensor.shape[0]} along dim 0 (shape {tuple(input_tensor.shape)}); pass the same "
            "input_sizes on every rank, listing each rank's dim-0 size."
        )
    rest = tuple(input_tensor.shape[1:])
    expected_shape = (sum(sizes), *rest)
    if tuple(output_tensor.shape) != expected_shape:
        raise ValueError(
            f"{fn}(): output_tensor has shape {tuple(output_tensor.shape)} but input_sizes={sizes} with "
            f"trailing shape {rest} gather into {expected_shape}; allocate torch.empty({expected_shape})."
        )
    largest = max(sizes)
    if all(size == largest for size in sizes):
        handle = _gather_even(output_tensor, input_tensor, pg, world_size, caps)
        return _finish(Work([handle], None, result), async_op)

    padded = input_tensor.new_zeros((largest, *rest))
    padded[: input_tensor.shape[0]].copy_(input_tensor)
    buffer = input_tensor.new_empty((world_size * largest, *rest))
    handle = _gather_even(buffer, padded, pg, world_size, caps)

    def copy_out() -> None:
        offset = 0
        for rank, size in enumerate(sizes):
            output_tensor[offset : offset + size].copy_(buffer[rank * largest : rank * largest + size])
            offset += size

    return _finish(Work([handle], copy_out, result), async_op)


# -- reduce_scatter -----------------------------------------------------------


@overload
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOpLike = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
    *,
    scale: float | None = ...,
) -> torch.Tensor: ...


@overload
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOpLike = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
    scale: float | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOpLike,
    group: Any,
    async_op: Literal[True],
    *,
    scale: float | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOpLike = ...,
    group: Any = ...,
    async_op: bool = ...,
    *,
    scale: float | None = ...,
) -> torch.Tensor | Work[torch.Tensor]: ...


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOpLike = "sum",
    group: Any = None,
    async_op: bool = False,
    *,
    scale: float | None = None,
) -> torch.Tensor | Work[torch.Tensor]:
    """Reduce ``input`` across the group and leave chunk ``group_rank`` (dim 0) in ``output``.

    ``input`` holds ``world_size`` times ``output``'s elements and is not
    modified. An emulated ``premul_sum`` scales a copy of ``input`` (one extra
    input-sized buffer); a backend without a fused reduce-scatter all-reduces a
    copy and keeps this rank's chunk.
    """
    fn = "reduce_scatter_tensor"
    check_async_op(fn, async_op)
    check_tensor(fn, "output", output)
    check_tensor(fn, "input", input)
    check_same_dtype(fn, "input", input, "output", output)
    pg = resolve_group(fn, group)
    world_size = group_facts(pg).size
    if input.numel() != world_size * output.numel():
        raise ValueError(
            f"{fn}(): input has {input.numel()} elements (shape {tuple(input.shape)}) but must hold "
            f"{world_size} ranks x output's {output.numel()} (shape {tuple(output.shape)}) = "
            f"{world_size * output.numel()}; size output as input.numel() // {world_size}."
        )
    caps = capabilities_for(pg, input.device.type)
    plan = _plan_reduce(fn, op, scale, input, pg, caps)
    carrier = carrier_for(fn, caps.backend, input.dtype, _op_name(fn, op))
    wire_in, wire_out = input, output
    if carrier is not None:
        wire_in, wire_out = carrier.there(input), _wire_out(carrier, output)
        if carrier.op is not None:
            plan = _plan_reduce(fn, carrier.op, scale, wire_in, pg, caps)
    # A view carrier shares the caller's tensors (the input must stay unmodified).
    shares_memory = carrier is None or carrier.shares_memory
    source = wire_in * plan.pre_scale if plan.pre_scale is not None else wire_in
    divide_by = plan.divide_by

    def carry_back() -> None:
        if carrier is not None:
            carrier.back(wire_out, output)

    if caps.reduce_scatter_tensor:
        handle = _issue.reduce_scatter(wire_out, source, plan.op, pg)
        if divide_by is None and shares_memory:
            return _finish(Work([handle], None, output), async_op)

        def finish() -> None:
            if divide_by is not None:
                wire_out.div_(divide_by)
            carry_back()

        return _finish(Work([handle], finish, output), async_op)

    buffer = wire_in.clone() if source is wire_in and shares_memory else source
    handle = _issue.all_reduce(buffer, plan.op, pg)
    group_rank = group_facts(pg).rank

    def keep_chunk() -> None:
        wire_out.copy_(buffer.view(world_size, -1)[group_rank].view_as(wire_out))
        if divide_by is not None:
            wire_out.div_(divide_by)
        carry_back()

    return _finish(Work([handle], keep_chunk, output), async_op)


# -- all_to_all ---------------------------------------------------------------


def _splits(
    fn: str, name: str, tensor: torch.Tensor, sizes: Sequence[int] | None, world_size: int
) -> list[int]:
    if sizes is not None:
        values = _check_sizes(fn, name, sizes, world_size)
        if sum(values) != tensor.shape[0]:
            raise ValueError(
                f"{fn}(): {name}={values} add up to {sum(values)} but the tensor has size "
                f"{tensor.shape[0]} along dim 0 (shape {tuple(tensor.shape)}); make them add up."
            )
        return values
    if tensor.shape[0] % world_size != 0:
        raise ValueError(
            f"{fn}(): {name} is None, so dim 0 (size {tensor.shape[0]}, shape {tuple(tensor.shape)}) must "
            f"divide evenly over {world_size} ranks; pad it or pass {name}= explicitly."
        )
    return [tensor.shape[0] // world_size] * world_size


@overload
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = ...,
    input_split_sizes: Sequence[int] | None = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = ...,
    input_split_sizes: Sequence[int] | None = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
) -> Work[torch.Tensor]: ...


@overload
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
    group: Any,
    async_op: Literal[True],
) -> Work[torch.Tensor]: ...


@overload
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = ...,
    input_split_sizes: Sequence[int] | None = ...,
    group: Any = ...,
    async_op: bool = ...,
) -> torch.Tensor | Work[torch.Tensor]: ...


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> torch.Tensor | Work[torch.Tensor]:
    """Send chunk ``j`` of ``input`` (dim 0) to group rank ``j``; receive chunk ``i`` of ``output``.

    ``None`` splits mean equal chunks. Splits must agree across ranks (rank
    ``i``'s ``input_split_sizes[j]`` equals rank ``j``'s
    ``output_split_sizes[i]``); that needs communication to check, so a
    mismatch is not caught here and surfaces as a backend error or a hang.
    """
    fn = "all_to_all_single"
    check_async_op(fn, async_op)
    check_tensor(fn, "output", output)
    check_tensor(fn, "input", input)
    check_same_dtype(fn, "input", input, "output", output)
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError(
            f"{fn}(): input and output must be at least 1-D; got shapes {tuple(input.shape)} "
            f"and {tuple(output.shape)}."
        )
    if input.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"{fn}(): input shape {tuple(input.shape)} and output shape {tuple(output.shape)} must agree "
            "beyond dim 0 (only dim-0 chunks move between ranks)."
        )
    pg = resolve_group(fn, group)
    world_size = group_facts(pg).size
    in_splits = _splits(fn, "input_split_sizes", input, input_split_sizes, world_size)
    out_splits = _splits(fn, "output_split_sizes", output, output_split_sizes, world_size)
    caps = capabilities_for(pg, input.device.type)
    result = output
    output, input = _moved(fn, caps, output, input)

    if caps.all_to_all_single:
        handle = _issue.all_to_all(
            output,
            input,
            None if output_split_sizes is None else out_splits,
            None if input_split_sizes is None else in_splits,
            pg,
        )
        return _finish(Work([handle], None, result), async_op)

    # Emulation: one batch of point-to-point transfers; the own chunk is a local copy.
    _issue.refuse_when_tracing(fn)
    group_rank = group_facts(pg).rank
    ranks = dist.get_process_group_ranks(pg)
    in_chunks = input.split(in_splits)
    out_chunks = output.split(out_splits)
    ops = []
    for peer in range(world_size):
        if peer == group_rank:
            continue
        if in_splits[peer]:
            ops.append(dist.P2POp(dist.isend, in_chunks[peer], ranks[peer], pg))
        if out_splits[peer]:
            ops.append(dist.P2POp(dist.irecv, out_chunks[peer], ranks[peer], pg))
    out_chunks[group_rank].copy_(in_chunks[group_rank])
    handles = dist.batch_isend_irecv(ops) if ops else []
    return _finish(Work(handles, None, result), async_op)


# -- broadcast and barrier ------------------------------------------------------


def _broadcast_source(fn: str, src: int | None, group_src: int | None, pg: dist.ProcessGroup) -> int:
    """Validate the source and return it as a group rank."""
    if (src is None) == (group_src is None):
        raise ValueError(
            f"{fn}(): pass exactly one of src (a global rank) or group_src (a rank within the group); "
            f"got src={src!r}, group_src={group_src!r}."
        )
    if src is not None:
        return check_group_rank(fn, "src", src, pg)
    world_size = group_facts(pg).size
    if not isinstance(group_src, int) or isinstance(group_src, bool) or not 0 <= group_src < world_size:
        raise ValueError(
            f"{fn}(): group_src={group_src!r} must be an int in [0, {world_size}) for this group."
        )
    return group_src


@overload
def broadcast(
    tensor: torch.Tensor,
    src: int | None = ...,
    group: Any = ...,
    async_op: Literal[False] = ...,
    *,
    group_src: int | None = ...,
) -> torch.Tensor: ...


@overload
def broadcast(
    tensor: torch.Tensor,
    src: int | None = ...,
    group: Any = ...,
    *,
    async_op: Literal[True],
    group_src: int | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def broadcast(
    tensor: torch.Tensor,
    src: int | None,
    group: Any,
    async_op: Literal[True],
    *,
    group_src: int | None = ...,
) -> Work[torch.Tensor]: ...


@overload
def broadcast(
    tensor: torch.Tensor,
    src: int | None = ...,
    group: Any = ...,
    async_op: bool = ...,
    *,
    group_src: int | None = ...,
) -> torch.Tensor | Work[torch.Tensor]: ...


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    *,
    group_src: int | None = None,
) -> torch.Tensor | Work[torch.Tensor]:
    """Copy ``tensor`` from the source rank to every rank of the group, in place."""
    fn = "broadcast"
    check_async_op(fn, async_op)
    check_tensor(fn, "tensor", tensor)
    pg = resolve_group(fn, group)
    source = _broadcast_source(fn, src, group_src, pg)
    (wire,) = _moved(fn, capabilities_for(pg, tensor.device.type), tensor)
    handle = _issue.broadcast(wire, source, pg)
    return _finish(Work([handle], None, tensor), async_op)


@overload
def barrier(group: Any = ..., async_op: Literal[False] = ...) -> None: ...


@overload
def barrier(group: Any = ..., *, async_op: Literal[True]) -> Work[None]: ...


@overload
def barrier(group: Any, async_op: Literal[True]) -> Work[None]: ...


@overload
def barrier(group: Any = ..., async_op: bool = ...) -> Work[None] | None: ...


def barrier(group: Any = None, async_op: bool = False) -> Work[None] | None:
    """Wait until every rank of the group reached this point."""
    check_async_op("barrier", async_op)
    pg = resolve_group("barrier", group)
    handle = dist.barrier(group=pg, async_op=True)
    return _finish(Work([handle], None, None), async_op)


# -- objects ------------------------------------------------------------------


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order (e.g. to agree on uneven sizes)."""
    pg = resolve_group("all_gather_object", group)
    gathered: list[Any] = [None] * group_facts(pg).size
    object_device_ready(pg)
    dist.all_gather_object(gathered, obj, group=pg)
    return gathered


def broadcast_object(
    obj: Any, src: int | None = None, group: Any = None, *, group_src: int | None = None
) -> Any:
    """The source rank's picklable ``obj`` on every rank (others pass anything, e.g. ``None``)."""
    fn = "broadcast_object"
    pg = resolve_group(fn, group)
    source = _broadcast_source(fn, src, group_src, pg)
    box = [obj]
    object_device_ready(pg)
    dist.broadcast_object_list(box, group=pg, group_src=source)
    return box[0]

"""Where a collective is finally issued: c10d in eager mode, functional collectives while tracing.

Traced by ``torch.compile``, an async c10d call and its later wait would have
no data dependency in the graph (wrong values, no error), so while tracing each
collective is issued as the matching functional collective
([Note: collectives under torch.compile]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce_scatter",
    "refuse_when_tracing",
    "tracing",
]

_FUNCOL_OPS: dict[Any, str] = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product",
}


def _funcol() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


# [Note: collectives under torch.compile]
# hp_core's collectives call c10d with ``async_op=True`` and wait on the
# handle later. Traced by ``torch.compile`` (AOTAutograd runs hp_dtensor's op
# rules under fake tensors and functionalization), such a call would enter the
# graph with no data dependency between the collective and its wait: the
# compiled graph then reads the output before it is written (wrong values, no
# error). While tracing, each collective is therefore issued as the matching
# *functional* collective (``torch.distributed._functional_collectives``): an
# out-of-place op whose result flows through ``wait_tensor``, which the
# compiler orders, and later passes may overlap with compute. The result is
# copied into the output the eager API promises (functionalization turns the
# copy into a plain dataflow edge), and the returned handle is ``None``: the
# caller's :class:`~hp_core.work.Work` then only runs its post-processing (an
# emulated average's divide, an uneven gather's copy-out), so every emulation
# behaves the same traced and eager. Point-to-point operations have no
# functional form: traced, they raise instead of miscompiling.
def tracing() -> bool:
    """Whether torch.compile (dynamo, or AOTAutograd's fake / proxy tracing) is running this code."""
    if torch.compiler.is_compiling():
        return True
    return bool(_funcol()._are_we_tracing())


def refuse_when_tracing(fn: str) -> None:
    """A c10d-only operation (point-to-point, objects) cannot be traced: say so, never miscompile."""
    if tracing():
        raise RuntimeError(
            f"hp_core.{fn}() was called while torch.compile traces; it has no functional form, so a "
            "compiled graph could not order it. Run it outside the compiled region (e.g. in a function "
            "wrapped with torch.compiler.disable)."
        )


def _op_name(op: Any) -> str:
    try:
        name = _FUNCOL_OPS.get(op)
    except TypeError:  # an unhashable ReduceOp (premul_sum built by torch)
        name = None
    if name is None:
        raise RuntimeError(
            f"hp_core: reduce op {op!r} has no functional-collective form while torch.compile traces; "
            "use 'sum', 'avg', 'max', 'min' or 'product' inside compiled regions."
        )
    return name


def all_reduce(tensor: torch.Tensor, op: Any, group: dist.ProcessGroup) -> Any:
    """In-place all-reduce of ``tensor``; the c10d handle, or None once done functionally."""
    if tracing():
        tensor.copy_(_funcol().all_reduce(tensor, _op_name(op), group))
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Gather every rank's ``input`` along dim 0 into ``output`` (the concatenated view)."""
    if tracing():
        flat = input if input.dim() > 0 else input.view(1)
        output.copy_(_funcol().all_gather_tensor(flat, 0, group).view(output.shape))
        return None
    return dist.all_gather_single(output, input, group=group, async_op=True)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, group: dist.ProcessGroup) -> Any:
    """Reduce ``input`` over the group and keep this rank's dim-0 chunk in ``output``."""
    if tracing():
        world = dist.get_world_size(group)
        rows = input.reshape(world, -1)
        output.copy_(_funcol().reduce_scatter_tensor(rows, _op_name(op), 0, group).view(output.shape))
        return None
    return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=True)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: dist.ProcessGroup,
) -> Any:
    """Exchange dim-0 chunks of ``input`` with every rank into ``output``."""
    if tracing():
        result = _funcol().all_to_all_single(input, output_split_sizes, input_split_sizes, group)
        output.copy_(result.view(output.shape))
        return None
    return dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=True
    )


def broadcast(tensor: torch.Tensor, group_src: int, group: dist.ProcessGroup) -> Any:
    """Overwrite ``tensor`` with group rank ``group_src``'s copy."""
    if tracing():
        src = dist.get_global_rank(group, group_src)
        tensor.copy_(_funcol().broadcast(tensor, src, group))
        return None
    return dist.broadcast(tensor, group=group, async_op=True, group_src=group_src)

"""The functional-collective *ops* a compiled graph runs, through the checked torch.distributed calls.

Why a compiled graph needs them, and how they run:
[Note: compiled graphs under the emulation] (above :func:`install_functional_ops`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["install_functional_ops", "uninstall_functional_ops"]

_LIBRARY: Any = None
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _group(group_name: Any) -> Any:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return dist.distributed_c10d._resolve_process_group(group_name)


def _op(reduce_op: str) -> Any:
    return _REDUCE_OPS[reduce_op.lower()]


def _all_reduce(input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=_op(reduce_op), group=_group(group_name))
    return out


def _all_reduce_(input: torch.Tensor, reduce_op: str, group_name: Any) -> torch.Tensor:
    dist.all_reduce(input, op=_op(reduce_op), group=_group(group_name))
    return input


def _all_gather(input: torch.Tensor, group_size: int, group_name: Any) -> torch.Tensor:
    source = input.contiguous()
    out = source.new_empty((group_size * source.shape[0], *source.shape[1:]))
    dist.all_gather_into_tensor(out, source, group=_group(group_name))
    return out


def _reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int, group_name: Any) -> torch.Tensor:
    source = input.contiguous()
    out = source.new_empty((source.shape[0] // group_size, *source.shape[1:]))
    dist.reduce_scatter_tensor(out, source, op=_op(reduce_op), group=_group(group_name))
    return out


def _all_to_all(
    input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: Any
) -> torch.Tensor:
    source = input.contiguous()
    rows = sum(output_split_sizes) if output_split_sizes else source.shape[0]
    out = source.new_empty((rows, *source.shape[1:]))
    dist.all_to_all_single(
        out, source, output_split_sizes or None, input_split_sizes or None, group=_group(group_name)
    )
    return out


def _broadcast(input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    dist.broadcast(out, src=src, group=_group(group_name))
    return out


def _broadcast_(input: torch.Tensor, src: int, group_name: Any) -> torch.Tensor:
    dist.broadcast(input, src=src, group=_group(group_name))
    return input


_KERNELS = {
    "all_reduce": _all_reduce,
    "all_reduce_": _all_reduce_,
    "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "all_to_all_single": _all_to_all,
    "broadcast": _broadcast,
    "broadcast_": _broadcast_,
}


# [Note: compiled graphs under the emulation]
# ``hp_testing._funcol`` wraps the public functional entry points, which is
# what eager code and the *tracing* of a compiled region call. The graph that
# ``torch.compile`` produces calls the ops themselves
# (``torch.ops._c10d_functional.all_reduce`` and friends) every time it runs,
# straight into the process group's C++ backend: without this module the
# emulation would check a compiled step's collectives once, while it was
# traced, and never again. So while the layer is installed, the CPU kernels of
# those ops are replaced by small Python kernels that perform the same
# collective with the matching ``torch.distributed`` call, which the layer has
# wrapped: every run of a compiled graph goes through the same fingerprints,
# rules and cross-rank checks as eager code. The kernels are synchronous (the
# graph's ``wait_tensor`` then finds nothing to wait for), which changes no
# values. Uninstalling removes the registrations, and the C++ kernels are
# used again.
def install_functional_ops() -> None:
    """Route the CPU kernels of ``_c10d_functional``'s collectives through torch.distributed (once)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": on purpose
        warnings.simplefilter("ignore")
        for name, kernel in _KERNELS.items():
            library.impl(name, kernel, "CPU")
    _LIBRARY = library


def uninstall_functional_ops() -> None:
    """Drop the Python kernels: the C++ ones run again."""
    global _LIBRARY
    if _LIBRARY is not None:
        _LIBRARY._destroy()
        _LIBRARY = None

"""Softmax, log-softmax and safe softmax, forward and backward, with the softmax dim sharded or not.

Dims other than the softmax dim are independent rows, so their shards pass
through. When the softmax dim itself is sharded (vocab-parallel logits), the
pieces are not gathered: see [Note: sharded softmax].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["softmax_placements"]

aten = torch.ops.aten
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def softmax_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Every shard passes (the softmax dim's too, see [Note: sharded softmax]); partial values are reduced."""
    return tuple(p if isinstance(p, Shard) else Replicate() for p in placements)


def _groups(call: LocalCall, index: int, dim: int) -> list[Any]:
    """The process groups of the mesh dims that shard ``dim`` of argument ``index``."""
    layout = call.layout(index)
    return [
        mesh_group(layout.mesh, m)
        for m, p in enumerate(layout.placements)
        if isinstance(p, Shard) and p.dim == dim
    ]


def _row_max(x: torch.Tensor, dim: int, groups: list[Any]) -> torch.Tensor:
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        best = x.new_full(shape, float("-inf"))
    else:
        best = x.amax(dim, keepdim=True).contiguous()
    for group in groups:
        hc.all_reduce(best, "max", group)
    return best


def _row_sum(x: torch.Tensor, dim: int, groups: list[Any]) -> torch.Tensor:
    total = x.sum(dim, keepdim=True).contiguous()
    for group in groups:
        hc.all_reduce(total, "sum", group)
    return total


# [Note: sharded softmax]
# ``softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m)`` for any ``m``; taking
# ``m`` as the row maximum keeps ``exp`` in range. With the row spread over
# ranks, each rank takes the maximum of its piece and one ``all_reduce(max)``
# gives the row maximum; each rank sums ``exp(x - m)`` over its piece and one
# ``all_reduce(sum)`` gives the denominator. The output keeps the input's
# shards. The backward needs one more row sum each (``sum_j g_j`` for
# log-softmax, ``sum_j g_j y_j`` for softmax), again one ``all_reduce(sum)``.
# Communication is a row vector per all-reduce, against a whole shard per
# rank for gathering the dim: two collectives where torch's DTensor issues one
# all-gather, chosen because bytes, not the number of calls, bound the cost
# (for (rows, V) logits over n ranks: 2 rows of values against
# ``rows * V * (n - 1) / n``). ``max(x, dim)`` / ``min`` with ``dim`` sharded
# make the same trade (two all-reduces of the output's size, see
# :mod:`hp_dtensor.ops.reductions`). A rank whose piece of the row is empty (uneven
# shards) contributes ``-inf`` to the maximum and 0 to the sums. Half-precision
# inputs are computed in float32, as PyTorch's kernels accumulate.
def _forward_kernel(kind: str) -> Callable[[LocalCall], torch.Tensor]:
    def run(call: LocalCall) -> torch.Tensor:
        x = call.args[0]
        dim = int(call.args[1]) % x.dim()
        if kind == "safe":
            dtype = call.args[2] if len(call.args) > 2 else call.kwargs.get("dtype")
            out_dtype = dtype or x.dtype
        else:
            out_dtype = torch.float32 if call.args[2] else x.dtype
        work = x.float() if x.dtype in _LOW_PRECISION else x.to(torch.promote_types(x.dtype, out_dtype))
        groups = _groups(call, 0, dim)
        best = _row_max(work, dim, groups)
        shifted = work - best
        exps = shifted.exp()
        total = _row_sum(exps, dim, groups)
        if kind == "log":
            out = shifted - total.log()
        else:
            out = exps / total
            if kind == "safe":  # rows that are -inf everywhere give 0, not nan
                out = out.masked_fill(best == float("-inf"), 0.0)
        return out.to(out_dtype)

    return run


def _backward_kernel(kind: str) -> Callable[[LocalCall], torch.Tensor]:
    def run(call: LocalCall) -> torch.Tensor:
        grad, out = call.args[0], call.args[1]
        dim = int(call.args[2]) % out.dim()
        input_dtype = call.args[3]
        work_grad = grad.float() if grad.dtype in _LOW_PRECISION else grad
        work_out = out.float() if out.dtype in _LOW_PRECISION else out
        groups = _groups(call, 1, dim)
        if kind == "log":
            result = work_grad - work_out.exp() * _row_sum(work_grad, dim, groups)
        else:
            result = work_out * (work_grad - _row_sum(work_grad * work_out, dim, groups))
        return result.to(input_dtype)

    return run


_KERNELS = {
    aten._softmax.default: _forward_kernel("softmax"),
    aten._log_softmax.default: _forward_kernel("log"),
    aten._safe_softmax.default: _forward_kernel("safe"),
    aten._softmax_backward_data.default: _backward_kernel("softmax"),
    aten._log_softmax_backward_data.default: _backward_kernel("log"),
}


def _merged_target(call: OpCall, ref_index: int) -> tuple[Placement, ...]:
    """Per mesh dim, the first shard held by an argument of the reference's shape, else ``Replicate()``.

    The backward's ``grad_output`` and ``output`` may arrive cut differently
    (one sharded, one replicated): cutting the replicated one is free, while
    taking the reference's ``Replicate()`` would gather the sharded one.
    """
    ref = call.layout(call.position_of(call.args[ref_index]))
    layouts = [ref] + [call.layout(p) for p in call.positions if call.layout(p).shape == ref.shape]
    target: list[Placement] = []
    for m in range(len(ref.placements)):
        shards = [lay.placements[m] for lay in layouts if isinstance(lay.placements[m], Shard)]
        target.append(shards[0] if shards else Replicate())
    return tuple(target)


def _decide(call: OpCall, ref_index: int, dim_index: int) -> Decision:
    ref = call.layout(call.position_of(call.args[ref_index]))
    dim = int(call.args[dim_index]) % max(ref.ndim, 1)
    target = _merged_target(call, ref_index)
    inputs = {
        p: target if call.layout(p).shape == ref.shape else (Replicate(),) * len(target)
        for p in call.positions
    }
    sharded = any(isinstance(p, Shard) and p.dim == dim for p in target)
    return Decision(inputs=inputs, outputs=[target], kernel=_KERNELS[call.func] if sharded else None)


@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_rule(call: OpCall) -> Decision:
    """Softmax over ``dim``: shards pass; a sharded ``dim`` uses [Note: sharded softmax]."""
    return _decide(call, 0, 1)


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> Decision:
    """The backward takes the forward output's shards; a sharded ``dim`` needs one row-sum all-reduce."""
    return _decide(call, 1, 2)

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
    return [group for group, _ in _lines(call, index, dim)]


def _lines(call: LocalCall, index: int, dim: int) -> list[tuple[Any, int]]:
    """(process group, size) of each mesh dim that shards ``dim`` of argument ``index``."""
    layout = call.layout(index)
    return [
        (mesh_group(layout.mesh, m), layout.mesh.shape[m])
        for m, p in enumerate(layout.placements)
        if isinstance(p, Shard) and p.dim == dim
    ]


def _shift(best: torch.Tensor) -> torch.Tensor:
    """The row maximum as a shift: rows with no finite maximum (all ``-inf``, or empty) shift by 0."""
    return best.masked_fill(best == float("-inf"), 0.0)


def _row_stats(x: torch.Tensor, dim: int, lines: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maximum ``m`` and ``sum exp(x - m)`` over every piece: one all_gather per line.

    See [Note: sharded softmax].
    """
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        best, total = x.new_full(shape, float("-inf")), x.new_zeros(shape)
    else:
        best = x.amax(dim, keepdim=True)
        total = (x - _shift(best)).exp().sum(dim, keepdim=True)
    for group, size in lines:
        mine = torch.stack([best, total]).contiguous()
        gathered = mine.new_empty((size, *mine.shape))
        hc.all_gather_into_tensor(gathered, mine, group)
        maxes, totals = gathered.unbind(1)
        best = maxes.amax(0)
        total = (totals * (maxes - _shift(best)).exp()).sum(0)
    return best, total


def _row_sum(x: torch.Tensor, dim: int, groups: list[Any]) -> torch.Tensor:
    total = x.sum(dim, keepdim=True).contiguous()
    for group in groups:
        hc.all_reduce(total, "sum", group)
    return total


# [Note: sharded softmax]
# ``softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m)`` for any ``m``; taking
# ``m`` as the row maximum keeps ``exp`` in range. With the row spread over
# ranks, each rank takes the maximum ``m_r`` of its piece and the sum ``s_r``
# of ``exp(x - m_r)`` over it, and one ``all_gather`` of those two numbers per
# row gives every rank all of them: the row maximum is ``m = max_r m_r`` and
# the denominator ``sum_r s_r exp(m_r - m)`` (each factor at most 1, so
# nothing overflows). That is one collective where a max then a sum
# all-reduce took two: ``F.cross_entropy`` on class-cut logits communicates
# once in the forward (its ``nll_loss`` and label-smoothing terms are local,
# see [Note: vocab-parallel nll] in :mod:`hp_dtensor.ops.loss`). The output
# keeps the input's shards. The backward needs one more row sum each (``sum_j
# g_j`` for log-softmax, ``sum_j g_j y_j`` for softmax): one
# ``all_reduce(sum)``. Communication is 2 numbers per row and rank, against a
# whole shard per rank for gathering the dim as torch's DTensor does (for
# (rows, V) logits over n ranks: ``2 rows n`` values against ``rows V (n - 1)
# / n``). A softmax dim cut over two mesh dims combines over one, then the
# other. ``max(x, dim)`` / ``min`` with ``dim`` sharded take two all-reduces
# of the output's size (see :mod:`hp_dtensor.ops.reductions`). A rank whose
# piece of the row is empty (uneven shards) offers ``-inf`` and 0, which
# weigh nothing. Half-precision inputs are computed in float32, as PyTorch's
# kernels accumulate.
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
        best, total = _row_stats(work, dim, _lines(call, 0, dim))
        shifted = work - best
        if kind == "log":
            out = shifted - total.log()
        else:
            out = shifted.exp() / total
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

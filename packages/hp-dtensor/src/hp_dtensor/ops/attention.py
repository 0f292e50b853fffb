"""Scaled dot-product attention, forward and backward, with batch or heads sharded.

On CPU, ``F.scaled_dot_product_attention`` runs
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``)
whenever dropout is off; with dropout it decomposes into matmuls, softmax and
dropout, which have rules of their own ([Note: why dropout and a trainable
mask take the math path]). Every leading dim of ``(..., heads, seq, head_dim)``
may be cut when query, key and value are cut alike: no communication
([Note: attention cuts], [Note: grouped-query heads]).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.layout import Layout
from hp_dtensor.ops.dispatch import Decision, OpCall, register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["attention_cut"]

aten = torch.ops.aten
R = Replicate()


# [Note: attention cuts]
# Attention mixes positions within one (batch, head) pair and never across
# pairs, so every leading dim of ``(..., heads, seq, head_dim)`` may be cut as
# long as query, key and value are cut the same way: each rank attends over
# its own heads with no communication, and the outputs (``out`` and
# ``logsumexp``) keep the cut. The sequence and head dims must be whole (a cut
# sequence would need ring attention, a cut head dim a sum inside softmax),
# so those mesh dims are gathered. An additive or boolean ``attn_mask``
# follows the cut where it has the full size of the cut dim and stays
# replicated where it broadcasts.
def attention_cut(q: Layout, k: Layout, v: Layout) -> list[int | None]:
    """Per mesh dim, the leading dim that query, key and value are cut along, or None (replicated)."""
    ndim = q.ndim
    cut: list[int | None] = []
    for m in range(q.mesh.ndim):
        n = q.mesh.shape[m]
        chosen: int | None = None
        for layout in (q, k, v):
            placement = layout.placements[m]
            if not isinstance(placement, Shard) or placement.dim >= ndim - 2:
                continue
            d = placement.dim
            sizes = {layout_.shape[d] for layout_ in (q, k, v)}
            if len(sizes) == 1 or all(size % n == 0 for size in sizes):  # [Note: grouped-query heads]
                chosen = d
                break
        cut.append(chosen)
    return cut


def _mask_target(mask: Layout, q: Layout, cut: list[int | None]) -> tuple[Placement, ...]:
    out: list[Placement] = []
    for d in cut:
        if d is None:
            out.append(R)
            continue
        mask_dim = d - (q.ndim - mask.ndim)
        full = mask_dim >= 0 and mask.shape[mask_dim] == q.shape[d] and q.shape[d] != 1
        out.append(Shard(mask_dim) if full else R)
    return tuple(out)


# [Note: grouped-query heads]
# With ``enable_gqa``, key and value have fewer heads than query; query head
# ``h`` reads key head ``h // (Hq / Hkv)``. Cutting both head dims into ``n``
# equal pieces keeps every query head's key head on the same rank, and the
# local kernel's grouping is the global one, when ``n`` divides both head
# counts. Otherwise the heads are gathered.
def _decide(call: OpCall, q: Any, k: Any, v: Any, same_as_q: list[Any], n_outputs: int) -> Decision | None:
    from hp_dtensor.dtensor import DTensor

    if not all(isinstance(t, DTensor) for t in (q, k, v)):
        return None
    lq, lk, lv = (call.layout(call.position_of(t)) for t in (q, k, v))
    if not lq.ndim == lk.ndim == lv.ndim or lq.ndim < 3:
        return None
    cut = attention_cut(lq, lk, lv)
    target = tuple(Shard(d) if d is not None else R for d in cut)
    inputs: dict[int, tuple[Placement, ...]] = {}
    for tensor in (q, k, v, *same_as_q):
        if isinstance(tensor, DTensor):
            inputs[call.position_of(tensor)] = target
    mask = call.kwargs.get("attn_mask")
    if isinstance(mask, DTensor):
        inputs[call.position_of(mask)] = _mask_target(call.layout(call.position_of(mask)), lq, cut)
    return Decision(inputs=inputs, outputs=[target] * n_outputs)


# [Note: why dropout and a trainable mask take the math path]
# Checked on torch 2.13 (CPU); there is no fused path with correct gradients
# for these two cases, so the decomposition (the "math" path) is used, and is
# right, with each piece sharded by its own rule:
#
# * dropout: the only fused CPU kernel, ``_flash_attention_for_cpu``, raises
#   "Currently do not support dropout > 0" when called with ``dropout_p > 0``
#   and SDPA's backend selection refuses it ("Both fused kernels do not support
#   non-zero dropout"); the efficient and cuDNN kernels are not built for CPU
#   (``NotImplementedError`` for the CPU backend).
# * an ``attn_mask`` that requires grad: ``_flash_attention_for_cpu_backward``
#   returns gradients for query, key and value only (its schema has no mask
#   gradient), so SDPA does not pick it, and forcing it
#   (``sdpa_kernel([SDPBackend.FLASH_ATTENTION])``) fails with "No available
#   kernel". A mask that needs no grad does take the fused path.
#
# Revisit when a CPU build gains a fused kernel with dropout or a mask gradient.
@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_rule(call: OpCall) -> Decision | None:
    """``(out, logsumexp)`` keep query's cut of the leading dims (batch, heads)."""
    q, k, v = call.args[:3]
    return _decide(call, q, k, v, [], 2)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_backward_rule(call: OpCall) -> Decision | None:
    """Gradients of query, key and value take the forward's cut; no communication."""
    grad_out, q, k, v, out, logsumexp = call.args[:6]
    return _decide(call, q, k, v, [grad_out, out, logsumexp], 3)

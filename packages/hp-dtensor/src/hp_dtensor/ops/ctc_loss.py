"""CTC loss (``_ctc_loss`` and its backward) over a batch cut: each rank its own samples, no gather.

CTC runs one dynamic program per sample, so a cut of the batch (dim 1 of
``log_probs``, dim 0 of the outputs) needs no communication; only the
lengths, given as global int lists, and 1-D concatenated targets must be cut
to this rank's samples, which a kernel does. ``log_alpha``'s last dim is
``2 * max(target_lengths) + 1`` over the whole batch, so a rank pads its own
(narrower when its targets are shorter) to that width; and the backward has
no meta kernel, so the rule supplies the outputs' global metas
([Note: rule-supplied metas] in :mod:`hp_dtensor.ops.calls`). Other cuts
(time, classes) are gathered first.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.dtensor import DTensor
from hp_dtensor.layout import Layout
from hp_dtensor.ops.calls import Decision, LocalCall, OpCall
from hp_dtensor.ops.dispatch import register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["ctc_backward_rule", "ctc_forward_rule"]

aten = torch.ops.aten


def _cuts(log_probs: Layout) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(``log_probs``' placements with its batch cut kept, the same cut on a batch-first tensor)."""
    kept = tuple(p if p == Shard(1) else Replicate() for p in log_probs.placements)
    return kept, tuple(Shard(0) if p == Shard(1) else p for p in kept)


def _as_list(lengths: Any) -> list[int]:
    """Lengths given as an int list or a (local, whole) tensor, as a list."""
    return lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)


def _lengths(call: OpCall, first: int) -> tuple[list[int], list[int]] | None:
    """The input and target lengths at ``call.args[first:first + 2]``, or None when not every rank has them.

    Int lists (``.default``) are global; tensors (``.Tensor``) are read only
    when replicated, which a plain tensor is ([Note: plain tensors] in
    :mod:`hp_dtensor.ops.dispatch`): their values size ``log_alpha``, so
    that overload's rules are not cached ([Note: rule-supplied metas]).
    """
    lengths = call.args[first : first + 2]
    if len(lengths) < 2:
        return None
    if all(isinstance(v, (list, tuple)) for v in lengths):
        return list(lengths[0]), list(lengths[1])
    if all(isinstance(v, DTensor) and all(p == Replicate() for p in v.placements) for v in lengths):
        return _as_list(lengths[0]._local), _as_list(lengths[1]._local)
    return None


def _targets_target(targets: Layout, rows: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Padded ``(N, S)`` targets follow the batch cut; 1-D concatenated ones stay whole (cut by a kernel)."""
    return rows if targets.ndim == 2 else (Replicate(),) * targets.mesh.ndim


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _alpha_width(target_lengths: list[int]) -> int:
    return 2 * max(target_lengths, default=0) + 1


@register(aten._ctc_loss.default)
@register(aten._ctc_loss.Tensor, cached=False)
def ctc_forward_rule(call: OpCall) -> Decision | None:
    """``_ctc_loss(log_probs (T, N, C), targets, input_lengths, target_lengths, ...)`` per batch piece."""
    lengths = _lengths(call, 2)
    log_probs, targets = call.args[0], call.args[1]
    if call.kwargs or lengths is None or log_probs.ndim != 3:
        return None
    layout = log_probs._layout
    kept, rows = _cuts(layout)
    steps, batch, _ = layout.shape
    alpha = (batch, steps, _alpha_width(lengths[1]))
    metas = (_meta((batch,), log_probs.dtype), _meta(alpha, log_probs.dtype))
    return Decision(
        inputs={
            call.position_of(log_probs): kept,
            call.position_of(targets): _targets_target(targets._layout, rows),
        },
        outputs=[rows, rows],
        kernel=_forward_kernel,
        output_metas=metas,
    )


@register(aten._ctc_loss_backward.default)
@register(aten._ctc_loss_backward.Tensor, cached=False)
def ctc_backward_rule(call: OpCall) -> Decision | None:
    """``_ctc_loss_backward(grad, log_probs, targets, lengths.., nll, log_alpha, ...)`` per batch piece."""
    lengths = _lengths(call, 3)
    grad, log_probs, targets, nll, alpha = (call.args[i] for i in (0, 1, 2, 5, 6))
    if call.kwargs or lengths is None or log_probs.ndim != 3:
        return None
    layout = log_probs._layout
    kept, rows = _cuts(layout)
    inputs = {call.position_of(t): rows for t in (grad, nll, alpha)}
    inputs[call.position_of(log_probs)] = kept
    inputs[call.position_of(targets)] = _targets_target(targets._layout, rows)
    return Decision(
        inputs=inputs,
        outputs=[kept],
        kernel=_backward_kernel,
        output_metas=_meta(layout.shape, log_probs.dtype),
    )


def _local_lengths(call: LocalCall, log_probs_at: int) -> tuple[Any, Any, int]:
    """This rank's input and target lengths (lists or tensors, as given) and its first sample's index."""
    layout = call.layout(log_probs_at)
    start, count = layout.local_offset()[1], layout.local_shape()[1]
    input_lengths, target_lengths = call.args[log_probs_at + 2], call.args[log_probs_at + 3]
    return input_lengths[start : start + count], target_lengths[start : start + count], start


def _local_targets(targets: torch.Tensor, target_lengths: list[int], start: int, mine: Any) -> torch.Tensor:
    """This rank's targets: already cut when padded ``(N, S)``; its run of the concatenation when 1-D."""
    if targets.dim() == 2:
        return targets
    begin = sum(target_lengths[:start])
    return targets[begin : begin + sum(_as_list(mine))]


def _forward_kernel(call: LocalCall) -> Any:
    log_probs, targets, _, target_lengths, *rest = call.args
    input_mine, target_mine, start = _local_lengths(call, 0)
    targets = _local_targets(targets, _as_list(target_lengths), start, target_mine)
    nll, alpha = call.func(log_probs, targets, input_mine, target_mine, *rest)
    width = _alpha_width(_as_list(target_lengths))
    if alpha.shape[2] < width:  # this rank's targets are shorter than the batch's longest
        pad = alpha.new_full((*alpha.shape[:2], width - alpha.shape[2]), float("-inf"))
        alpha = torch.cat([alpha, pad], dim=2)
    return nll, alpha


def _backward_kernel(call: LocalCall) -> Any:
    grad, log_probs, targets, _, target_lengths, nll, alpha, *rest = call.args
    input_mine, target_mine, start = _local_lengths(call, 1)
    targets = _local_targets(targets, _as_list(target_lengths), start, target_mine)
    # a log_alpha wider than this rank's targets need is read only up to their width
    return call.func(grad, log_probs, targets, input_mine, target_mine, nll, alpha, *rest)

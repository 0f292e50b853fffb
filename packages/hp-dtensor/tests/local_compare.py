"""An op on DTensors against plain tensors, with the collectives of its forward and backward counted.

Shared by ``test_ops_spatial.py``, ``test_ops_stragglers.py`` and
``test_ops_shapes_comm.py``: values and every input gradient must match the
plain run, the call must never take the replicated fallback, and where the op
is local on the cut neither the forward nor the backward may issue a
collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hp_dtensor import DTensor, Placement, distribute_tensor, fallback_stats
from hp_testing import record_collectives
from torch.utils import _pytree as pytree


def _loss(out: Any) -> Any:
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    leaves = [t for t in tensors if t.is_floating_point()] + [
        torch.view_as_real(t) for t in tensors if t.is_complex()
    ]
    return sum((t * torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape).cos()).sum() for t in leaves)


def check(
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Placement],
    mesh: Any,
    *,
    local: bool = True,
    local_backward: bool | None = None,
    expect: Sequence[Placement] | None = None,
    grad: bool = True,
) -> Any:
    """Values and gradients against plain tensors; no collective when ``local``; never the fallback.

    ``local_backward`` (default: ``local``) is for the backward alone: the
    gradient of a replicated operand broadcast over a cut dim is a sum over
    ranks, one all-reduce however the op is ruled.

    The loss weights every output element differently, so a gradient that
    lands on the wrong element is caught.
    """
    full = [t.clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    ref = fn(*full)
    dts = [
        distribute_tensor(t.clone(), mesh, [p]).requires_grad_(grad and t.is_floating_point())
        for t, p in zip(inputs, placements, strict=True)
    ]
    before = {name: stat.calls for name, stat in fallback_stats().items()}
    with record_collectives() as log:
        out = fn(*dts)
    if local:
        assert len(log) == 0, f"hp communicated in the forward: {list(log)}"
    outs, refs = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        if isinstance(r, torch.Tensor):
            assert isinstance(o, DTensor), f"{fn} returned {type(o)}"
            torch.testing.assert_close(o.full_tensor(), r.detach())
    if expect is not None:
        assert outs[0].placements == tuple(expect)
    if grad and any(f.requires_grad for f in full):
        _loss(ref).backward()
        loss = _loss(out)
        with record_collectives() as log:
            loss.backward()
        # The loss is a sum over the (cut) output: its own gradient is the one partial; what the
        # op's backward adds must be local.
        if local if local_backward is None else local_backward:
            assert len(log) == 0, f"hp communicated in the backward: {list(log)}"
        for d, f in zip(dts, full, strict=True):
            if f.grad is not None:
                assert d.grad is not None
                torch.testing.assert_close(d.grad.full_tensor(), f.grad)
    after = {name: stat.calls for name, stat in fallback_stats().items()}
    assert after == before, f"fallback taken: {after} (before: {before})"
    return out

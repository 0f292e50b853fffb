"""An op on DTensors of any mesh against plain tensors, under the ``"error"`` fallback policy.

:func:`local_compare.check` places each input on a 1-D mesh; this one takes
a full placement tuple per input, so one helper covers 1-D and 2-D meshes.
It returns the collectives of the forward and of the backward so that a test
can say how many it expects (zero where the op is local on the cut).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hp_dtensor import DTensor, Placement, distribute_tensor, fallback_policy
from hp_testing import record_collectives
from local_compare import _loss
from torch.utils import _pytree as pytree


def randn(*shape: int) -> torch.Tensor:
    """A float64 random tensor (the tests compare in float64)."""
    return torch.randn(*shape, dtype=torch.float64)


def check_placed(
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Sequence[Placement]],
    mesh: Any,
    *,
    grad: bool = True,
    forward_comms: int | None = 0,
    backward_comms: int | None = 0,
) -> Any:
    """Values and every input gradient against plain tensors; no fallback; collectives counted.

    ``forward_comms`` / ``backward_comms`` are the exact numbers of
    collectives expected (None: not checked). Returns the DTensor output.
    """
    full = [t.clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    ref = fn(*full)
    dts = [
        distribute_tensor(t.clone(), mesh, list(p)).requires_grad_(grad and t.is_floating_point())
        for t, p in zip(inputs, placements, strict=True)
    ]
    with fallback_policy("error"):
        with record_collectives() as log:
            out = fn(*dts)
        if forward_comms is not None:
            assert len(log) == forward_comms, f"forward collectives: {list(log)}"
        outs, refs = pytree.tree_leaves(out), pytree.tree_leaves(ref)
        assert len(outs) == len(refs)
        for o, r in zip(outs, refs, strict=True):
            if isinstance(r, torch.Tensor):
                assert isinstance(o, DTensor), f"{fn} returned {type(o)}"
                torch.testing.assert_close(o.full_tensor(), r.detach())
        if grad and any(f.requires_grad for f in full):
            _loss(ref).backward()
            loss = _loss(out)
            with record_collectives() as log:
                loss.backward()
            if backward_comms is not None:
                assert len(log) == backward_comms, f"backward collectives: {list(log)}"
            for d, f in zip(dts, full, strict=True):
                if f.grad is not None:
                    assert d.grad is not None
                    torch.testing.assert_close(d.grad.full_tensor(), f.grad)
    return out

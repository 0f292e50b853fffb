"""An op on DTensors against the same op on full tensors: values, gradients, placements, collectives.

Shared by the op-family tests (``test_ops_matmul.py``, ``test_ops_losses.py``).
Partial inputs are built from uneven shares of the value (rank ``r`` of a
mesh dim of size ``n`` holds ``2 (r + 1) / (n (n + 1))`` of it), so a rule
that took partial terms for whole values, or multiplied two partials, gives
a wrong answer instead of hiding behind one rank holding everything.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from hp_dtensor import DTensor, Partial, Placement, Replicate, distribute_tensor
from hp_testing import record_collectives


def leaf(value: torch.Tensor, mesh, placements: Sequence[Placement], grad: bool) -> DTensor:  # type: ignore[no-untyped-def]
    """A leaf DTensor holding ``value`` under ``placements`` (partial terms as uneven shares)."""
    whole = [Replicate() if isinstance(p, Partial) else p for p in placements]
    dt = distribute_tensor(value.clone(), mesh, whole)
    if whole == list(placements):
        return dt.requires_grad_(grad)
    local = dt.to_local().clone()
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            n, r = mesh.size(m), mesh.get_local_rank(m)
            local = local * (2.0 * (r + 1) / (n * (n + 1)))
    return DTensor.from_local(local, mesh, list(placements), shape=tuple(value.shape)).requires_grad_(grad)


def check(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Sequence[Placement]],
    mesh,  # type: ignore[no-untyped-def]
    *,
    constant: Sequence[int] = (),
    expect: Sequence[Placement] | None = None,
    forward_collectives: dict[str, int] | None = None,
    tag: str = "",
) -> DTensor:
    """``fn`` on DTensors against ``fn`` on full tensors; floating inputs not in ``constant`` get gradients.

    The call and its backward run with warnings as errors: an op that took
    the replicated fallback fails the check.
    """
    grads = [t.is_floating_point() and i not in constant for i, t in enumerate(inputs)]
    full = [t.clone().requires_grad_(g) for t, g in zip(inputs, grads, strict=True)]
    ref = fn(*full)
    weights = torch.linspace(0.5, 1.5, ref.numel(), dtype=ref.dtype).view(ref.shape)
    (ref * weights).sum().backward()
    dts = [leaf(t, mesh, p, g) for t, p, g in zip(inputs, placements, grads, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dedicated rule, never the replicated fallback
        warnings.filterwarnings("ignore", message="reduction: 'mean' divides")  # torch's kl_div note
        with record_collectives() as log:
            out = fn(*dts)
        counts = dict(log.counts())
        assert isinstance(out, DTensor), f"{tag}: {type(out)}"
        if forward_collectives is not None:
            assert counts == forward_collectives, f"{tag}: the forward issued {counts}"
        if expect is not None:
            assert out.placements == tuple(expect), f"{tag}: placements {out.placements}"
        got = out.full_tensor()
        torch.testing.assert_close(got, ref, msg=lambda m: f"{tag}: {m}")
        (got * weights).sum().backward()
    for d, f in zip(dts, full, strict=True):
        if f.grad is not None:
            assert d.grad is not None, f"{tag}: no gradient"
            torch.testing.assert_close(d.grad.full_tensor(), f.grad, msg=lambda m: f"{tag} (gradient): {m}")
    return out

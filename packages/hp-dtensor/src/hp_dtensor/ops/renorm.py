"""``renorm``: each slice along ``dim`` scaled down to a p-norm of at most ``maxnorm``.

The norm of slice ``i`` is taken over every dim but ``dim``. A cut of
``dim`` gives each rank whole slices: the op runs on its piece with no
communication. A cut of any other dim splits every slice across ranks, so
each rank sums ``|x|^p`` (the maximum of ``|x|`` for ``p = inf``) over its
part of each slice and one all-reduce per cutting mesh dim of that small
``(size of dim,)`` vector gives every rank the slices' norms
([Note: renorm across ranks]); the output keeps the input's cuts. torch's
DTensor has no rule for ``renorm`` (it refuses the op). A partial input is
reduced first (the op is not linear). The backward is torch's formula in
ops that have rules.
"""

from __future__ import annotations

import math

import hp_core.collectives as hc
import torch
from hp_core.distributed import mesh_group

from hp_dtensor.ops.dispatch import Decision, LocalCall, OpCall, register
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["renorm_rule"]

aten = torch.ops.aten
_EPS = 1e-7  # torch's renorm adds it to the norm before dividing


# [Note: renorm across ranks]
# ``norm_i = (sum over the slice of |x|^p)^(1/p)``: the sum splits over the
# ranks' parts of the slice, so an all-reduce(sum) of the per-rank sums of
# ``|x|^p`` (a max for ``p = inf``) gives each slice's norm on every rank;
# then each rank scales its part by ``maxnorm / (norm + 1e-7)`` where the
# norm exceeds ``maxnorm``, as the op does. The sums are taken in the
# computation dtype (float for half inputs), as torch's decomposition takes
# the norm. A rank with an empty piece contributes zero.
def _renorm_kernel(call: LocalCall) -> torch.Tensor:
    x, p, dim, maxnorm = call.args[0], float(call.args[1]), call.args[2], call.args[3]
    layout = call.layout(0)
    dim = dim % x.dim()
    others = [d for d in range(x.dim()) if d != dim]
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    magnitude = x.abs().to(compute)
    if math.isinf(p):
        part = magnitude.amax(others, keepdim=True) if x.numel() else _zeros(x, dim, compute)
        op = "max"
    else:
        part = magnitude.pow(p).sum(others, keepdim=True)
        op = "sum"
    part = part.contiguous()
    for m, placement in enumerate(layout.placements):
        if isinstance(placement, Shard) and placement.dim != dim:
            hc.all_reduce(part, op, mesh_group(layout.mesh, m))
    norm = part if math.isinf(p) else part.pow(1.0 / p)
    factor = torch.where(norm > maxnorm, maxnorm / (norm + _EPS), 1.0).to(x.dtype)
    return (x * factor).contiguous()


def _zeros(x: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    return torch.zeros(shape, dtype=dtype, device=x.device)


@register(aten.renorm.default)
def renorm_rule(call: OpCall) -> Decision:
    """Shards pass; a cut of a dim other than ``dim`` shares the slices' norms in one all-reduce."""
    position = call.positions[0]
    layout = call.layout(position)
    dim = call.args[2] % layout.ndim
    placements: tuple[Placement, ...] = tuple(
        p if isinstance(p, Shard) else Replicate() for p in layout.placements
    )
    across = any(isinstance(p, Shard) and p.dim != dim for p in placements)
    return Decision(
        inputs={position: placements}, outputs=[placements], kernel=_renorm_kernel if across else None
    )

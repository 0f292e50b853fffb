"""Gradients that span stages: tied parameters and the global gradient-norm clip.

Details: [Note: tied parameters], [Note: global norm].
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TiedGroup", "clip_grad_norm_", "global_grad_norm"]


# [Note: tied parameters]
# Some weights are used by two stages, classically the token embedding (stage
# 0) and the output projection (the last stage). Each owning stage holds its own
# copy; after the step the copies' gradients must be summed so that every copy
# takes the same optimizer step. Each owner rank sends its copies' gradients to
# every other owner rank and each rank adds all of them *in stage order*, so
# every copy gets a bit-identical sum (partial sums exchanged between ranks
# would round differently on each side and the copies would drift apart).
# :meth:`TiedGroup.sync_values` makes the copies equal in the first place.


@dataclass(frozen=True)
class TiedGroup:
    """One weight shared by several stages: ``stages`` maps stage index -> parameter name in its module."""

    name: str
    stages: Mapping[int, str]

    def __post_init__(self) -> None:
        if len(self.stages) < 2:
            raise ValueError(
                f"tied group {self.name!r} names stages {sorted(self.stages)}; a tie needs at least two "
                "owning stages, e.g. {0: 'embed.weight', 3: 'head.weight'}"
            )

    def local_params(self, modules: Mapping[int, nn.Module]) -> dict[int, nn.Parameter]:
        """This rank's copies, by stage (stages not on this rank are skipped)."""
        found: dict[int, nn.Parameter] = {}
        for stage, fqn in sorted(self.stages.items()):
            module = modules.get(stage)
            if module is None:
                continue
            params = dict(module.named_parameters())
            if fqn not in params:
                near = sorted(params)[:8]
                raise ValueError(
                    f"tied group {self.name!r}: stage {stage}'s module has no parameter {fqn!r}; "
                    f"its parameters include {near}"
                )
            found[stage] = params[fqn]
        return found


def _exchange(
    tensors: dict[int, torch.Tensor],
    group_stages: list[int],
    rank_of_stage: dict[int, int],
    group: dist.ProcessGroup | None,
) -> dict[int, torch.Tensor]:
    """Every owner stage's tensor on this rank: local ones as given, remote ones received."""
    from hp_core import P2POp, batch_isend_irecv

    me = dist.get_rank()
    result = dict(tensors)
    ops: list[P2POp] = []
    peers = sorted({rank_of_stage[s] for s in group_stages} - {me})
    template = next(iter(tensors.values()))
    for peer in peers:
        for stage in sorted(tensors):
            ops.append(P2POp("isend", tensors[stage].contiguous(), peer, group))
        for stage in group_stages:
            if rank_of_stage[stage] == peer:
                buf = torch.empty_like(template)
                result[stage] = buf
                ops.append(P2POp("irecv", buf, peer, group))
    if ops:
        batch_isend_irecv(ops).wait()
    return result


def _broadcast_first(
    local: dict[int, nn.Parameter],
    stages: list[int],
    ranks: dict[int, int],
    group: dist.ProcessGroup | None,
) -> None:
    """Copy the first owner stage's value into every other copy (sent from its rank)."""
    from hp_core import P2POp, batch_isend_irecv

    me, first = dist.get_rank(), stages[0]
    if ranks[first] == me:
        value = local[first].detach().contiguous()
        peers = sorted({ranks[s] for s in stages} - {me})
        if peers:
            batch_isend_irecv([P2POp("isend", value, peer, group) for peer in peers]).wait()
    else:
        value = torch.empty_like(next(iter(local.values())))
        batch_isend_irecv([P2POp("irecv", value, ranks[first], group)]).wait()
    for p in local.values():
        if p.shape != value.shape:
            raise ValueError(f"tied copies differ in shape: {tuple(p.shape)} vs {tuple(value.shape)}")
        p.copy_(value)


def sync_tied(
    groups: Iterable[TiedGroup],
    modules: Mapping[int, nn.Module],
    rank_of_stage: Mapping[int, int],
    group: dist.ProcessGroup | None,
    *,
    values: bool,
) -> None:
    """Sum the tied copies' gradients (``values=False``) or copy the first owner's value to all."""
    for tie in groups:
        local = tie.local_params(modules)
        if not local:
            continue
        stages = sorted(tie.stages)
        ranks = {s: rank_of_stage[s] for s in stages}
        with torch.no_grad():
            if values:
                _broadcast_first(local, stages, ranks, group)
                continue
            grads = {s: (p.grad if p.grad is not None else torch.zeros_like(p)) for s, p in local.items()}
            everything = _exchange(grads, stages, ranks, group)
            total = everything[stages[0]].clone()
            for s in stages[1:]:
                total.add_(everything[s])
            for p in local.values():
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)


# [Note: global norm]
# ``torch.nn.utils.clip_grad_norm_`` on one stage would clip by that stage's
# norm, so stages would scale by different coefficients. Here each rank adds up
# ``|g|^p`` over its parameters, one all-reduce over the pipeline group gives
# the global sum, and every rank scales by the same ``max_norm / (norm + 1e-6)``
# (clamped to 1), the formula torch uses. A tied weight is counted once.


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup | None = None,
    error_if_nonfinite: bool = False,
    also_scale: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients by the norm over *all ranks of* ``group`` ([Note: global norm]).

    ``parameters`` are this rank's, each counted once across the group; every
    rank must call this. ``also_scale`` are parameters scaled by the same
    coefficient without counting towards the norm (the second copy of a tied
    weight). Returns the global total norm (a float32 tensor).
    """
    params = list(parameters)
    total = global_grad_norm(params, norm_type, group=group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients over the pipeline is {total.item()}; "
            "set error_if_nonfinite=False to clip anyway, or find the stage producing non-finite grads"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    seen: set[int] = set()
    for p in [*params, *also_scale]:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


def global_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of ``parameters`` on every rank of ``group`` together."""
    from hp_core import all_reduce, get_platform

    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    device = grads[0].device if grads else get_platform().device()
    local = torch.zeros(1, dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        for g in grads:
            local = torch.maximum(local, g.abs().max().float())
        return all_reduce(local, "max", group).reshape(())
    for g in grads:
        local = local + torch.linalg.vector_norm(g.float(), norm_type) ** norm_type
    return all_reduce(local, "sum", group).reshape(()) ** (1.0 / norm_type)

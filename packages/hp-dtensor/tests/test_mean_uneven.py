"""``mean`` over an unevenly cut dim is a local sum over the global count: no gather.

Before, a mean over 5 rows cut 3 + 2 gathered its input (the average of the
pieces' means is not the mean); now each rank divides its piece's sum by the
global count ([Note: mean over an uneven cut] in ``ops/reductions.py``). The
losses torch writes as pointwise ops then ``mean()`` (``l1_loss``, ``kl_div``)
follow. Values and gradients against full tensors; the forward communicates
nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Partial, Replicate, Shard, fallback_policy

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R, P = Replicate(), Partial("sum")
NO_COMM: dict[str, int] = {}


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.distributed(world_size=2)
def test_mean_over_an_uneven_cut_is_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _t(5, 3, 4)  # dim 0: 3 + 2 rows; dim 1: 2 + 1
    cases = [
        (lambda a: a.mean(), [Shard(0)], [P]),
        (lambda a: a.mean(), [Shard(1)], [P]),
        (lambda a: a.mean(0), [Shard(0)], [P]),
        (lambda a: a.mean((0, 2), keepdim=True), [Shard(0)], [P]),
        (lambda a: a.mean(1), [Shard(1)], [P]),
        (lambda a: a.mean(2), [Shard(0)], [Shard(0)]),  # the cut dim is kept: nothing to combine
        (lambda a: a.float().mean(0, dtype=torch.float64), [Shard(0)], [P]),
    ]
    with fallback_policy("error"):
        for i, (fn, placements, expect) in enumerate(cases):
            check(
                fn, [x], [placements], mesh, expect=expect, forward_collectives=NO_COMM, tag=f"mean case {i}"
            )
    # a sum-partial input stays partial (the mean is linear)
    with fallback_policy("error"):
        check(lambda a: a.mean(0), [x], [[P]], mesh, expect=[P], forward_collectives=NO_COMM, tag="partial")


@pytest.mark.distributed(world_size=2)
def test_losses_with_a_mean_over_an_uneven_cut_do_not_gather(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    x, y = _t(5, 3), _t(5, 3)
    logp = torch.log_softmax(_t(5, 3), dim=1)
    q = torch.softmax(_t(5, 3), dim=1)
    losses = [("l1", F.l1_loss, x, y), ("mse", F.mse_loss, x, y)]
    for red in ("mean", "batchmean", "sum"):
        losses.append((f"kl_div {red}", lambda a, b, red=red: F.kl_div(a, b, reduction=red), logp, q))
    with fallback_policy("error"):
        for cut in (Shard(0), Shard(1)):
            for name, fn, a, b in losses:
                check(
                    fn,
                    [a, b],
                    [[cut], [cut]],
                    mesh,
                    expect=[P],
                    forward_collectives=NO_COMM,
                    tag=f"{name} {cut}",
                )


@pytest.mark.distributed(world_size=4)
def test_mean_over_an_even_and_an_uneven_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """One mesh dim cuts evenly (4 columns), the other unevenly (5 rows): every term is a sum partial."""
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(2)
    with fallback_policy("error"):
        check(
            lambda a: a.mean(),
            [_t(5, 4)],
            [[Shard(0), Shard(1)]],
            mesh,
            expect=[P, P],
            forward_collectives=NO_COMM,
            tag="2x2 mean",
        )
        check(
            F.l1_loss,
            [_t(5, 4), _t(5, 4)],
            [[Shard(1), Shard(0)], [Shard(1), Shard(0)]],
            mesh,
            expect=[P, P],
            forward_collectives=NO_COMM,
            tag="2x2 l1",
        )

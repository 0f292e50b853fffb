"""Class-cut ``F.cross_entropy``: every variant communicates only what its ``log_softmax`` does.

The class dim of the logits cut (vocab-parallel), targets and class weights
replicated. The nll term is local ([Note: vocab-parallel nll] in
``ops/loss.py``); label smoothing's terms and the probability-target form are
linear in partial values, so zeroing ignored rows, adding the partial nll to
the smoothing term and dividing by a partial total keep or reduce only what
they must ([Note: linear partials] in ``ops/pointwise.py``). Checked against
one process (values and gradients, uneven class cuts, ignored targets), the
gradient stays class-cut, and the forward issues exactly the collectives of
``log_softmax`` alone (plus one scalar all-reduce for a weighted mean with
label smoothing, whose denominator torch computes with a ``gather``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R, P = Replicate(), Partial("sum")


def _data(rows: int, classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(rows * classes)
    x = torch.randn(rows, classes, dtype=torch.float64)
    target = torch.randint(0, classes, (rows,))
    target[::3] = -100  # some ignored samples
    probs = torch.softmax(torch.randn(rows, classes, dtype=torch.float64), dim=1)
    return x, target, torch.rand(classes, dtype=torch.float64) + 0.5, probs


_VARIANTS: dict[str, Any] = {
    "mean": lambda a, t, w, p: F.cross_entropy(a, t),
    "sum": lambda a, t, w, p: F.cross_entropy(a, t, reduction="sum"),
    "none": lambda a, t, w, p: F.cross_entropy(a, t, reduction="none"),
    "weight": lambda a, t, w, p: F.cross_entropy(a, t, weight=w),
    "smoothing": lambda a, t, w, p: F.cross_entropy(a, t, label_smoothing=0.1),
    "smoothing none": lambda a, t, w, p: F.cross_entropy(a, t, label_smoothing=0.1, reduction="none"),
    "smoothing weight sum": lambda a, t, w, p: F.cross_entropy(a, t, w, label_smoothing=0.1, reduction="sum"),
    "smoothing weight mean": lambda a, t, w, p: F.cross_entropy(a, t, w, label_smoothing=0.1),
    "probabilities": lambda a, t, w, p: F.cross_entropy(a, p),
    "probabilities weight smoothing": lambda a, t, w, p: F.cross_entropy(a, p, w, label_smoothing=0.2),
    "probabilities none": lambda a, t, w, p: F.cross_entropy(a, p, reduction="none"),
    "nll": lambda a, t, w, p: F.nll_loss(torch.log_softmax(a, 1), t, weight=w),
}


def _log_softmax_counts(x: torch.Tensor, mesh) -> dict[str, int]:  # type: ignore[no-untyped-def]
    logits = distribute_tensor(x, mesh, [Shard(1)])
    with record_collectives() as log:
        torch.log_softmax(logits, dim=1)
    return dict(log.counts())


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("classes", [7, 1])  # uneven, and one rank with no classes at all
def test_class_cut_cross_entropy_communicates_like_log_softmax(rank, device_mesh_factory, classes) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x, target, weight, probs = _data(6, classes)
    expected = _log_softmax_counts(x, mesh)
    with fallback_policy("error"):
        for name, fn in _VARIANTS.items():
            forward = dict(expected)  # the looked-up weights stay replicated: their total is local
            out = check(
                fn,
                [x, target, weight, probs],
                [[Shard(1)], [R], [R], [R]],
                mesh,
                constant=(2, 3),
                forward_collectives=forward,
                tag=f"cross_entropy {name} ({classes} classes)",
            )
            assert out.placements == (P,), f"{name}: {out.placements}"


@pytest.mark.distributed(world_size=2)
def test_class_cut_cross_entropy_gradient_stays_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The backward gathers nothing: the logits' gradient comes back class-cut."""
    mesh = device_mesh_factory((2,))
    x, target, _, _ = _data(6, 7)
    logits = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    targets = distribute_tensor(target, mesh, [R])
    with fallback_policy("error"):
        loss = F.cross_entropy(logits, targets, label_smoothing=0.1)
        with record_collectives() as log:
            loss.backward()
    assert isinstance(logits.grad, DTensor) and logits.grad.placements == (Shard(1),)
    assert dict(log.counts()) == {"all_reduce": 1}, dict(log.counts())  # log_softmax's row sum
    # what crosses ranks is one number per row, far below the logits' own bytes
    assert log.nbytes() <= x.shape[0] * x.element_size(), log.nbytes()


@pytest.mark.distributed(world_size=2)
def test_linear_partials_stay_partial(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The pointwise steps label smoothing takes, each on its own: no reduction where the op is linear."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(3)
    a, b, c = (torch.randn(4, 3, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(4, 3) > 0.5
    none: dict[str, int] = {}
    with fallback_policy("error"):
        check(lambda u, v: u + v, [a, b], [[P], [R]], mesh, expect=[P], forward_collectives=none, tag="P + R")
        check(lambda u, v: v - u, [a, b], [[P], [R]], mesh, expect=[P], forward_collectives=none, tag="R - P")
        check(
            lambda u, m: u.masked_fill(m, 0.0),
            [a, mask],
            [[P], [R]],
            mesh,
            expect=[P],
            forward_collectives=none,
        )
        # a nonzero fill is not linear: the partial is reduced first
        check(
            lambda u, m: u.masked_fill(m, 2.0),
            [a, mask],
            [[P], [R]],
            mesh,
            expect=[R],
            forward_collectives={"all_reduce": 1},
            tag="fill 2",
        )
        # two partial factors: only the divisor is reduced
        one = {"all_reduce": 1}
        check(
            lambda u, v: u / v,
            [a, c.abs() + 1],
            [[P], [P]],
            mesh,
            expect=[P],
            forward_collectives=one,
            tag="P/P",
        )
        check(lambda u, v: u * v, [a, c], [[P], [P]], mesh, expect=[P], forward_collectives=one, tag="P*P")
        # a number operand has no placement to make partial: reduced
        check(lambda u: u + 1.0, [a], [[P]], mesh, expect=[R], forward_collectives=one, tag="P + 1")

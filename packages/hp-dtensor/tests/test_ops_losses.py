"""Losses on DTensors against the same losses on full tensors: values, gradients, placements, collectives.

Inputs cut on the batch dim (even and uneven: a mean divides by the global
count, never averages local means), on another dim, and replicated; each
reduction (none / mean / sum), forward and backward, with no fallback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Partial, Replicate, Shard

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

S0, S1, S2, S3, R = [Shard(0)], [Shard(1)], [Shard(2)], [Shard(3)], [Replicate()]
P = Partial("sum")
NO_COMM: dict[str, int] = {}
REDUCTIONS = ("none", "mean", "sum")


def _data(batch: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(batch)
    x = torch.randn(batch, 6, dtype=torch.float64)
    return {
        "x": x,
        "y": torch.randn(batch, 6, dtype=torch.float64),
        "p": torch.rand(batch, 6, dtype=torch.float64) * 0.9 + 0.05,
        "bits": (torch.rand(batch, 6) > 0.5).double(),
        "signs": (torch.rand(batch, 6) > 0.5).double() * 2 - 1,
        "w": torch.rand(batch, 6, dtype=torch.float64),
        "pos": torch.rand(6, dtype=torch.float64) + 0.5,
    }


def _elementwise(red: str) -> dict:  # type: ignore[type-arg]
    """name -> (fn, data keys, indices without gradients); ops with their own rule."""
    return {
        "mse": (lambda a, b: F.mse_loss(a, b, reduction=red), ["x", "y"], ()),
        "smooth_l1": (lambda a, b: F.smooth_l1_loss(a, b, reduction=red, beta=0.5), ["x", "y"], ()),
        "huber": (lambda a, b: F.huber_loss(a, b, reduction=red, delta=0.7), ["x", "y"], ()),
        "soft_margin": (lambda a, b: F.soft_margin_loss(a, b, reduction=red), ["x", "signs"], (1,)),
        "bce": (lambda a, b: F.binary_cross_entropy(a, b, reduction=red), ["p", "bits"], (1,)),
        "bce weighted": (
            lambda a, b, c: F.binary_cross_entropy(a, b, weight=c, reduction=red),
            ["p", "bits", "w"],
            (1, 2),
        ),
        "bce logits": (lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction=red), ["x", "p"], ()),
        "bce logits pos_weight": (
            lambda a, b, c: F.binary_cross_entropy_with_logits(a, b, pos_weight=c, reduction=red),
            ["x", "p", "pos"],
            (2,),
        ),
    }


def _expected(cut: list, red: str) -> list:  # type: ignore[type-arg]
    """The loss's placement: the input's cut for "none", a partial sum of it otherwise."""
    if red == "none" or cut == R:
        return cut
    return [P]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("red", REDUCTIONS)
def test_elementwise_losses_without_communication(rank, device_mesh_factory, red) -> None:  # type: ignore[no-untyped-def]
    """mse, smooth L1, Huber, soft margin, BCE (+ weight), BCE with logits (+ pos_weight): no collective.

    Batch 5 over 2 ranks is uneven (3 + 2 rows): the mean is each rank's sum
    over the global count, which the comparison with one process checks.
    """
    mesh = device_mesh_factory((2,))
    for batch in (5, 4):
        _check_elementwise(mesh, batch, red, ((S0, S0), (S1, S1), (R, R), (S0, R), (R, S0)))


@pytest.mark.distributed(world_size=4)
def test_elementwise_losses_uneven_on_four_ranks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Batch 5 over 4 ranks (2, 1, 1, 1) and 3 over 4 (one rank empty): means over the global count."""
    mesh = device_mesh_factory((4,))
    for batch in (5, 3):
        for red in REDUCTIONS:
            _check_elementwise(mesh, batch, red, ((S0, S0),))


def _check_elementwise(mesh, batch: int, red: str, cuts) -> None:  # type: ignore[no-untyped-def]
    """Every loss of :func:`_elementwise` under each (input cut, other operands' cut): no collective."""
    data = _data(batch)
    for name, (fn, keys, constant) in _elementwise(red).items():
        inputs = [data[k] for k in keys]
        for cut, other in cuts:
            pos = S0 if cut == S1 else R  # pos_weight runs along the feature dim
            placements = [cut, other] + [pos if k == "pos" else other for k in keys[2:]]
            check(
                fn,
                inputs,
                placements,
                mesh,
                constant=constant,
                expect=_expected(cut if cut != R else other, red),
                forward_collectives=NO_COMM,
                tag=f"{name} {red} batch={batch} {cut}, {other}",
            )


@pytest.mark.distributed(world_size=4)
def test_elementwise_losses_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    data = _data(5)
    for red in REDUCTIONS:
        out = check(
            lambda a, b, r=red: F.mse_loss(a, b, reduction=r),
            [data["x"], data["y"]],
            [[Shard(0), Shard(1)], [Shard(0), Replicate()]],
            mesh,
            forward_collectives=NO_COMM,
            tag=red,
        )
        assert out.placements == ((Shard(0), Shard(1)) if red == "none" else (P, P))
        check(
            lambda a, b, r=red: F.binary_cross_entropy(a, b, reduction=r),
            [data["p"], data["bits"]],
            [[Shard(0), Replicate()], [Replicate(), Replicate()]],
            mesh,
            constant=(1,),
            forward_collectives=NO_COMM,
            tag=red,
        )


@pytest.mark.distributed(world_size=2)
def test_partial_inputs_are_summed_before_a_loss(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A loss is not linear: partial terms (a row-parallel layer's output) are completed first."""
    mesh = device_mesh_factory((2,))
    data = _data(5)
    for red in REDUCTIONS:
        mse = lambda a, b, r=red: F.mse_loss(a, b, reduction=r)  # noqa: E731
        check(mse, [data["x"], data["y"]], [[P], S0], mesh, tag=red)
        check(
            lambda a, b, r=red: F.binary_cross_entropy_with_logits(a, b, reduction=r),
            [data["x"], data["p"]],
            [[P], R],
            mesh,
            tag=red,
        )


def _decomposed(red: str) -> dict:  # type: ignore[type-arg]
    """Losses torch builds from pointwise ops and reductions (no loss op of their own)."""
    return {
        "l1": (lambda a, b: F.l1_loss(a, b, reduction=red), ["x", "y"], ()),
        "kl_div": (lambda a, b: F.kl_div(a.log_softmax(1), b, reduction=red), ["x", "p"], ()),
        "kl_div log_target": (lambda a, b: F.kl_div(a, b, reduction=red, log_target=True), ["x", "y"], ()),
        "poisson_nll": (lambda a, b: F.poisson_nll_loss(a, b, reduction=red), ["x", "p"], (1,)),
        "poisson_nll full": (
            lambda a, b: F.poisson_nll_loss(a, b, log_input=False, full=True, reduction=red),
            ["p", "w"],
            (1,),
        ),
        "hinge_embedding": (lambda a, b: F.hinge_embedding_loss(a, b, reduction=red), ["x", "signs"], (1,)),
        "cross_entropy probabilities": (
            lambda a, b: F.cross_entropy(a, b.softmax(1), reduction=red),
            ["x", "y"],
            (),
        ),
        "cross_entropy probabilities smoothed": (
            lambda a, b: F.cross_entropy(a, b.softmax(1), reduction=red, label_smoothing=0.1),
            ["x", "y"],
            (),
        ),
        "logsigmoid": (lambda a, b: F.logsigmoid(a) * b, ["x", "y"], ()),
    }


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("red", REDUCTIONS)
def test_losses_built_from_pointwise_ops(rank, device_mesh_factory, red) -> None:  # type: ignore[no-untyped-def]
    """l1, KL, Poisson NLL, hinge, cross-entropy with probabilities: every cut right, no fallback.

    Summed or per-element losses cut on the batch move nothing; a mean over an
    uneven cut is gathered by the mean rule (correct, not free).
    """
    mesh = device_mesh_factory((2,))
    for batch in (5, 4):
        data = _data(batch)
        for name, (fn, keys, constant) in _decomposed(red).items():
            inputs = [data[k] for k in keys]
            for cut in (S0, S1, R):
                free = cut == S0 and (red != "mean" or batch % 2 == 0) and "cross_entropy" not in name
                check(
                    fn,
                    inputs,
                    [cut, cut],
                    mesh,
                    constant=constant,
                    forward_collectives=NO_COMM if free else None,
                    tag=f"{name} {red} batch={batch} {cut}",
                )
    if red == "mean":
        check(lambda a, b: F.kl_div(a, b, reduction="batchmean"), [data["x"], data["p"]], [S0, S0], mesh)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("red", REDUCTIONS)
def test_pair_losses(rank, device_mesh_factory, red) -> None:  # type: ignore[no-untyped-def]
    """cosine_embedding_loss and margin_ranking_loss, batch cut (uneven) or replicated; features cut too."""
    mesh = device_mesh_factory((2,))
    data = _data(5)
    labels = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    x, y = data["x"], data["y"]
    for cut in (S0, R):
        check(
            lambda a, b, c: F.cosine_embedding_loss(a, b, c, margin=0.1, reduction=red),
            [x, y, labels],
            [cut, cut, cut],
            mesh,
            constant=(2,),
        )
        check(
            lambda a, b, c: F.margin_ranking_loss(a, b, c, margin=0.2, reduction=red),
            [x[:, 0].contiguous(), y[:, 0].contiguous(), labels],
            [cut, cut, cut],
            mesh,
            constant=(2,),
        )
    check(lambda a, b, c: F.cosine_embedding_loss(a, b, c, reduction=red), [x, y, labels], [S1, S1, R], mesh)


def _spatial(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(10 + batch)
    logits = torch.randn(batch, 3, 5, 3, dtype=torch.float64)
    target = torch.randint(0, 3, (batch, 5, 3))
    target[0, 0, 0] = -100  # ignored
    target[batch - 1, 4, 2] = 1
    return logits, target, torch.rand(3, dtype=torch.float64) + 0.5


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("red", REDUCTIONS)
def test_nll_loss2d_cut_by_batch_space_or_class(rank, device_mesh_factory, red) -> None:  # type: ignore[no-untyped-def]
    """Spatial targets: (N, C, H, W) cut on N, H, W (target cut alike) or C (target replicated).

    Per-pixel losses move nothing; a mean or sum adds one all-reduce of the
    total weight (the mean's denominator) along batch/space cuts.
    """
    mesh = device_mesh_factory((2,))
    reduced = {} if red == "none" else {"all_reduce": 1}
    for batch in (3, 2):
        logits, target, weight = _spatial(batch)
        log_probs = logits.log_softmax(1)
        cuts = [(S0, S0, reduced), (S2, S1, reduced), (S3, S2, reduced), (R, S0, reduced), (S1, R, NO_COMM)]
        for x_cut, t_cut, comm in cuts:
            tag = f"{red} batch={batch} {x_cut} {t_cut}"
            out = check(
                lambda a, t: F.nll_loss(a, t, reduction=red),
                [log_probs, target],
                [x_cut, t_cut],
                mesh,
                forward_collectives=comm,
                tag=tag,
            )
            if red == "none":
                assert out.placements == (tuple(t_cut) if x_cut != S1 else (P,)), tag
            else:
                assert out.placements == (P,), tag
            check(
                lambda a, t, w: F.nll_loss(a, t, weight=w, reduction=red),
                [log_probs, target, weight],
                [x_cut, t_cut, S0 if x_cut == S1 else R],
                mesh,
                constant=(2,),
                tag=f"weighted {tag}",
            )
        # cross-entropy over spatial logits: log_softmax (over the class dim) then nll_loss2d
        for x_cut, t_cut in ((S0, S0), (S2, S1), (S1, R)):
            check(
                lambda a, t: F.cross_entropy(a, t, reduction=red, label_smoothing=0.1),
                [logits, target],
                [x_cut, t_cut],
                mesh,
                tag=f"cross_entropy {red} {x_cut}",
            )


@pytest.mark.distributed(world_size=4)
def test_nll_loss2d_uneven_and_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Batch 3 over 4 ranks (one empty), H 5 over 4; batch on dp with classes or width on tp."""
    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("dp", "tp"))
    logits, target, weight = _spatial(3)
    log_probs = logits.log_softmax(1)
    for red in REDUCTIONS:
        for x_cut, t_cut in ((S0, S0), (S2, S1), (S1, R)):
            nll = lambda a, t, r=red: F.nll_loss(a, t, reduction=r)  # noqa: E731
            check(nll, [log_probs, target], [x_cut, t_cut], line)
        grid_cuts = (
            ([Shard(0), Shard(1)], [Shard(0), Replicate()]),
            ([Shard(0), Shard(3)], [Shard(0), Shard(2)]),
        )
        for x_cut, t_cut in grid_cuts:
            check(
                lambda a, t, w, r=red: F.nll_loss(a, t, weight=w, reduction=r),
                [log_probs, target, weight],
                [x_cut, t_cut, [Replicate(), Shard(0) if x_cut[1] == Shard(1) else Replicate()]],
                grid,
                constant=(2,),
                tag=f"{red} {x_cut}",
            )

"""Negative log-likelihood with a whole (replicated) target: the mean's denominator is counted locally.

A batch-cut input with the labels of the whole batch on every rank (the
usual data-parallel or sequence-parallel loss) needs no collective for
``F.cross_entropy`` / ``F.nll_loss``: each rank reads its own samples'
labels and counts the global total weight from the whole target ([Note:
whole targets] in ``ops/loss.py``). Values and gradients are checked against
full tensors on uneven cuts, with ``ignore_index`` hits and class weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Partial, Replicate, Shard, fallback_stats

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R, P = Replicate(), Partial("sum")
NO_COMM: dict[str, int] = {}
ALL_REDUCE = {"all_reduce": 1}


def _data(shape: tuple[int, ...], classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(sum(shape))
    x = torch.randn(*shape, dtype=torch.float64)
    target_shape = shape[:1] + shape[2:]
    target = torch.randint(0, classes, target_shape)
    target.view(-1)[::3] = -100  # some ignored samples
    return x, target, torch.rand(classes, dtype=torch.float64) + 0.5


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("red", ["mean", "sum"])
def test_cross_entropy_batch_cut_with_a_whole_target_is_local(rank, device_mesh_factory, red) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    before = fallback_stats()
    for shape in ((5, 7), (5, 4, 3, 3)):  # 5 samples over 2 ranks: uneven
        x, target, weight = _data(shape, shape[1])
        for cut in [Shard(d) for d in range(len(shape)) if d != 1]:
            check(
                lambda a, t: F.cross_entropy(a, t, reduction=red),
                [x, target],
                [[cut], [R]],
                mesh,
                expect=[P],
                forward_collectives=NO_COMM,
                tag=f"cross_entropy {shape} {cut} {red}",
            )
            check(
                lambda a, t, w: F.cross_entropy(a, t, weight=w, reduction=red),
                [x, target, weight],
                [[cut], [R], [R]],
                mesh,
                constant=(2,),
                expect=[P],
                forward_collectives=NO_COMM,
                tag=f"weighted cross_entropy {shape} {cut} {red}",
            )
    assert fallback_stats() == before


@pytest.mark.distributed(world_size=2)
def test_vocab_parallel_nll_with_whole_weights_counts_locally(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Classes cut, target and class weights replicated: the weighted total is counted on each rank."""
    mesh = device_mesh_factory((2,))
    x, target, weight = _data((6, 7), 7)  # 7 classes over 2 ranks: uneven
    check(
        lambda a, t, w: F.nll_loss(a, t, weight=w),
        [x, target, weight],
        [[Shard(1)], [R], [R]],
        mesh,
        constant=(2,),
        expect=[P],
        forward_collectives=NO_COMM,
        tag="vocab-parallel weighted nll",
    )
    # a cut target still adds up its count: one scalar all-reduce
    check(
        lambda a, t, w: F.nll_loss(a, t, weight=w),
        [x, target, weight],
        [[Shard(0)], [Shard(0)], [R]],
        mesh,
        constant=(2,),
        expect=[P],
        forward_collectives=ALL_REDUCE,
        tag="batch-cut target",
    )


@pytest.mark.distributed(world_size=4)
def test_whole_target_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    x, target, weight = _data((5, 7), 7)
    for cut in ([Shard(0), Shard(1)], [Shard(0), Shard(0)]):
        check(
            lambda a, t, w: F.nll_loss(a, t, weight=w),
            [x, target, weight],
            [cut, [R, R], [R, R]],
            mesh,
            constant=(2,),
            forward_collectives=NO_COMM,
            tag=f"nll 2x2 {cut}",
        )

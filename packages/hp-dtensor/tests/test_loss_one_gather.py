"""Class-cut ``F.cross_entropy`` in one small collective: its ``log_softmax``'s row statistics.

The class dim of the logits cut (vocab-parallel): each rank sends, per row,
its piece's maximum and sum of ``exp(x - max)`` in one ``all_gather``
([Note: sharded softmax] in ``ops/softmax.py``); the nll and label-smoothing
terms are local ([Note: vocab-parallel nll] in ``ops/loss.py``, [Note:
linear partials] in ``ops/pointwise.py``). torch's DTensor gathers the
logits. Checked against one process (values and gradients), with the bytes
counted against the logits' own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Partial, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R, P = Replicate(), Partial("sum")


def _data(rows: int, classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(rows + classes)
    x = torch.randn(rows, classes, dtype=torch.float64) * 4
    target = torch.randint(0, classes, (rows,))
    target[::4] = -100
    probs = torch.softmax(torch.randn(rows, classes, dtype=torch.float64), dim=1)
    return x, target, torch.rand(classes, dtype=torch.float64) + 0.5, probs


_VARIANTS = {
    "mean": lambda a, t, w, p: F.cross_entropy(a, t),
    "none": lambda a, t, w, p: F.cross_entropy(a, t, reduction="none"),
    "weight sum": lambda a, t, w, p: F.cross_entropy(a, t, w, reduction="sum"),
    "smoothing": lambda a, t, w, p: F.cross_entropy(a, t, label_smoothing=0.1),
    "smoothing weight none": lambda a, t, w, p: F.cross_entropy(
        a, t, w, label_smoothing=0.3, reduction="none"
    ),
    "probabilities": lambda a, t, w, p: F.cross_entropy(a, p, w, label_smoothing=0.2),
    "ignore_index 0": lambda a, t, w, p: F.cross_entropy(a, t.clamp(min=0), ignore_index=0),
}


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("classes", [1000, 3])  # 3 classes over 4 ranks: one rank holds none
def test_class_cut_cross_entropy_is_one_small_gather(rank, device_mesh_factory, classes) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    rows = 6
    x, target, weight, probs = _data(rows, classes)
    with fallback_policy("error"):
        for name, fn in _VARIANTS.items():
            check(
                fn,
                [x, target, weight, probs],
                [[Shard(1)], [R], [R], [R]],
                mesh,
                constant=(2, 3),
                expect=[P],
                forward_collectives={"all_gather_into_tensor": 1},
                tag=f"{name} ({classes} classes)",
            )
    logits = distribute_tensor(x, mesh, [Shard(1)])
    targets = distribute_tensor(target, mesh, [R])
    with record_collectives() as log:
        F.cross_entropy(logits, targets)
    # received per rank: a max and a sum per row from each of the 4 ranks (float64)
    assert log.nbytes("all_gather_into_tensor") <= 4 * 2 * rows * 8, log.nbytes()
    if classes == 1000:  # far below gathering the logits (3/4 of them per rank)
        assert log.nbytes() * 50 < x.numel() * 8 * 3 // 4, log.nbytes()


@pytest.mark.distributed(world_size=2)
def test_sharded_softmax_keeps_extremes(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Large logits on one rank only, rows of -inf on one rank, float32: the combined statistics hold."""
    mesh = device_mesh_factory((2,))
    x = torch.randn(4, 6, dtype=torch.float32)
    x[0, :3] += 800.0  # exp would overflow without the shift; the other rank's max is far below
    x[1, 3:] = float("-inf")  # one rank's piece of this row is all -inf
    one = {"all_gather_into_tensor": 1}
    with fallback_policy("error"):
        for fn in (lambda a: torch.log_softmax(a, 1), lambda a: torch.softmax(a, 1)):
            check(fn, [x], [[Shard(1)]], mesh, expect=[Shard(1)], forward_collectives=one)

"""multi_margin_loss and multilabel_margin_loss on a batch cut: local, the reduced loss a partial sum.

Values and input gradients against plain float64 tensors under the
``"error"`` fallback policy, with the collectives counted: none in the
forward or the backward for every reduction, even and uneven batches (5
samples: 3 + 2) and a batch smaller than the mesh (one rank holds none).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Partial, Replicate, Shard

sys.path.insert(0, str(Path(__file__).parent))
from mesh_compare import check_placed, randn

S0, S1, R = Shard(0), Shard(1), Replicate()


def _multilabel_target(n: int, c: int) -> torch.Tensor:
    target = torch.randint(0, c, (n, c))
    target[:, 2:] = -1  # two labels per sample, then the end marker
    return target


@pytest.mark.distributed(world_size=2)
def test_margin_losses_on_a_batch_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    weight = randn(4).abs()
    for n in (5, 1):  # uneven (3 + 2), and one rank with no sample
        x, target = randn(n, 4), torch.randint(0, 4, (n,))
        labels = _multilabel_target(n, 4)
        for reduction in ("none", "sum", "mean"):
            multi = lambda t, y, r=reduction: F.multi_margin_loss(t, y, p=2, margin=0.5, reduction=r)  # noqa: E731
            out = check_placed(multi, [x, target], [[S0], [S0]], mesh)
            assert out.placements == ((S0,) if reduction == "none" else (Partial("sum"),))
            # a class weight (not differentiable: a plain tensor, taken as replicated), the target whole
            weighted = lambda t, y, r=reduction: F.multi_margin_loss(t, y, weight=weight, reduction=r)  # noqa: E731
            check_placed(weighted, [x, target], [[S0], [R]], mesh)
            label = lambda t, y, r=reduction: F.multilabel_margin_loss(t, y, reduction=r)  # noqa: E731
            out = check_placed(label, [x, labels], [[S0], [S0]], mesh)
            assert out.placements == ((S0,) if reduction == "none" else (Partial("sum"),))
    # a class cut compares scores across ranks: gathered, not the fallback
    x, target = randn(4, 5), torch.randint(0, 5, (4,))
    check_placed(F.multi_margin_loss, [x, target], [[S1], [R]], mesh, forward_comms=1, backward_comms=None)


@pytest.mark.distributed(world_size=4)
def test_margin_losses_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    x, target = randn(7, 4), torch.randint(0, 4, (7,))
    out = check_placed(F.multi_margin_loss, [x, target], [[S0, R], [S0, R]], mesh, backward_comms=None)
    assert out.placements == (Partial("sum"), R)
    out = check_placed(F.multilabel_margin_loss, [x, _multilabel_target(7, 4)], [[S0, S0], [S0, S0]], mesh)
    assert out.placements == (Partial("sum"), Partial("sum"))

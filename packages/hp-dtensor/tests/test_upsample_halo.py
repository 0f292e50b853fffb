"""Upsampling an input cut along a spatial dim: an integer scale keeps the cut, by a halo of a row or two.

A single-process property test of the plans (every rank's extended piece,
upsampled, gives exactly its own output rows), then multi-process values and
gradients against plain float64 tensors under ``fallback_policy("error")``,
with the transfers counted; bicubic ``align_corners=True`` and non-integer
scales are gathered and still right (linear modes with aligned corners:
``test_upsample_corners.py``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_dtensor.ops.upsample_halo import plan_upsample
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S2, S3, R = Shard(2), Shard(3), Replicate()
MARGINS = {"nearest": 0, "nearest-exact": 0, "bilinear": 1, "bicubic": 2}


def test_upsample_plans_give_each_rank_its_outputs() -> None:
    rng = random.Random(0)
    planned = 0
    for _ in range(300):
        length, ranks, scale = rng.randint(1, 20), rng.randint(2, 5), rng.randint(1, 4)
        mode = rng.choice(sorted(MARGINS))
        plan = plan_upsample(length, ranks, scale, MARGINS[mode])
        if plan is None:
            continue
        planned += 1
        plane = torch.randn(1, 1, length, 2, dtype=torch.float64)

        def up(x: torch.Tensor, m: str = mode, s: int = scale) -> torch.Tensor:
            return F.interpolate(x, scale_factor=(s, 1), mode=m)

        pieces = []
        for r in range(ranks):
            e0, e1 = plan.ends[r]
            local = up(plane[:, :, e0:e1])
            first = plan.outs[r] - plan.shift[r]
            pieces.append(local[:, :, first : first + plan.outs[r + 1] - plan.outs[r]])
        torch.testing.assert_close(torch.cat(pieces, 2), up(plane), rtol=0, atol=1e-12, msg=str(plan))
    assert planned > 150


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.distributed(world_size=2)
def test_upsampling_a_cut_dim_keeps_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _t(2, 3, 7, 6)
    with fallback_policy("error"):
        for mode in MARGINS:
            for cut in (S2, S3):
                up = lambda x, m=mode: F.interpolate(x, scale_factor=2, mode=m)  # noqa: E731
                check(up, [x], [cut], mesh, expect=[cut], local=False)
            check(
                lambda x, m=mode: F.interpolate(x, size=(21, 6), mode=m),
                [x],
                [S2],
                mesh,
                expect=[S2],
                local=False,
            )
        check(
            lambda x: F.interpolate(x[..., 0], scale_factor=3, mode="linear"),
            [x],
            [S2],
            mesh,
            expect=[S2],
            local=False,
        )
        check(
            lambda x: F.interpolate(x[..., None], scale_factor=2, mode="trilinear"),
            [x],
            [S3],
            mesh,
            expect=[S3],
            local=False,
        )
        # no plan: bicubic with corners aligned, a scale of 1.5; gathered, still right
        corners = lambda x: F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=True)  # noqa: E731
        check(corners, [x], [S2], mesh, expect=[R], local=False)
        check(
            lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest"),
            [x],
            [S2],
            mesh,
            expect=[R],
            local=False,
        )
        xd = distribute_tensor(x, mesh, [S2]).requires_grad_()
        with record_collectives() as forward:
            out = F.interpolate(xd, scale_factor=2, mode="bilinear")
        with record_collectives() as backward:
            (out * out).sum().backward()
    # 7 rows cut 4 + 3, 14 outputs 7 + 7: rank 0 reads row 4 (its last output's right neighbour row),
    # rank 1 rows 2 and 3 (a row of context before the first row its outputs read): buffers of 1 + 2 rows,
    # gathered from both ranks, in the forward and again for the gradient going home
    row = 2 * 3 * 6 * 8
    assert forward.counts() == {"all_gather_into_tensor": 1} and forward.nbytes() == 2 * 3 * row
    assert backward.counts() == {"all_gather_into_tensor": 1} and backward.nbytes() == 2 * 3 * row
    assert 2 * 3 * row < x.numel() * 8


@pytest.mark.distributed(world_size=4)
def test_upsampling_on_four_ranks_swaps_rows_with_neighbours(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(1)
    x = _t(2, 3, 12, 5)
    with fallback_policy("error"):
        for mode in MARGINS:
            check(
                lambda x, m=mode: F.interpolate(x, scale_factor=(3, 2), mode=m),
                [x],
                [S2],
                mesh,
                expect=[S2],
                local=False,
            )
        xd = distribute_tensor(x, mesh, [S2])
        with record_collectives() as log:
            out = F.interpolate(xd, scale_factor=2, mode="bicubic")
    assert out.placements == (S2,) and len(log) == 0 and log.p2p_batches() == 1
    neighbours = (rank > 0) + (rank < 3)
    assert 0 < log.p2p_nbytes("received") <= neighbours * 3 * (2 * 3 * 5 * 8)
    # height on one mesh dim, width on the other: both halos, corners through the first exchange
    grid = device_mesh_factory((2, 2))
    x2 = _t(2, 3, 6, 8)
    full = x2.clone().requires_grad_()
    ref = F.interpolate(full, scale_factor=2, mode="bicubic")
    (ref * ref).sum().backward()
    xd2 = distribute_tensor(x2, grid, [S2, S3]).requires_grad_()
    with fallback_policy("error"):
        out2 = F.interpolate(xd2, scale_factor=2, mode="bicubic")
        (out2 * out2).sum().backward()
    assert out2.placements == (S2, S3)
    torch.testing.assert_close(out2.full_tensor(), ref.detach())
    torch.testing.assert_close(xd2.grad.full_tensor(), full.grad)

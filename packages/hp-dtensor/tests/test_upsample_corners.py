"""Linear, bilinear and trilinear upsampling with ``align_corners=True`` of a cut spatial dim keep the cut.

A single-process property test of the plans and taps (every rank's outputs,
blended from its extended piece, join into the whole op's), then values and
gradients against plain float64 tensors under ``fallback_policy("error")``,
whole-number and other output sizes; the transfers are counted: border rows
in the forward and their gradients home in the backward, never the tensor
(the gather it replaces moved the whole input).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_dtensor.ops.upsample_halo import corner_taps, plan_corners
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, S2, S3, S4, R = Shard(0), Shard(1), Shard(2), Shard(3), Shard(4), Replicate()
GATHER = "all_gather_into_tensor"


def test_corner_plans_give_each_rank_its_outputs() -> None:
    rng = random.Random(0)
    planned = 0
    for _ in range(300):
        length, ranks, out = rng.randint(1, 20), rng.randint(2, 5), rng.randint(1, 50)
        line = torch.randn(1, 1, length, dtype=torch.float64)
        plan = plan_corners(length, ranks, out)
        if plan is None:
            continue
        planned += 1
        pieces = []
        for r in range(ranks):
            e0, e1 = plan.ends[r]
            assert plan.starts[max(r - 1, 0)] <= e0 < e1 <= plan.starts[min(r + 2, ranks)]
            i0, i1, t = corner_taps(plan.outs[r], plan.outs[r + 1], length, out, line.dtype, "cpu")
            assert int(i0.min()) >= e0 and int(i1.max()) < e1
            piece = line[0, 0, e0:e1]
            pieces.append(piece[i0 - e0] * (1 - t) + piece[i1 - e0] * t)
        expected = F.interpolate(line, size=out, mode="linear", align_corners=True)[0, 0]
        torch.testing.assert_close(torch.cat(pieces), expected, rtol=0, atol=1e-12)
    assert planned > 150


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _corners(**kwargs):  # type: ignore[no-untyped-def]
    return lambda x: F.interpolate(x, align_corners=True, **kwargs)


@pytest.mark.distributed(world_size=2)
def test_aligned_corners_keep_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    cases: list[tuple[tuple[int, ...], dict[str, Any], list[Shard]]] = [  # shape, arguments, cuts
        ((2, 3, 7, 6), {"scale_factor": 2, "mode": "bilinear"}, [S2, S3]),
        ((2, 3, 7, 6), {"size": (10, 13), "mode": "bilinear"}, [S2, S3]),  # not whole-number scales
        ((2, 3, 9), {"scale_factor": 3, "mode": "linear"}, [S2]),
        ((1, 2, 5, 4, 6), {"scale_factor": 2, "mode": "trilinear"}, [S2, S3, S4]),
    ]
    with fallback_policy("error"):
        for shape, kwargs, cuts in cases:
            x = _t(*shape)
            for cut in cuts:
                check(_corners(**kwargs), [x], [cut], mesh, expect=[cut], local=False)
            check(_corners(**kwargs), [x], [S0], mesh, expect=[S0])  # a batch cut: local


@pytest.mark.distributed(world_size=2)
def test_aligned_corners_send_border_rows(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    x = _t(2, 3, 8, 6)
    xd = distribute_tensor(x, mesh, [S2]).requires_grad_()
    full = x.clone().requires_grad_()
    ref = F.interpolate(full, scale_factor=2, mode="bilinear", align_corners=True)
    (ref * ref).sum().backward()
    with fallback_policy("error"):
        with record_collectives() as forward:
            out = F.interpolate(xd, scale_factor=2, mode="bilinear", align_corners=True)
        with record_collectives() as backward:
            (out * out).sum().backward()
    # 8 rows cut 4 + 4, 16 outputs 8 + 8 at src = o * 7 / 15: the first rank's last output (7) reads
    # rows 3 and 4, the second rank's first (8) rows 3 and 4: one row each way, in buffers of 1 row
    row = 2 * 3 * 6 * 8
    assert out.placements == (S2,)
    assert forward.counts() == {GATHER: 1} and forward.nbytes() == 2 * 2 * row < x.numel() * 8
    assert backward.count(GATHER) == 1 and backward.nbytes(GATHER) == 2 * 2 * row, list(backward)
    torch.testing.assert_close(out.full_tensor(), ref.detach())
    torch.testing.assert_close(xd.grad.full_tensor(), full.grad)


@pytest.mark.distributed(world_size=4)
def test_aligned_corners_on_four_ranks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(2)
    x = _t(1, 2, 12, 5)
    with fallback_policy("error"):
        check(_corners(size=(30, 7), mode="bilinear"), [x], [S2], mesh, expect=[S2], local=False)
        xd = distribute_tensor(x, mesh, [S2])
        with record_collectives() as log:
            F.interpolate(xd, scale_factor=2, mode="bilinear", align_corners=True)
    assert len(log) == 0 and log.p2p_batches() == 1, list(log)
    # height on one mesh dim, width on the other: both halos, corners through the first exchange
    grid = device_mesh_factory((2, 2))
    x2 = _t(2, 3, 6, 8)
    full = x2.clone().requires_grad_()
    up = _corners(size=(11, 16), mode="bilinear")
    ref = up(full)
    (ref * ref).sum().backward()
    xd2 = distribute_tensor(x2, grid, [S2, S3]).requires_grad_()
    with fallback_policy("error"):
        out2 = up(xd2)
        (out2 * out2).sum().backward()
    assert out2.placements == (S2, S3)
    torch.testing.assert_close(out2.full_tensor(), ref.detach())
    torch.testing.assert_close(xd2.grad.full_tensor(), full.grad)

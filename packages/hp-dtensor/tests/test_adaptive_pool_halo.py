"""Adaptive pooling of an input cut along a spatial dim: windows that line up keep the cut.

When the output size divides the input's, an adaptive pool is a plain pool
with kernel and stride ``L / n``: its halo plan applies. Values, max pooling
indices and every gradient against plain float64 tensors under
``fallback_policy("error")``; windows that do not line up are gathered.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S2, S3, R = Shard(2), Shard(3), Replicate()
GATHER = "all_gather_into_tensor"


@pytest.mark.distributed(world_size=2)
def test_adaptive_pools_that_line_up_keep_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    with fallback_policy("error"):
        for pool in (F.adaptive_avg_pool2d, lambda x, n: F.adaptive_max_pool2d(x, n, return_indices=True)):
            check(lambda x, p=pool: p(x, (3, 4)), [x], [S2], mesh, expect=[S2], local=False)
            check(lambda x, p=pool: p(x, (6, 2)), [x], [S3], mesh, expect=[S3], local=False)
            check(
                lambda x, p=pool: p(x, (4, 4)), [x], [S2], mesh, expect=[R], local=False
            )  # 6 rows to 4: gathered
        check(lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), [x[None]], [S3], mesh, expect=[S3], local=False)
        xd = distribute_tensor(x, mesh, [S2]).requires_grad_()
        with record_collectives() as aligned:
            F.adaptive_avg_pool2d(xd, (2, 4))
        with record_collectives() as forward:
            out = F.adaptive_avg_pool2d(xd, (3, 4))
        with record_collectives() as backward:
            (out * out).sum().backward()
    # 6 rows cut 3 + 3 to 2 outputs (windows of 3 rows): each rank pools its own rows, nothing moves
    assert len(aligned) == 0 and aligned.p2p_count() == 0
    # to 3 outputs (windows of 2 rows) cut 2 + 1: rank 0's second window reads rank 1's first row
    row = 2 * 3 * 8 * 8
    assert out.placements == (S2,) and forward.counts() == {GATHER: 1} and forward.nbytes() == 2 * row
    assert backward.counts() == {GATHER: 1} and backward.nbytes() == 2 * row

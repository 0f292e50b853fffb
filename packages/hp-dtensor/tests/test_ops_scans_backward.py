"""cumprod / logcumsumexp backward on a shard of another dim: as local as the forward.

Their backward formulas (cumprod's has a separate path for zeros) decompose
into more scans, flips and products along the scan dim; with the shards on
another dim every one of them must stay local: values and gradients against
the plain tensor, zero collectives forward and backward, no fallback.
"""

from __future__ import annotations

import pytest
import torch
from hp_dtensor import Shard, distribute_tensor, fallback_stats
from hp_testing import record_collectives

SCANS = {
    "cumprod": lambda x, d: torch.cumprod(x, d),
    "logcumsumexp": lambda x, d: torch.logcumsumexp(x, d),
}


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(SCANS))
@pytest.mark.parametrize(("shape", "cut", "scan"), [((7, 5), 0, 1), ((3, 6, 4), 2, 1), ((5, 4), 1, 0)])
def test_scan_backward_on_other_dim_shard_is_local(rank, device_mesh_factory, name, shape, cut, scan):  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    fn = SCANS[name]
    torch.manual_seed(7)
    full = torch.randn(shape, dtype=torch.float64)
    full.view(-1)[3] = 0.0  # cumprod's backward takes its zero-aware path
    weight = torch.randn(shape, dtype=torch.float64)  # a non-uniform upstream gradient
    ref = full.clone().requires_grad_()
    (fn(ref, scan) * weight).sum().backward()
    x = distribute_tensor(full.clone(), mesh, [Shard(cut)]).requires_grad_()
    w = distribute_tensor(weight, mesh, [Shard(cut)])
    before = fallback_stats()
    with record_collectives() as forward:
        y = fn(x, scan)
    with record_collectives() as backward:
        (y * w).sum().backward()
    assert forward.count() == 0, forward.counts()
    assert backward.count() == 0, backward.counts()
    assert fallback_stats() == before
    assert y.placements == (Shard(cut),) and x.grad.placements == (Shard(cut),)
    torch.testing.assert_close(y.full_tensor(), fn(full, scan), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad, rtol=1e-10, atol=1e-12)

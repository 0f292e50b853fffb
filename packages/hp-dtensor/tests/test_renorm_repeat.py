"""``renorm`` and ``repeat`` on cut inputs, and ``instance_norm`` that repeats its weight (2, 4 ranks).

Values and gradients against plain float64 tensors under the ``"error"``
fallback policy, with the collectives counted: ``renorm`` is local on a cut
of its ``dim`` and shares the slices' norms in one all-reduce when another
dim is cut; ``repeat`` is local on cut dims it does not repeat.
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
from mesh_compare import check_placed, randn

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


@pytest.mark.distributed(world_size=2)
def test_renorm_is_local_on_its_dim_and_one_all_reduce_across(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = randn(3, 5, 4)
    for p, dim, maxnorm in [(2, 0, 1.5), (1, 1, 2.0), (float("inf"), 2, 0.5), (3, -1, 1.0)]:
        fn = lambda t, p=p, dim=dim, maxnorm=maxnorm: torch.renorm(t, p, dim, maxnorm)  # noqa: E731
        d = dim % 3
        out = check_placed(fn, [x], [[Shard(d)]], mesh, backward_comms=None)
        assert out.placements == (Shard(d),)
        for other in {0, 1, 2} - {d}:
            out = check_placed(fn, [x], [[Shard(other)]], mesh, forward_comms=1, backward_comms=None)
            assert out.placements == (Shard(other),)
    # a piece with nothing of the cut dim (1 row over 2 ranks) still gets the slices' norms
    fn = lambda t: torch.renorm(t, 2, 1, 0.5)  # noqa: E731
    check_placed(fn, [randn(1, 4)], [[S0]], mesh, forward_comms=1, backward_comms=None)


@pytest.mark.distributed(world_size=4)
def test_renorm_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    fn = lambda t: torch.renorm(t, 2, 1, 1.0)  # noqa: E731
    check_placed(fn, [randn(5, 6, 3)], [[S1, S0]], mesh, forward_comms=1, backward_comms=None)
    check_placed(fn, [randn(5, 6, 3)], [[S0, S2]], mesh, forward_comms=2, backward_comms=None)


@pytest.mark.distributed(world_size=2)
def test_repeat_keeps_unrepeated_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = randn(3, 4)
    out = check_placed(lambda t: t.repeat(2, 1, 3), [x], [[S0]], mesh, backward_comms=None)
    assert out.placements == (S1,)
    out = check_placed(lambda t: t.repeat(1, 2), [x], [[S0]], mesh, backward_comms=None)
    assert out.placements == (S0,)
    out = check_placed(lambda t: torch.tile(t, (2,)), [x], [[S0]], mesh, backward_comms=None)
    assert out.placements == (S0,)
    # a repeated cut dim is gathered (one all-gather), and replicated inputs stay replicated
    check_placed(lambda t: t.repeat(2, 1), [x], [[S0]], mesh, forward_comms=1, backward_comms=None)
    check_placed(lambda t: t.repeat(2), [randn(5)], [[R]], mesh)
    with fallback_policy("error"):
        part = distribute_tensor(x, mesh, [R]).redistribute(mesh, [Partial("sum")])
        with record_collectives() as log:
            out = part.repeat(2, 2)
        assert len(log) == 0 and out.placements == (Partial("sum"),)
        torch.testing.assert_close(out.full_tensor(), x.repeat(2, 2))


@pytest.mark.distributed(world_size=2)
def test_instance_norm_batch_cut_is_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    w, b = randn(5), randn(5)
    fn = lambda x, w, b: F.instance_norm(x, weight=w, bias=b, eps=0.1)  # noqa: E731
    out = check_placed(fn, [randn(4, 5, 6), w, b], [[S0], [R], [R]], mesh, backward_comms=None)
    assert out.placements == (S0,)

"""``constant_pad_nd`` / ``F.pad`` of a cut dim: neighbours' border rows, local padding, the cut kept.

A single-process property test of the plans (every rank's extended piece,
padded by its own amounts, joins into the padded tensor), then multi-process
values and gradients against plain float64 tensors under
``fallback_policy("error")``, with the transfers counted: no all-gather of the
tensor, only the rows that cross a boundary.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, fallback_policy
from hp_dtensor.ops.pad_halo import plan_pad
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, S2, S3, R = Shard(0), Shard(1), Shard(2), Shard(3), Replicate()
GATHER = "all_gather_into_tensor"


def test_pad_plans_rebuild_the_padded_line() -> None:
    rng = random.Random(0)
    planned = 0
    for _ in range(400):
        length, ranks = rng.randint(1, 30), rng.randint(2, 6)
        before, after = rng.randint(-4, 6), rng.randint(-4, 6)
        if length + before + after <= 0 or min(before, after) <= -length:
            continue  # torch refuses to crop a whole line
        line = torch.arange(1.0, length + 1)
        expected = F.pad(line, (before, after), value=-1.0)
        found = plan_pad(length, ranks, before, after)
        if found is None:
            continue
        planned += 1
        plan, local = found
        pieces = []
        for r in range(ranks):
            e0, e1 = plan.ends[r]
            assert plan.starts[max(r - 1, 0)] <= e0 <= e1 <= plan.starts[min(r + 2, ranks)]
            pieces.append(F.pad(line[e0:e1], local[r], value=-1.0))
            assert pieces[-1].numel() == plan.outs[r + 1] - plan.outs[r]
        torch.testing.assert_close(torch.cat(pieces), expected, rtol=0, atol=0)
    assert planned > 200


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.distributed(world_size=2)
def test_pad_of_a_cut_dim_stays_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _t(2, 3, 9, 8)
    cases = [(1, 2, 0, 1), (0, 0, 2, 0), (1, 1, 1, 1), (0, 0, -2, 3), (0, 0, 3, -1), (-1, 0, 0, 0)]
    with fallback_policy("error"):
        for pad in cases:
            for cut in (S2, S3):
                check(lambda x, p=pad: F.pad(x, p, value=0.5), [x], [cut], mesh, expect=[cut], local=False)
            check(lambda x, p=pad: F.pad(x, p), [x], [S0], mesh, expect=[S0])  # a batch cut: local
        # padding="same" with an even kernel pads (0, 1) then convolves: both keep the height cut
        w, b = _t(4, 3, 2, 4), _t(4)
        same = lambda x, w, b: F.conv2d(x, w, b, padding="same")  # noqa: E731
        check(same, [x, w, b], [S2, R, R], mesh, expect=[S2], local=False)
        xd = distribute_tensor(x, mesh, [S2])
        with record_collectives() as aligned:
            out = F.pad(xd, (0, 0, 1, 2))
        with record_collectives() as log:
            shifted = F.pad(xd, (0, 0, 2, 0))
    # 9 rows cut 5 + 4 padded to 12 rows cut 6 + 6: each rank reads its own rows only, nothing moves
    assert out.placements == (S2,) and len(aligned) == 0 and aligned.p2p_count() == 0
    # padded to 11 rows cut 6 + 5: the second rank reads the first's last row (one row each way in the
    # two ranks' all-gather)
    assert shifted.placements == (S2,) and log.counts() == {GATHER: 1}
    assert log.nbytes() == 2 * (2 * 3 * 8 * 8)


@pytest.mark.distributed(world_size=4)
def test_pad_on_four_ranks_swaps_rows_with_neighbours(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(1)
    x = _t(2, 3, 12, 5)
    with fallback_policy("error"):
        for pad in [(0, 0, 1, 1), (0, 0, 2, 0), (0, 0, -1, 1)]:
            check(lambda x, p=pad: F.pad(x, p), [x], [S2], mesh, expect=[S2], local=False)
        # 5 front rows: rank 0's outputs are all padding, rank 1's read rank 0's rows and its own
        check(lambda x: F.pad(x, (0, 0, 5, 0)), [x], [S2], mesh, expect=[S2], local=False)
        # 7 front rows: rank 1's outputs would read rank 0's rows only: gathered, still right
        check(lambda x: F.pad(x, (0, 0, 7, 0)), [x], [S2], mesh, expect=[R], local=False)
        xd = distribute_tensor(x, mesh, [S2])
        with record_collectives() as log:
            out = F.pad(xd, (0, 0, 1, 1))
    # 12 rows cut 3, 3, 3, 3 padded to 14 cut 4, 4, 4, 2: rank 1 reads 1 row of rank 2, rank 2 reads 2 rows
    # of rank 3; every rank sends its left neighbour its first 2 rows (the widest such border), no gather
    assert out.placements == (S2,) and len(log) == 0 and log.p2p_batches() == 1
    row = 2 * 3 * 5 * 8
    assert log.p2p_nbytes("received") == (2 * row if rank < 3 else 0)
    assert log.p2p_nbytes("sent") == (2 * row if rank > 0 else 0)
    # padding="same" with an even kernel on 4 ranks: the pad's shift and the convolution's halo, no gather
    w, b = _t(4, 3, 4, 2), _t(4)
    with fallback_policy("error"):
        same = lambda x, w, b: F.conv2d(x, w, b, padding="same")  # noqa: E731
        check(same, [x, w, b], [S2, R, R], mesh, expect=[S2], local=False)
        # height on one mesh dim, width on the other, both padded
        grid = device_mesh_factory((2, 2))
        xg = distribute_tensor(x, grid, [S2, S3]).requires_grad_()
        out = F.pad(xg, (1, 2, 2, 1), value=0.5)
        (out * out).sum().backward()
    full = x.clone().requires_grad_()
    ref = F.pad(full, (1, 2, 2, 1), value=0.5)
    (ref * ref).sum().backward()
    assert out.placements == (S2, S3)
    torch.testing.assert_close(out.full_tensor(), ref.detach())
    torch.testing.assert_close(xg.grad.full_tensor(), full.grad)


@pytest.mark.distributed(world_size=2)
def test_pad_value_of_a_partial_counts_once(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    pieces = [torch.full((2, 3), 1.0 + r, dtype=torch.float64) for r in range(2)]
    for op, whole in (
        ("sum", pieces[0] + pieces[1]),
        ("max", pieces[1]),
        ("avg", (pieces[0] + pieces[1]) / 2),
    ):
        partial = DTensor.from_local(pieces[rank].clone(), mesh, [Partial(op)])
        with fallback_policy("error"):
            with record_collectives() as zero_log:
                zero = F.pad(partial, (1, 1))
            filled = F.pad(partial, (1, 1), value=5.0)
        assert zero.placements == (Partial(op),) and len(zero_log) == 0  # zeros are no term of any reduction
        torch.testing.assert_close(zero.full_tensor(), F.pad(whole, (1, 1)))
        # a sum would count the fill value once per rank: reduced first; max and mean of 5s are 5
        assert filled.placements == ((R,) if op == "sum" else (Partial(op),))
        torch.testing.assert_close(filled.full_tensor(), F.pad(whole, (1, 1), value=5.0))

"""Reflection and replication padding (``F.pad(mode="reflect" | "replicate")``) of a cut spatial dim.

A single-process property test of the plans (every rank's rows, picked from
its extended piece, join into the padded line), then values and gradients
against plain float64 tensors under ``fallback_policy("error")`` for 1-d,
2-d and 3-d padding, the cut kept; the transfers are counted: nothing where
the output cut lines up with the input's, border rows otherwise, never the
tensor.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_dtensor.ops.pad_halo import plan_index_pad, source_rows
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, S2, S3, S4, R = Shard(0), Shard(1), Shard(2), Shard(3), Shard(4), Replicate()
GATHER = "all_gather_into_tensor"
MODES = {"reflection": "reflect", "replication": "replicate"}


def test_index_pad_plans_rebuild_the_padded_line() -> None:
    rng = random.Random(0)
    planned = 0
    for _ in range(300):
        length, ranks = rng.randint(1, 30), rng.randint(2, 6)
        before, after = rng.randint(-4, 6), rng.randint(-4, 6)
        for mode, name in MODES.items():
            if length + before + after <= 0 or min(before, after) <= -length:
                continue  # torch refuses to crop a whole line
            if mode == "reflection" and max(before, after) >= length:
                assert plan_index_pad(length, ranks, before, after, mode) is None
                continue  # torch refuses a reflection as wide as the line
            line = torch.arange(1.0, length + 1)
            expected = F.pad(line[None, None], (before, after), mode=name)[0, 0]
            plan = plan_index_pad(length, ranks, before, after, mode)
            if plan is None:
                continue
            planned += 1
            pieces = []
            for r in range(ranks):
                e0, e1 = plan.ends[r]
                assert plan.starts[max(r - 1, 0)] <= e0 < e1 <= plan.starts[min(r + 2, ranks)]
                rows = source_rows(plan.outs[r], plan.outs[r + 1], length, before, mode, "cpu")
                assert int(rows.min()) == e0 and int(rows.max()) == e1 - 1  # reads no row it drops
                pieces.append(line[e0:e1][rows - e0])
            torch.testing.assert_close(torch.cat(pieces), expected, rtol=0, atol=0)
    assert planned > 250


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


_CASES = [  # (shape, pad, cut dims)
    ((2, 3, 9), (2, 1), [S2]),  # 1-d: (N, C, L)
    ((3, 11), (3, 0), [S1]),  # 1-d unbatched (C, L): the first piece's mirror reads its own rows
    ((2, 3, 9, 8), (1, 2, 3, 1), [S2, S3]),
    ((2, 3, 9, 8), (0, 0, 2, 2), [S2, S3]),  # height only: a cut width passes through untouched
    ((2, 3, 9, 8), (1, 1, -2, 3), [S2]),  # a crop at one end, a mirror at the other
    ((2, 5, 8), (2, 2, 4, 1), [S1, S2]),  # 2-d unbatched (C, H, W)
    ((1, 2, 5, 6, 7), (1, 1, 2, 0, 1, 2), [S2, S3, S4]),
]


@pytest.mark.distributed(world_size=2)
def test_reflect_and_replicate_pads_keep_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    with fallback_policy("error"):
        for shape, pad, cuts in _CASES:
            x = _t(*shape)
            for name in MODES.values():
                fn = lambda x, p=pad, m=name: F.pad(x, p, mode=m)  # noqa: E731
                for cut in cuts:
                    check(fn, [x], [cut], mesh, expect=[cut], local=False)
                if len(shape) > len(pad) // 2 + 1:
                    check(fn, [x], [S0], mesh, expect=[S0])  # a batch cut: local


def _row_bytes(shape: tuple[int, ...], dim: int, rows: int) -> int:
    size = 8 * rows
    for d, n in enumerate(shape):
        size *= 1 if d == dim else n
    return size


@pytest.mark.distributed(world_size=2)
def test_index_pad_sends_border_rows_or_nothing(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    x = _t(2, 3, 8, 6)
    for name in MODES.values():
        xd = distribute_tensor(x, mesh, [S2]).requires_grad_()
        with fallback_policy("error"):
            # 8 rows cut 4 + 4, padded by 1 at each end: 10 rows cut 5 + 5, each rank's own rows
            with record_collectives() as aligned:
                out = F.pad(xd, (1, 1, 1, 1), mode=name)
            with record_collectives() as aligned_back:
                out.sum().backward()
            # padded by 3 at the top only: 11 rows cut 6 + 5; the second rank reads one row of the first
            with record_collectives() as shifted:
                out2 = F.pad(xd, (0, 0, 3, 0), mode=name)
            with record_collectives() as shifted_back:
                out2.sum().backward()
        assert out.placements == out2.placements == (S2,)
        assert len(aligned) == 0 and aligned.p2p_count() == 0, list(aligned)
        assert aligned_back.count(GATHER) == 0, list(aligned_back)
        # one gather of 2 ranks' buffers of 1 row each way (forward: the row; backward: its gradient)
        assert shifted.counts() == {GATHER: 1} and shifted.nbytes() == 2 * _row_bytes(x.shape, 2, 1)
        assert shifted_back.count(GATHER) == 1, list(shifted_back)
        expected = F.pad(x, (0, 0, 3, 0), mode=name)
        torch.testing.assert_close(out2.full_tensor(), expected)


@pytest.mark.distributed(world_size=2)
def test_pad_wider_than_a_piece(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A mirror past a thin piece reads the neighbour's rows; a rank reading none of its own gathers."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(2)
    with fallback_policy("error"):
        # 5 rows cut 3 + 2, reflected by 4 at the bottom: 9 rows cut 5 + 4, the second rank's
        # mirror reads rows 0 .. 4, 1 of the first rank's, and the first rank's rows 3 .. 4
        x = _t(1, 2, 5, 3)
        fn = lambda x: F.pad(x, (0, 0, 0, 4), mode="reflect")  # noqa: E731
        check(fn, [x], [S2], mesh, expect=[S2], local=False)
        # replicated by 9 at the top: the second rank's outputs read rows 0 .. 4, the first's whole piece
        fn = lambda x: F.pad(x, (0, 0, 9, 0), mode="replicate")  # noqa: E731
        check(fn, [x], [S2], mesh, expect=[S2], local=False)
        # replicated by 3 at the top, cropped by 2 at the bottom: 6 rows cut 3 + 3, the second rank's
        # read rows 0 .. 2, none of its own: gathered, still right
        fn = lambda x: F.pad(x, (0, 0, 3, -2), mode="replicate")  # noqa: E731
        check(fn, [x], [S2], mesh, expect=[R], local=False)


@pytest.mark.distributed(world_size=4)
def test_index_pad_on_four_ranks(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(3)
    x = _t(1, 2, 12, 5)
    with fallback_policy("error"):
        for name in MODES.values():
            check(lambda x, m=name: F.pad(x, (1, 0, 2, 3), mode=m), [x], [S2], mesh, expect=[S2], local=False)
        xd = distribute_tensor(x, mesh, [S2])
        with record_collectives() as log:
            F.pad(xd, (0, 0, 2, 2), mode="reflect")  # 16 rows cut 4 each: shifted by 1 row per rank
    assert len(log) == 0 and log.p2p_batches() == 1, list(log)
    # height on one mesh dim, width on the other: both halos, corners through the first exchange
    grid = device_mesh_factory((2, 2))
    x2 = _t(2, 3, 7, 6)
    for name in MODES.values():
        fn = lambda x, m=name: F.pad(x, (2, 1, 1, 3), mode=m)  # noqa: E731
        full = x2.clone().requires_grad_()
        ref = fn(full)
        (ref * ref).sum().backward()
        xd2 = distribute_tensor(x2, grid, [S2, S3]).requires_grad_()
        with fallback_policy("error"):
            out2 = fn(xd2)
            (out2 * out2).sum().backward()
        assert out2.placements == (S2, S3)
        torch.testing.assert_close(out2.full_tensor(), ref.detach())
        torch.testing.assert_close(xd2.grad.full_tensor(), full.grad)

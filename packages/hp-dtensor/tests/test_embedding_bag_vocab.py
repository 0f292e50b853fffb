"""F.embedding_bag on a table cut by rows (the vocabulary) pools locally, never gathering the table.

Values and gradients (the table's and the per-sample weights') against
plain float64 tensors under the ``"error"`` fallback policy, with the
collectives counted ([Note: vocab-cut bags] in ``ops/embedding_bag.py``):
``sum`` and ``mean`` are partial sums with no collective forward or
backward; ``max`` shares each rank's best value and position per bag and
column in one small all-gather, ties and empty bags resolved as on one
process.
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

S0, S1, R, SUM = Shard(0), Shard(1), Replicate(), Partial("sum")
IDS = torch.tensor([1, 2, 4, 5, 4, 3, 9, 0, 7, 7, 2])
OFFSETS = torch.tensor([0, 2, 2, 5, 8])  # bag 1 is empty
LAST = torch.tensor([0, 2, 2, 5, 8, 11])  # the same bags, the last offset included


def _bags(mode: str, **options: object):  # type: ignore[no-untyped-def]
    """Each way of naming bags: offsets, a 2-D input, offsets with the last one included."""
    return [
        lambda w: F.embedding_bag(IDS, w, OFFSETS, mode=mode, **options),
        lambda w: F.embedding_bag(IDS[:10].view(2, 5), w, mode=mode, **options),
        lambda w: F.embedding_bag(IDS, w, LAST, mode=mode, include_last_offset=True, **options),
    ]


@pytest.mark.distributed(world_size=2)
def test_vocab_cut_sum_and_mean_are_partial_sums(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for mode in ("sum", "mean"):
        for padding in ({}, {"padding_idx": 4}, {"padding_idx": 7}):  # 7: a whole bag of padding
            for fn in _bags(mode, **padding):
                out = check_placed(fn, [randn(10, 5)], [[S0]], mesh)
                assert out.placements == (SUM,)
        check_placed(_bags(mode)[0], [randn(11, 5)], [[S0]], mesh)  # an uneven cut
    # per-sample weights: their gradient is a partial sum too
    weighted = lambda w, p: F.embedding_bag(IDS, w, OFFSETS, mode="sum", per_sample_weights=p, padding_idx=2)  # noqa: E731
    out = check_placed(weighted, [randn(10, 5), randn(IDS.numel())], [[S0], [R]], mesh)
    assert out.placements == (SUM,)
    # one rank holds no row; ids past the table's first rows
    check_placed(lambda w: F.embedding_bag(IDS % 1, w, OFFSETS, mode="mean"), [randn(1, 3)], [[S0]], mesh)
    with torch.no_grad():  # the forward-only op
        check_placed(lambda w: F.embedding_bag(IDS, w, OFFSETS), [randn(10, 5)], [[S0]], mesh, grad=False)


@pytest.mark.distributed(world_size=2)
def test_vocab_cut_max_shares_best_values_in_one_small_gather(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    table = randn(64, 5)
    ids = torch.tensor([1, 40, 4, 63, 4, 33, 9, 0, 7, 7, 50])
    for padding in ({}, {"padding_idx": 7}):  # 7: bag 3 holds only padding
        fn = lambda w, p=padding: F.embedding_bag(ids, w, OFFSETS, mode="max", **p)  # noqa: E731
        placed = distribute_tensor(table, mesh, [S0])
        with fallback_policy("error"), record_collectives() as log:
            F.embedding_bag(ids, placed, OFFSETS, mode="max", **padding)
        # per rank its best value and first position for 5 bags x 5 columns, in float64: less than the table
        gathered = 2 * 2 * 5 * 5 * 8
        assert [(r.name, r.nbytes) for r in log] == [("all_gather_into_tensor", gathered)]
        assert table.numel() * table.element_size() > gathered
        out = check_placed(fn, [table], [[S0]], mesh, forward_comms=1)
        assert out.placements == (R,)
    for fn in _bags("max"):
        check_placed(fn, [randn(11, 4)], [[S0]], mesh, forward_comms=1)
    # equal rows on both ranks: the first in the bag wins, its row gets the gradient, as on one process
    tied = randn(10, 3)
    tied[9] = tied[1]
    tied[7, 1] = tied[2, 1]
    ids, offsets = torch.tensor([9, 1, 2, 7, 7, 2, 1, 9]), torch.tensor([0, 2, 4, 6])
    fn = lambda w: F.embedding_bag(ids, w, offsets, mode="max")  # noqa: E731
    check_placed(fn, [tied], [[S0]], mesh, forward_comms=1)


@pytest.mark.distributed(world_size=2)
def test_vocab_cut_without_a_plan_gathers(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    # scale_grad_by_freq: the table is gathered (a redistribution, not the fallback), values still right
    fn = lambda w: F.embedding_bag(IDS, w, OFFSETS, scale_grad_by_freq=True)  # noqa: E731
    out = check_placed(fn, [randn(10, 5)], [[S0]], mesh, forward_comms=1, backward_comms=None)
    assert out.placements == (R,)


@pytest.mark.distributed(world_size=2)
def test_column_cut_with_the_last_offset_included(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    # the CPU kernel's bag_size had one entry fewer than the meta kernel's: an internal error before
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for mode in ("sum", "mean", "max"):
        out = check_placed(_bags(mode)[2], [randn(10, 5)], [[S1]], mesh)
        assert out.placements == (S1,)


@pytest.mark.distributed(world_size=4)
def test_vocab_cut_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    for mode in ("sum", "mean", "max"):
        fn = lambda w, m=mode: F.embedding_bag(IDS, w, OFFSETS, mode=m, padding_idx=4)  # noqa: E731
        rows = SUM if mode != "max" else R
        gathers = 1 if mode == "max" else 0
        # rows over one mesh dim, columns over the other
        out = check_placed(fn, [randn(10, 6)], [[S0, S1]], mesh, forward_comms=gathers)
        assert out.placements == (rows, S1)
        out = check_placed(fn, [randn(10, 6)], [[S1, S0]], mesh, forward_comms=gathers)
        assert out.placements == (S1, rows)
        # rows over both mesh dims, 3 rows over 4 ranks: one rank holds none
        small = lambda w, m=mode: F.embedding_bag(IDS % 3, w, OFFSETS, mode=m, padding_idx=1)  # noqa: E731
        out = check_placed(small, [randn(3, 4)], [[S0, S0]], mesh, forward_comms=2 * gathers)
        assert out.placements == (rows, rows)

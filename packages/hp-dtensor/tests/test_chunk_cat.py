"""``_chunk_cat`` (FSDP2's reduce-scatter packing) keeps leading and chunk-aligned cuts locally (2, 4 ranks).

Values against the op on plain float64 tensors under the ``"error"``
fallback policy, with the collectives counted: none where the cut is
local, one gather where it is not (a cut inside the chunks, or a cut of the
chunked dim off the chunk boundaries). The op has no autograd formula.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import Partial, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from mesh_compare import check_placed, randn

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


def _cat(dim: int, chunks: int):  # type: ignore[no-untyped-def]
    return lambda *ts: torch._chunk_cat(list(ts), dim, chunks)


@pytest.mark.distributed(world_size=2)
def test_chunk_cat_keeps_leading_and_aligned_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    # a leading-dim cut (dim 0 before the chunked dim 1), even and uneven
    for rows in (4, 3):
        out = check_placed(_cat(1, 2), [randn(rows, 6, 2), randn(rows, 3)], [[S0], [S0]], mesh, grad=False)
        assert out.placements == (S0,)
    # FSDP2's case: dim 0 chunked into 2 (or 4) chunks, gradients cut evenly on dim 0
    for chunks in (2, 4):
        grads = [randn(8, 3), randn(4, 5), randn(8)]
        out = check_placed(_cat(0, chunks), grads, [[S0]] * 3, mesh, grad=False)
        assert out.placements == (S0,)
    # uneven and aligned: 7 and 8 rows in 4 chunks of 2 rows; ranks hold rows 4 + 3 and 4 + 4, chunks 2 + 2
    out = check_placed(_cat(0, 4), [randn(7, 2), randn(8, 3)], [[S0], [S0]], mesh, grad=False)
    assert out.placements == (S0,)
    # 6 rows in 3 chunks of 2: rank 0 holds rows 0-2 but chunks 0-1 need rows 0-3: gathered
    check_placed(_cat(0, 3), [randn(6, 2)], [[S0]], mesh, grad=False, forward_comms=1)
    # 5 rows cut 3 + 2, 2 chunks of 3 rows: rank 1's chunk holds rows 3-4 and the padding
    out = check_placed(_cat(0, 2), [randn(5, 2)], [[S0]], mesh, grad=False)
    assert out.placements == (S0,)
    # a cut after the chunked dim interleaves inside the chunks: gathered (one all-gather per input)
    check_placed(_cat(0, 2), [randn(4, 6), randn(4, 3)], [[S1], [S1]], mesh, grad=False, forward_comms=2)
    # a replicated input beside a cut one is cut alike, locally (FSDP2 packs gradients of both kinds)
    out = check_placed(_cat(1, 2), [randn(3, 6, 2), randn(3, 3)], [[S0], [R]], mesh, grad=False)
    assert out.placements == (S0,)
    # replicated inputs: nothing to do
    check_placed(_cat(0, 2), [randn(4, 6)], [[R]], mesh, grad=False)


@pytest.mark.distributed(world_size=2)
def test_chunk_cat_keeps_sum_partials(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b = randn(5, 3), randn(2, 4)
    with fallback_policy("error"):
        parts = [distribute_tensor(t, mesh, [R]).redistribute(mesh, [Partial("sum")]) for t in (a, b)]
        with record_collectives() as log:
            out = torch._chunk_cat(parts, 0, 2)
        assert len(log) == 0 and out.placements == (Partial("sum"),)
        torch.testing.assert_close(out.full_tensor(), torch._chunk_cat([a, b], 0, 2))


@pytest.mark.distributed(world_size=4)
def test_chunk_cat_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    # HSDP-like: dim 0 cut on the first mesh dim, dim 1 (the chunked dim, 4 chunks) on the second
    out = check_placed(_cat(1, 4), [randn(3, 8, 2), randn(3, 4)], [[S0, S1], [S0, S1]], mesh, grad=False)
    assert out.placements == (S0, S1)
    # both mesh dims cut the chunked dim: 4 chunks, one per rank
    out = check_placed(_cat(0, 4), [randn(8, 3), randn(4)], [[S0, S0], [S0, S0]], mesh, grad=False)
    assert out.placements == (S0, S0)

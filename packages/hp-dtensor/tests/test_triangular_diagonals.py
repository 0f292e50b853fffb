"""tril / triu, trace and the diagonal ops on cut inputs, with no communication (2 and 4 ranks).

Values and gradients against plain float64 tensors under the ``"error"``
fallback policy, with the collectives of the forward and the backward
counted. Sizes are odd, so row and column cuts are uneven (5 rows: 3 + 2).
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


@pytest.mark.distributed(world_size=2)
def test_tril_triu_shift_the_diagonal_by_the_piece_start(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for op in (torch.tril, torch.triu):
        for k in (-2, 0, 1, 3):
            fn = lambda t, op=op, k=k: op(t, k)  # noqa: E731
            for cut in (S0, S1):
                out = check_placed(fn, [randn(5, 4)], [[cut]], mesh)
                assert out.placements == (cut,)
            for cut in (S0, S1, S2):  # batched: batch, row and column cuts
                check_placed(fn, [randn(3, 5, 7)], [[cut]], mesh)
    with fallback_policy("error"):  # a partial sum stays partial
        x = randn(4, 4)
        part = distribute_tensor(x, mesh, [R]).redistribute(mesh, [Partial("sum")])
        with record_collectives() as log:
            out = torch.tril(part, -1)
        assert len(log) == 0 and out.placements == (Partial("sum"),)
        torch.testing.assert_close(out.full_tensor(), torch.tril(x, -1))


@pytest.mark.distributed(world_size=4)
def test_tril_triu_and_trace_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    for op in (torch.tril, torch.triu):
        out = check_placed(lambda t, op=op: op(t, 1), [randn(5, 7)], [[S0, S1]], mesh)
        assert out.placements == (S0, S1)
        check_placed(lambda t, op=op: op(t, -1), [randn(3, 5, 6)], [[S0, S2]], mesh)
        check_placed(lambda t, op=op: op(t), [randn(7, 5)], [[S0, S0]], mesh)
    out = check_placed(torch.trace, [randn(5, 7)], [[S1, S0]], mesh, backward_comms=None)
    assert out.placements == (Partial("sum"), Partial("sum"))
    check_placed(lambda t: torch.diagonal(t, 1, 1, 2), [randn(5, 4, 3)], [[S0, R]], mesh)


@pytest.mark.distributed(world_size=2)
def test_trace_is_a_partial_sum(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for shape in [(5, 5), (5, 3), (3, 6)]:
        for cut in (S0, S1):
            out = check_placed(torch.trace, [randn(*shape)], [[cut]], mesh, backward_comms=None)
            assert out.placements == (Partial("sum"),)
    with fallback_policy("error"):  # integers keep the op's result dtype
        ints = torch.arange(20).reshape(5, 4)
        got = torch.trace(distribute_tensor(ints, mesh, [S0]))
        assert got.dtype == torch.int64 and got.full_tensor().item() == torch.trace(ints).item()


@pytest.mark.distributed(world_size=2)
def test_diagonal_ops_keep_batch_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = randn(3, 4, 5)
    out = check_placed(lambda t: torch.diagonal(t, 0, 1, 2), [x], [[S0]], mesh)
    assert out.placements == (S0,)
    out = check_placed(lambda t: torch.diagonal(t, -1, 0, 2), [x], [[S1]], mesh)
    assert out.placements == (S0,)
    out = check_placed(lambda t: torch.linalg.diagonal(t, offset=1), [x], [[S0]], mesh)
    assert out.placements == (S0,)
    check_placed(lambda t: torch.diagonal_copy(t, 1, 2, 0), [x], [[S1]], mesh)
    out = check_placed(lambda t: torch.diag_embed(t, 1), [x], [[S0]], mesh)
    assert out.placements == (S0,)
    out = check_placed(lambda t: torch.diag_embed(t, 0, 0, 2), [x], [[S1]], mesh)
    assert out.placements == (Shard(3),)  # output dims 0 and 2 are new: input dim 1 lands on dim 3
    src = randn(3, 4)
    out = check_placed(lambda a, b: torch.diagonal_scatter(a, b, 0, 1, 2), [x, src], [[S0], [S0]], mesh)
    assert out.placements == (S0,)
    check_placed(lambda a, b: torch.diagonal_scatter(a, b, 0, 1, 2), [x, src], [[S0], [R]], mesh)
    # diag / diag_embed of a cut vector: the rank's rows of the matrix (5 = 3 + 2 entries and rows)
    out = check_placed(torch.diag, [randn(5)], [[S0]], mesh)
    assert out.placements == (S0,)
    out = check_placed(torch.diag_embed, [x], [[S2]], mesh)  # 5 x 5 matrices, rows 3 + 2
    assert out.placements == (S2,)
    # offset -2: 7 x 7 matrices whose rows (4 + 3) and columns hold 2 + 3 and 4 + 1 entries: gathered
    check_placed(lambda t: torch.diag_embed(t, -2), [x], [[S2]], mesh, forward_comms=1, backward_comms=None)
    # offset 1: 6 x 6 matrices cut 3 + 3 rows, holding entries 0-2 and 3-4: the entries' own 3 + 2
    out = check_placed(lambda t: torch.diag_embed(t, 1), [randn(5)], [[S0]], mesh)
    assert out.placements == (S0,)
    check_placed(torch.diagflat, [randn(2, 3)], [[S0]], mesh, forward_comms=None, backward_comms=None)
    # a matrix-dim cut whose runs are the output's pieces is local: rows of 4 x 5 matrices, 2 + 2
    out = check_placed(lambda t: torch.diagonal(t, 0, 1, 2), [x], [[S1]], mesh)
    assert out.placements == (S1,)


@pytest.mark.distributed(world_size=2)
def test_diagonal_of_cut_matrix_dims(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    square = randn(5, 5)  # rows and columns cut 3 + 2, as the diagonal's 5 elements
    for cut in (S0, S1):
        out = check_placed(torch.diagonal, [square], [[cut]], mesh)
        assert out.placements == (S0,)
        check_placed(torch.diag, [square], [[cut]], mesh)
    out = check_placed(lambda t: torch.diagonal(t, 1), [randn(5, 7)], [[S0]], mesh)  # 5 elements, rows 3 + 2
    assert out.placements == (S0,)
    out = check_placed(lambda t: torch.diagonal(t, -2), [randn(7, 5)], [[S1]], mesh)  # 5 elements, columns
    assert out.placements == (S0,)
    # offset 1 of a square matrix: 4 elements (2 + 2), but rows 3 + 2 hold 3 + 1 of them: gathered
    check_placed(lambda t: torch.diagonal(t, 1), [square], [[S0]], mesh, forward_comms=1, backward_comms=None)


@pytest.mark.distributed(world_size=4)
def test_diagonal_of_cut_matrix_dims_on_a_2d_mesh(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    torch.manual_seed(0)
    out = check_placed(lambda t: torch.diagonal(t, 0, 1, 2), [randn(3, 8, 8)], [[S0, S1]], mesh)
    assert out.placements == (S0, S1)
    out = check_placed(torch.diagonal, [randn(8, 8)], [[S0, S0]], mesh)
    assert out.placements == (S0, S0)

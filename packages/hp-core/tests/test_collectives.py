"""Every collective against a hand-computed result, natively and through its emulation.

"emulated" runs under a capability entry for gloo that claims nothing but the
basic reduce ops, which forces every emulation path (avg, premul_sum, the
list all-gather, all-reduce-based reduce-scatter, p2p all-to-all) on gloo.
"""

from __future__ import annotations

import contextlib
import math

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_core import BackendCapabilities, Work, use_capabilities


def on_ranks(*sizes: int) -> pytest.MarkDecorator:
    """Parametrize a test over world sizes, each run by the harness on that many ranks."""
    return pytest.mark.parametrize(
        "n", [pytest.param(s, marks=pytest.mark.distributed(world_size=s), id=f"{s}ranks") for s in sizes]
    )


MODES = pytest.mark.parametrize("mode", ["native", "emulated"])


def capabilities(mode: str) -> contextlib.AbstractContextManager[object]:
    if mode == "native":
        return contextlib.nullcontext()
    return use_capabilities(BackendCapabilities("gloo"))


def expected_reduction(op: str, n: int, scale: float = 0.5) -> float:
    """The reduction of the values 1, 2, ..., n (rank r contributes r + 1)."""
    return {
        "sum": n * (n + 1) / 2,
        "avg": (n + 1) / 2,
        "max": float(n),
        "min": 1.0,
        "product": float(math.factorial(n)),
        "premul_sum": scale * n * (n + 1) / 2,
    }[op]


# -- all_reduce -------------------------------------------------------------------------------


@on_ranks(1, 2, 4)
@MODES
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product", "premul_sum"])
def test_all_reduce(rank, world_size, n, mode, op):
    assert world_size == n
    scale = 0.5 if op == "premul_sum" else None
    tensor = torch.full((3, 2), float(rank + 1), dtype=torch.float64)
    with capabilities(mode):
        out = hp_core.all_reduce(tensor, op, scale=scale)
    assert out is tensor
    assert torch.equal(tensor, torch.full((3, 2), expected_reduction(op, n), dtype=torch.float64))


@on_ranks(2, 4)
@MODES
@pytest.mark.parametrize("op", ["avg", "premul_sum"])
def test_all_reduce_async_finishes_on_wait(rank, world_size, n, mode, op):
    scale = 0.25 if op == "premul_sum" else None
    tensor = torch.full((5,), float(rank + 1))
    with capabilities(mode):
        work = hp_core.all_reduce(tensor, op, async_op=True, scale=scale)
        assert isinstance(work, Work)
        result = work.wait()
    assert result is tensor and work.is_completed()
    assert torch.allclose(tensor, torch.full((5,), expected_reduction(op, n, 0.25)))


@pytest.mark.distributed(world_size=2)
def test_all_reduce_accepts_torch_reduce_ops(rank, world_size):
    tensor = torch.tensor([float(rank), 10.0 - rank])
    hp_core.all_reduce(tensor, dist.ReduceOp.MAX)
    assert tensor.tolist() == [1.0, 10.0]


@pytest.mark.distributed(world_size=2)
def test_all_reduce_integer_sum_and_max(rank, world_size):
    tensor = torch.tensor([rank + 1, 7 * rank], dtype=torch.int64)
    hp_core.all_reduce(tensor)
    assert tensor.tolist() == [3, 7]
    tensor = torch.tensor([rank], dtype=torch.int32)
    hp_core.all_reduce(tensor, "MAX")
    assert tensor.tolist() == [1]


@pytest.mark.distributed(world_size=2)
def test_all_reduce_argument_errors_come_before_communication(rank, world_size):
    grid = torch.ones(4, 4)
    with pytest.raises(
        ValueError, match=r"tensor is not contiguous \(shape \(4,\), stride \(4,\)\).*contiguous\(\)"
    ):
        hp_core.all_reduce(grid[:, 0])
    with pytest.raises(ValueError, match=r"op='avg' needs a floating-point tensor, got dtype torch.int64"):
        hp_core.all_reduce(torch.ones(2, dtype=torch.int64), "avg")
    with pytest.raises(ValueError, match=r"op='premul_sum' needs a numeric scale=, got None"):
        hp_core.all_reduce(torch.ones(2), "premul_sum")
    with pytest.raises(ValueError, match=r"scale=2.0 only applies to op='premul_sum', but op='sum'"):
        hp_core.all_reduce(torch.ones(2), "sum", scale=2.0)
    with pytest.raises(ValueError, match=r"unsupported reduce op 'mean'"):
        hp_core.all_reduce(torch.ones(2), "mean")
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor, got list"):
        hp_core.all_reduce([1.0])  # type: ignore[call-overload]
    assert torch.equal(grid, torch.ones(4, 4))  # nothing was touched
    # Every rank raised locally, so the group is still in step: a real collective works.
    check = torch.tensor([float(rank + 1)])
    hp_core.all_reduce(check)
    assert check.item() == 3.0


# -- all_gather_into_tensor ---------------------------------------------------------------------


@on_ranks(2, 4)
@MODES
def test_all_gather_even(rank, world_size, n, mode):
    local = torch.full((2, 3), float(rank))
    output = torch.empty((2 * n, 3))
    with capabilities(mode):
        assert hp_core.all_gather_into_tensor(output, local) is output
    expected = torch.cat([torch.full((2, 3), float(r)) for r in range(n)])
    assert torch.equal(output, expected)


@on_ranks(2, 4)
@MODES
def test_all_gather_even_async_into_stacked_output(rank, world_size, n, mode):
    local = torch.arange(3.0) + 10 * rank
    output = torch.empty((n, 3))  # torch also accepts the stacked layout
    with capabilities(mode):
        work = hp_core.all_gather_into_tensor(output, local, async_op=True)
        assert work.wait() is output
    assert torch.equal(output, torch.stack([torch.arange(3.0) + 10 * r for r in range(n)]))


@on_ranks(1, 2, 4)
@MODES
def test_all_gather_uneven_sizes_rank_plus_one(rank, world_size, n, mode):
    sizes = [r + 1 for r in range(n)]
    local = torch.full((rank + 1, 2), float(rank), dtype=torch.float64)
    output = torch.empty((sum(sizes), 2), dtype=torch.float64)
    with capabilities(mode):
        work = hp_core.all_gather_into_tensor(output, local, async_op=True, input_sizes=sizes)
        assert work.wait() is output
    expected = torch.cat([torch.full((r + 1, 2), float(r), dtype=torch.float64) for r in range(n)])
    assert torch.equal(output, expected)


@pytest.mark.distributed(world_size=4)
def test_all_gather_uneven_with_empty_ranks(rank, world_size):
    sizes = [0, 3, 0, 1]
    local = torch.arange(sizes[rank], dtype=torch.int64) + 100 * rank
    output = torch.empty(4, dtype=torch.int64)
    hp_core.all_gather_into_tensor(output, local, input_sizes=sizes)
    assert output.tolist() == [100, 101, 102, 300]


@pytest.mark.distributed(world_size=2)
def test_all_gather_argument_errors(rank, world_size):
    with pytest.raises(
        ValueError, match=r"output_tensor has 5 elements .* 2 ranks x input shape \(2,\) gather 4"
    ):
        hp_core.all_gather_into_tensor(torch.empty(5), torch.ones(2))
    with pytest.raises(
        ValueError, match=r"input_tensor has dtype torch.float32 but output_tensor has dtype torch.float64"
    ):
        hp_core.all_gather_into_tensor(torch.empty(4, dtype=torch.float64), torch.ones(2))
    with pytest.raises(ValueError, match=r"input_sizes has 3 entries \[1, 1, 1\] but the group has 2 ranks"):
        hp_core.all_gather_into_tensor(torch.empty(3), torch.ones(1), input_sizes=[1, 1, 1])
    with pytest.raises(
        ValueError, match=rf"input_sizes\[{rank}\]=5 \(this rank's entry\) but input_tensor has size 1"
    ):
        hp_core.all_gather_into_tensor(torch.empty(10), torch.ones(1), input_sizes=[5, 5])
    with pytest.raises(
        ValueError, match=r"output_tensor has shape \(4,\) but input_sizes=\[1, 2\].*gather into \(3,\)"
    ):
        local = torch.ones(rank + 1)
        hp_core.all_gather_into_tensor(torch.empty(4), local, input_sizes=[1, 2])
    with pytest.raises(
        ValueError, match=r"output_tensor is not contiguous \(shape \(2, 2\), stride \(1, 2\)\)"
    ):
        hp_core.all_gather_into_tensor(torch.empty(2, 2).t(), torch.ones(2))
    with pytest.raises(ValueError, match=r"input_sizes=\[1, -1\] must hold non-negative ints"):
        hp_core.all_gather_into_tensor(torch.empty(0), torch.ones(1), input_sizes=[1, -1])


# -- reduce_scatter_tensor ---------------------------------------------------------------------


@on_ranks(1, 2, 4)
@MODES
@pytest.mark.parametrize("op", ["sum", "avg", "premul_sum", "max"])
def test_reduce_scatter(rank, world_size, n, mode, op):
    scale = 0.5 if op == "premul_sum" else None
    base = torch.arange(2.0 * n, dtype=torch.float64)
    source = base * (rank + 1)
    output = torch.empty(2, dtype=torch.float64)
    with capabilities(mode):
        work = hp_core.reduce_scatter_tensor(output, source, op, async_op=True, scale=scale)
        assert work.wait() is output
    factor = expected_reduction(op, n)
    assert torch.equal(output, base[2 * rank : 2 * rank + 2] * factor)
    assert torch.equal(source, base * (rank + 1))  # the input is never modified


@pytest.mark.distributed(world_size=2)
def test_reduce_scatter_2d_chunks(rank, world_size):
    source = torch.arange(12.0).view(4, 3) + rank
    output = torch.empty(2, 3)
    hp_core.reduce_scatter_tensor(output, source)
    assert torch.equal(output, (torch.arange(12.0).view(4, 3) * 2 + 1)[2 * rank : 2 * rank + 2])


@pytest.mark.distributed(world_size=2)
def test_reduce_scatter_argument_errors(rank, world_size):
    with pytest.raises(ValueError, match=r"input has 5 elements .* must hold 2 ranks x output's 2"):
        hp_core.reduce_scatter_tensor(torch.empty(2), torch.ones(5))
    with pytest.raises(ValueError, match=r"op='avg' needs a floating-point tensor"):
        hp_core.reduce_scatter_tensor(
            torch.empty(1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), "avg"
        )
    with pytest.raises(ValueError, match=r"input is not contiguous"):
        hp_core.reduce_scatter_tensor(torch.empty(2), torch.ones(2, 4)[:, 0:2])


# -- all_to_all_single --------------------------------------------------------------------------


@on_ranks(2, 4)
@MODES
def test_all_to_all_even(rank, world_size, n, mode):
    source = torch.arange(2.0 * n) + 100 * rank
    output = torch.empty(2 * n)
    with capabilities(mode):
        assert hp_core.all_to_all_single(output, source) is output
    expected = [100.0 * j + 2 * rank + k for j in range(n) for k in range(2)]
    assert output.tolist() == expected


@on_ranks(1, 2, 4)
@MODES
def test_all_to_all_uneven(rank, world_size, n, mode):
    # Rank i sends (i + j) % 3 rows to rank j, each row filled with 10 * i + j; some chunks are empty.
    def rows(i: int, j: int) -> int:
        return (i + j) % 3

    in_splits = [rows(rank, j) for j in range(n)]
    out_splits = [rows(j, rank) for j in range(n)]
    source = torch.cat([torch.full((rows(rank, j), 2), float(10 * rank + j)) for j in range(n)])
    output = torch.empty((sum(out_splits), 2))
    with capabilities(mode):
        work = hp_core.all_to_all_single(output, source, out_splits, in_splits, async_op=True)
        work.wait()
    expected = torch.cat([torch.full((rows(j, rank), 2), float(10 * j + rank)) for j in range(n)])
    assert torch.equal(output, expected)


@pytest.mark.distributed(world_size=2)
def test_all_to_all_argument_errors(rank, world_size):
    with pytest.raises(
        ValueError, match=r"input_split_sizes is None, so dim 0 \(size 3, shape \(3,\)\) must divide"
    ):
        hp_core.all_to_all_single(torch.empty(4), torch.ones(3))
    with pytest.raises(ValueError, match=r"input_split_sizes=\[1, 1\] add up to 2 but the tensor has size 3"):
        hp_core.all_to_all_single(torch.empty(2), torch.ones(3), [1, 1], [1, 1])
    with pytest.raises(
        ValueError, match=r"input shape \(2, 3\) and output shape \(2, 2\) must agree beyond dim 0"
    ):
        hp_core.all_to_all_single(torch.empty(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"must be at least 1-D"):
        hp_core.all_to_all_single(torch.empty(()), torch.ones(()))


# -- broadcast, barrier, objects ---------------------------------------------------------------


@on_ranks(1, 2, 4)
def test_broadcast_from_last_rank(rank, world_size, n):
    tensor = torch.full((3,), float(rank))
    assert hp_core.broadcast(tensor, src=n - 1) is tensor
    assert tensor.tolist() == [float(n - 1)] * 3
    tensor = torch.full((2,), float(rank))
    hp_core.broadcast(tensor, group_src=0, async_op=True).wait()
    assert tensor.tolist() == [0.0, 0.0]


@pytest.mark.distributed(world_size=2)
def test_broadcast_argument_errors(rank, world_size):
    with pytest.raises(ValueError, match=r"exactly one of src .* got src=0, group_src=0"):
        hp_core.broadcast(torch.ones(1), 0, group_src=0)
    with pytest.raises(ValueError, match=r"exactly one of src"):
        hp_core.broadcast(torch.ones(1))
    with pytest.raises(ValueError, match=r"src=5 is not in the group, whose global ranks are \[0, 1\]"):
        hp_core.broadcast(torch.ones(1), src=5)
    with pytest.raises(ValueError, match=r"group_src=2 must be an int in \[0, 2\)"):
        hp_core.broadcast(torch.ones(1), group_src=2)


@on_ranks(2, 4)
def test_barrier_sync_and_async(rank, world_size, n):
    assert hp_core.barrier() is None
    work = hp_core.barrier(async_op=True)
    assert work.wait() is None and work.is_completed()


@on_ranks(2, 4)
def test_objects(rank, world_size, n):
    gathered = hp_core.all_gather_object({"rank": rank, "rows": [rank] * rank})
    assert gathered == [{"rank": r, "rows": [r] * r} for r in range(n)]
    payload = {"step": 3, "name": "from-1"} if rank == 1 else None
    assert hp_core.broadcast_object(payload, src=1) == {"step": 3, "name": "from-1"}


# -- eight ranks --------------------------------------------------------------------------------


@pytest.mark.distributed(world_size=8)
def test_collectives_on_eight_ranks(rank, world_size):
    tensor = torch.full((2,), float(rank + 1))
    hp_core.all_reduce(tensor, "avg")
    assert tensor.tolist() == [4.5, 4.5]

    sizes = [r + 1 for r in range(8)]
    output = torch.empty(sum(sizes))
    hp_core.all_gather_into_tensor(output, torch.full((rank + 1,), float(rank)), input_sizes=sizes)
    assert output.tolist() == [float(r) for r in range(8) for _ in range(r + 1)]

    in_splits = [(rank + j) % 3 for j in range(8)]
    out_splits = [(j + rank) % 3 for j in range(8)]
    source = torch.cat([torch.full(((rank + j) % 3,), float(10 * rank + j)) for j in range(8)])
    received = torch.empty(sum(out_splits))
    hp_core.all_to_all_single(received, source, out_splits, in_splits)
    assert received.tolist() == [float(10 * j + rank) for j in range(8) for _ in range((j + rank) % 3)]

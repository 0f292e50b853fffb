"""Built-in ``out=`` overloads on DTensors: the result lands in ``out``, placed as ``out`` is.

``torch.mul(a, b, out=c)`` with ``a``, ``b`` cut on rows and ``c`` replicated
used to leave one shard per rank in ``c`` while ``c`` still said
``Replicate()``: silently wrong, no error. Every case here is checked against
the same call on plain tensors, for each placement of ``out``, and the
communication is counted where ``out`` already has the result's placements
([Note: built-in out= overloads] in ``hp_dtensor/out_variants.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hp_dtensor import DTensor, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives

A = torch.arange(24.0).reshape(6, 4) / 7 - 1
B = torch.linspace(-2, 3, 24).reshape(6, 4)
M = torch.linspace(-1, 1, 20).reshape(4, 5)

# (name, function of (x, y, m, out) -> result, plain output shapes and dtypes)
CASES = [
    ("mul", lambda x, y, m, out: torch.mul(x, y, out=out[0]), [((6, 4), torch.float32)]),
    ("add_alpha", lambda x, y, m, out: torch.add(x, y, alpha=2.5, out=out[0]), [((6, 4), torch.float32)]),
    ("exp", lambda x, y, m, out: torch.exp(x, out=out[0]), [((6, 4), torch.float32)]),
    ("clamp", lambda x, y, m, out: torch.clamp(x, -0.5, 0.5, out=out[0]), [((6, 4), torch.float32)]),
    ("where", lambda x, y, m, out: torch.where(x > 0, x, y, out=out[0]), [((6, 4), torch.float32)]),
    ("sum_dim", lambda x, y, m, out: torch.sum(x, dim=1, out=out[0]), [((6,), torch.float32)]),
    ("sum_rows", lambda x, y, m, out: torch.sum(x, dim=0, out=out[0]), [((4,), torch.float32)]),
    ("cumsum", lambda x, y, m, out: torch.cumsum(x, 0, out=out[0]), [((6, 4), torch.float32)]),
    ("mm", lambda x, y, m, out: torch.mm(x, m, out=out[0]), [((6, 5), torch.float32)]),
    ("addmm", lambda x, y, m, out: torch.addmm(y[:, :1], x, m, out=out[0]), [((6, 5), torch.float32)]),
    ("cat", lambda x, y, m, out: torch.cat([x, y], 1, out=out[0]), [((6, 8), torch.float32)]),
    ("float_into_double", lambda x, y, m, out: torch.mul(x, y, out=out[0]), [((6, 4), torch.float64)]),
    (
        "sort",
        lambda x, y, m, out: torch.sort(x, 1, out=(out[0], out[1])),
        [((6, 4), torch.float32), ((6, 4), torch.int64)],
    ),
    (
        "max_dim",
        lambda x, y, m, out: torch.max(x, 1, out=(out[0], out[1])),
        [((6,), torch.float32), ((6,), torch.int64)],
    ),
]


def _placements_for(shape: tuple[int, ...]) -> list[list]:
    return [[Replicate()]] + [[Shard(d)] for d in range(len(shape))]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_out_keeps_its_placements_and_gets_the_plain_values(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    call, outs = next((c[1], c[2]) for c in CASES if c[0] == name)
    mesh = device_mesh_factory((2,))
    expected_outs = [torch.empty(shape, dtype=dtype) for shape, dtype in outs]
    call(A, B, M, expected_outs)
    for input_placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        x = distribute_tensor(A, mesh, input_placements)
        y = distribute_tensor(B, mesh, input_placements)
        m = distribute_tensor(M, mesh, [Replicate()])
        # every out gets every placement its rank allows (the first out's choice for all of them)
        for out_placements in _placements_for(outs[0][0]):
            got = [
                distribute_tensor(torch.full(shape, 7.0).to(dtype), mesh, out_placements)
                for shape, dtype in outs
            ]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fallback warnings for the ops without a rule
                returned = call(x, y, m, got)
            returned = returned if isinstance(returned, tuple) else (returned,)
            for index, (out, want) in enumerate(zip(got, expected_outs, strict=True)):
                where = f"{name} in={input_placements} out={out_placements} #{index}"
                assert returned[index] is out, where
                assert isinstance(out, DTensor) and list(out.placements) == out_placements, where
                assert out.to_local().shape == out._layout.local_shape(), where
                torch.testing.assert_close(out.full_tensor(), want, msg=where)


@pytest.mark.distributed(world_size=2)
def test_out_placed_like_the_result_is_written_without_communication(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = distribute_tensor(A, mesh, [Shard(0)])
    y = distribute_tensor(B, mesh, [Shard(0)])
    out = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
    local = out.to_local()
    with record_collectives() as log:
        torch.mul(x, y, out=out)
    assert log.count() == 0, log
    assert out.to_local().data_ptr() == local.data_ptr()  # written in place
    torch.testing.assert_close(out.full_tensor(), A * B)
    torch.mul(x, y, out=x)  # out aliasing an input
    torch.testing.assert_close(x.full_tensor(), A * B)


@pytest.mark.distributed(world_size=2)
def test_out_that_is_a_view_writes_through(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    big = distribute_tensor(torch.zeros(6, 8), mesh, [Shard(0)])
    x = distribute_tensor(A, mesh, [Shard(0)])
    torch.exp(x, out=big[:, 2:6])
    want = torch.zeros(6, 8)
    want[:, 2:6] = A.exp()
    torch.testing.assert_close(big.full_tensor(), want)


@pytest.mark.distributed(world_size=2)
def test_factories_fill_each_rank_piece(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    for placements in ([Shard(0)], [Replicate()]):
        out = distribute_tensor(torch.zeros(6), mesh, placements)
        with record_collectives() as log:
            torch.arange(6, out=out)
        assert log.count() == 0, log
        torch.testing.assert_close(out.full_tensor(), torch.arange(6.0))
        full = distribute_tensor(torch.zeros(5, 3), mesh, placements)
        torch.full((5, 3), 2.5, out=full)
        torch.testing.assert_close(full.full_tensor(), torch.full((5, 3), 2.5))


@pytest.mark.distributed(world_size=2)
def test_bad_out_arguments_are_refused_before_any_write(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = distribute_tensor(A, mesh, [Shard(0)])
    wrong_shape = distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"shape \(6, 5\) but the result has shape \(6, 4\)"):
        torch.mul(x, x, out=wrong_shape)
    torch.testing.assert_close(wrong_shape.full_tensor(), torch.zeros(6, 5))
    narrow = distribute_tensor(torch.zeros(6, 4, dtype=torch.int64), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.mul(x, x, out=narrow)
    torch.testing.assert_close(narrow.full_tensor(), torch.zeros(6, 4, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match=r"cannot be resized to \(3, 4\)"):
        torch.randn(3, 4, out=distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]))


@pytest.mark.distributed(world_size=2)
def test_random_factories_draw_what_one_process_draws(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    for draw in (
        lambda out: torch.rand(6, 4, out=out),
        lambda out: torch.randn(6, 4, out=out),
        lambda out: torch.randint(0, 9, (6, 4), out=out),
    ):
        torch.manual_seed(5)
        want = draw(torch.empty(6, 4))
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            out = distribute_tensor(torch.zeros(6, 4), mesh, placements)
            torch.manual_seed(5)
            draw(out)
            assert list(out.placements) == placements
            torch.testing.assert_close(out.full_tensor(), want)

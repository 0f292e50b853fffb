"""Op rules against the same ops on full tensors: values and gradients (4 ranks)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def _check(fn, inputs, placements, mesh):  # type: ignore[no-untyped-def]
    """Run ``fn`` on full tensors and on DTensors; compare outputs and input gradients."""
    full = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref = fn(*full)
    ref.sum().backward() if ref.dim() else ref.backward()
    dts = [
        distribute_tensor(t.clone().requires_grad_(t.is_floating_point()), mesh, p)
        for t, p in zip(inputs, placements, strict=True)
    ]
    out = fn(*dts)
    assert isinstance(out, DTensor), f"{fn} returned {type(out)}"
    got = out.full_tensor()
    torch.testing.assert_close(got, ref)
    (got.sum() if got.dim() else got).backward()
    for d, f in zip(dts, full, strict=True):
        if f.grad is not None:
            assert d.grad is not None
            torch.testing.assert_close(d.grad.full_tensor(), f.grad)
    return out


@pytest.mark.distributed(world_size=4)
def test_op_rules_match_full_tensors(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(0)
    a = torch.randn(6, 8, dtype=torch.float64)
    b = torch.randn(8, 5, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64)
    S0, S1, R = [Shard(0)], [Shard(1)], [Replicate()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op below has a rule: no fallback warning
        # pointwise, broadcasting, uneven (6 rows over 4 ranks)
        _check(lambda x, y: (x * 2 + y).sin(), [a, a], [S0, S1], mesh)
        _check(lambda x, y: torch.relu(x) * y, [a, a[0]], [S1, R], mesh)
        # matmul family: S(1) @ S(0) gives a partial sum
        out = _check(lambda x, y: x @ y, [a, b], [S1, S0], mesh)
        assert out.placements == (Partial("sum"),)
        assert _check(lambda x, y: x @ y, [a, b], [S0, R], mesh).placements == (Shard(0),)
        assert _check(lambda x, y: x @ y, [a, b], [R, S1], mesh).placements == (Shard(1),)
        _check(lambda x, w, c: F.linear(x, w, c), [a, b.t().contiguous(), bias], [S1, S1, R], mesh)
        _check(lambda x, w, c: F.linear(x, w, c), [a, b.t().contiguous(), bias], [R, S0, S0], mesh)
        x3 = torch.randn(4, 3, 8, dtype=torch.float64)
        _check(lambda x, y: torch.bmm(x, y), [x3, torch.randn(4, 8, 2, dtype=torch.float64)], [S0, S0], mesh)
        # reductions
        assert _check(lambda x: x.sum(0), [a], [S0], mesh).placements == (Partial("sum"),)
        _check(lambda x: x.mean(1), [a], [S1], mesh)
        _check(lambda x: x.sum(), [a], [S1], mesh)
        # softmax family, norms
        _check(lambda x: torch.softmax(x, -1), [a], [S0], mesh)
        _check(lambda x: torch.log_softmax(x, -1), [a], [S1], mesh)
        w = torch.randn(8, dtype=torch.float64)
        _check(lambda x, g: F.layer_norm(x, (8,), g), [x3, w], [S0, R], mesh)
        _check(lambda x, g: F.rms_norm(x, (8,), g), [x3, w], [S1, R], mesh)
        # shape ops
        _check(lambda x: x.view(4, 24).t().reshape(2, 48), [x3], [S0], mesh)
        _check(lambda x: x.transpose(0, 1).permute(2, 0, 1).unsqueeze(0).flatten(2), [x3], [S1], mesh)
        _check(lambda x: torch.cat([x, x * 2], 1), [a], [S0], mesh)
        _check(lambda x: x.split(3, 0)[1] * 1.0, [a], [S1], mesh)
        # stack keeps the rows' cut (uneven: 6 rows over 4), moved past the new dim
        assert _check(lambda x, y: torch.stack([x, y], 0), [a, a * 3], [S0, S0], mesh).placements == (
            Shard(1),
        )
        assert _check(lambda x, y: torch.stack([x, y], -1), [a, a], [S1, R], mesh).placements == (Shard(1),)
        assert _check(lambda x, y: torch.stack([x, y], 1), [a, a], [S1, S0], mesh).placements == (Shard(2),)
        # embedding, column-wise
        table = torch.randn(10, 8, dtype=torch.float64)
        idx = torch.tensor([[1, 2, 9], [0, 0, 3]])
        emb = _check(lambda t: F.embedding(idx, t), [table], [S1], mesh)
        assert emb.placements == (Shard(2),)


@pytest.mark.distributed(world_size=4)
def test_fallback_warns_once_and_is_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    a = torch.randn(5, 6, dtype=torch.float64)
    square = torch.randn(6, 6, dtype=torch.float64) + 6 * torch.eye(6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="no sharding rule for aten.linalg_inv_ex"):
        _check(lambda x: torch.linalg.inv(x), [square], [[Shard(0), Shard(1)]], mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(lambda x: torch.cumsum(x, 1), [a], [[Shard(0), Replicate()]], mesh)


@pytest.mark.distributed(world_size=4)
def test_dropout_matches_one_process(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    x = torch.randn(8, 6)
    torch.manual_seed(3)
    ref = F.dropout(x, 0.5)
    torch.manual_seed(3)
    out = F.dropout(distribute_tensor(x, mesh, [Shard(0)]), 0.5)
    torch.testing.assert_close(out.full_tensor(), ref)


@pytest.mark.distributed(world_size=2)
def test_mixed_meshes_are_refused(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh_a = device_mesh_factory((2,), ("a",))
    mesh_b = device_mesh_factory((2,), ("b",))
    x = distribute_tensor(torch.ones(4), mesh_a, [Shard(0)])
    y = distribute_tensor(torch.ones(4), mesh_b, [Shard(0)])
    with pytest.raises(ValueError, match="different meshes"):
        _ = x + y


@pytest.mark.distributed(world_size=2)
def test_scalar_operand_of_a_partial_sum_is_counted_once(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    term = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)  # full value: 3 * [1, 2, 3]
    part = DTensor.from_local(term, mesh, [Partial()])
    full = torch.tensor([3.0, 6.0, 9.0])
    for result, expected in [
        (part + 1.0, full + 1.0),
        (part - 2.5, full - 2.5),
        (torch.add(part, 1.0, alpha=3), full + 3.0),
    ]:
        assert result.placements != (Partial(),), "a scalar added to each partial term"
        torch.testing.assert_close(result.full_tensor(), expected)
    in_place = DTensor.from_local(term.clone(), mesh, [Partial()])
    in_place.add_(1.0)
    torch.testing.assert_close(in_place.full_tensor(), full + 1.0)
    # linear uses of the partial terms stay partial (no communication needed)
    for result, expected in [(part * 2.0, full * 2.0), (part / 4.0, full / 4.0), (part + part, full * 2)]:
        assert result.placements == (Partial(),)
        torch.testing.assert_close(result.full_tensor(), expected)


@pytest.mark.distributed(world_size=2)
def test_one_object_in_two_argument_slots(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``x @ x``, ``cat([x, x])``, ``sdpa(q, q, q)``: each slot is moved on its own.

    Rules find positions by identity; a repeated object once lost a slot's
    target (a Partial multiplied unreduced, a row shard used as the other
    operand's columns), and the wrong decision, cached by layouts, then
    served two distinct tensors too ([Note: one object in two argument slots]).
    """
    from hp_dtensor.ops import dispatch as D

    D.clear_caches()
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(4, 4, dtype=torch.float64)
    pieces = (3 * x, -2 * x)  # a Partial(sum) whose pieces differ by rank

    def partial() -> DTensor:
        return DTensor.from_local(pieces[rank].clone(), mesh, [Partial()])

    p = partial()
    torch.testing.assert_close((p @ p).full_tensor(), x @ x)
    torch.testing.assert_close(torch.cat([p, p]).full_tensor(), torch.cat([x, x]))
    # the same layouts, two objects: served from the decision cache filled just above
    torch.testing.assert_close(torch.cat([partial(), partial()], 1).full_tensor(), torch.cat([x, x], 1))
    torch.testing.assert_close(torch.cat([partial(), partial()]).full_tensor(), torch.cat([x, x]))
    p.mul_(p)
    torch.testing.assert_close(p.full_tensor(), x * x)
    # values and gradients with a shard: the second operand must be gathered, not cut like the first
    _check(lambda t: t @ t, [x], [[Shard(0)]], mesh)
    _check(lambda t: torch.cat([t, t], 1), [x], [[Shard(0)]], mesh)
    q = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    _check(lambda t: F.scaled_dot_product_attention(t, t, t), [q], [[Shard(2)]], mesh)


@pytest.mark.distributed(world_size=2)
def test_in_place_ops_on_partial_terms_with_whole_operands(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``P.mul_(S)``, ``P.div_(S)``, ``P.copy_(R | S | P)``: every term meets the whole operand.

    An in-place op sets no output shard from its other operands, so a row
    shard stayed cut while the terms stayed partial: each rank scaled its term
    by its own rows only (broadcast when a piece had one row, a size error
    otherwise). ``copy_`` from a whole value kept the destination partial, so
    the value was counted once per rank.
    """
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    for rows in (2, 6):  # 2 rows over 2 ranks: one-row pieces, which broadcast silently
        a, b = torch.randn(rows, 5, dtype=torch.float64), torch.randn(rows, 5, dtype=torch.float64) + 3

        def terms(a: torch.Tensor = a) -> DTensor:
            return DTensor.from_local((3 * a if rank == 0 else -2 * a).clone(), mesh, [Partial()])

        for op in ("mul_", "div_"):
            x = terms()
            getattr(x, op)(distribute_tensor(b, mesh, [Shard(0)]))
            torch.testing.assert_close(x.full_tensor(), getattr(a.clone(), op)(b))
        for source in ([Replicate()], [Shard(0)], [Partial()]):
            x = terms()
            x.copy_(distribute_tensor(b, mesh, source))
            torch.testing.assert_close(x.full_tensor(), b)

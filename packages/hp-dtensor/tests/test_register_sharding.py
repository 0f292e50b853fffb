"""``hp_dtensor.register_sharding`` (torch's decorator) and ``register_rule`` (hp's native form).

Custom ops from ``torch.library.custom_op`` are registered both ways and
checked against the same op on plain tensors (values and gradients); the
sharding picked among those listed is the one that moves the fewest bytes,
checked by counting collectives.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hp_dtensor import (
    Decision,
    DTensor,
    OpCall,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    register_rule,
    register_sharding,
)
from hp_dtensor.registration import DTensorSpec
from hp_testing import record_collectives


@torch.library.custom_op("hp_test_registration::rowscale", mutates_args=())
def rowscale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` times the sum of the same row of ``w``."""
    return x * w.sum(dim=1, keepdim=True)


@rowscale.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _rowscale_backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, w = ctx.saved_tensors
    return grad * w.sum(dim=1, keepdim=True), (grad * x).sum(dim=1, keepdim=True).expand_as(w)


def _rowscale_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


rowscale.register_autograd(_rowscale_backward, setup_context=_rowscale_setup)

SEEN: list[DTensorSpec] = []


@register_sharding(rowscale)
def rowscale_sharding(x, w):  # type: ignore[no-untyped-def]
    SEEN.append(x)
    return [
        ([Shard(0)], [Shard(0), Shard(0)]),  # rows cut alike
        ([Shard(1)], [Shard(1), Replicate()]),  # x's columns cut, w whole
        ([Replicate()], [Replicate(), Replicate()]),
    ]


@torch.library.custom_op("hp_test_registration::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@register_rule(torch.ops.hp_test_registration.double.default)
def double_rule(call: OpCall) -> Decision:
    """Elementwise: the output keeps the input's placements (a Partial input would be wrong: gather it)."""
    layout = call.layout(call.positions[0])
    placements = tuple(Replicate() if p.is_partial() else p for p in layout.placements)
    return Decision(inputs={call.positions[0]: placements}, outputs=[placements])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(
        8, 16, generator=gen, dtype=torch.float64
    )


def _check(x_placements, w_placements, mesh, expected_out, expected_counts):  # type: ignore[no-untyped-def]
    X, W = _data()
    ref_x, ref_w = X.clone().requires_grad_(), W.clone().requires_grad_()
    (rowscale(ref_x, ref_w) ** 2).sum().backward()
    x = distribute_tensor(X, mesh, x_placements).requires_grad_()
    w = distribute_tensor(W, mesh, w_placements).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no replicated fallback
        with record_collectives() as log:
            y = rowscale(x, w)
        assert isinstance(y, DTensor) and y.placements == expected_out, (
            x_placements,
            w_placements,
            y.placements,
        )
        assert dict(log.counts()) == expected_counts, (x_placements, w_placements, log.counts())
        out = y.full_tensor()
        torch.testing.assert_close(out, rowscale(X, W))
        (out**2).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
    torch.testing.assert_close(w.grad.full_tensor(), ref_w.grad)


@pytest.mark.distributed(world_size=2)
def test_custom_op_picks_the_cheapest_sharding(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    S0, S1, R = Shard(0), Shard(1), Replicate()
    _check([S0], [S0], mesh, (S0,), {})  # already placed: nothing moves
    _check([S1], [R], mesh, (S1,), {})
    _check([S0], [R], mesh, (S0,), {})  # w's rows are cut locally (0 bytes)
    # x S(1), w S(0): moving x to S(0) (an all-to-all of half of x's 64 B shard) beats gathering w
    # (256 B) for S(1) and gathering both for Replicate.
    _check([S1], [S0], mesh, (S0,), {"all_to_all_single": 1})
    spec = SEEN[-1]
    assert isinstance(spec, DTensorSpec)
    assert (spec.ndim, spec.shape, spec.dtype, spec.placements) == (2, (8, 4), torch.float64, (S1,))
    assert spec.tensor_meta.stride == (4, 1) and spec.device_mesh is mesh


@pytest.mark.distributed(world_size=4)
def test_shardings_combine_over_mesh_dims(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2, 2))
    S0, S1, R = Shard(0), Shard(1), Replicate()
    _check([S0, S1], [S0, R], mesh, (S0, S1), {})  # rows on mesh dim 0, x's columns on mesh dim 1
    _check([R, S0], [R, S0], mesh, (R, S0), {})


@pytest.mark.distributed(world_size=2)
def test_native_rule_on_a_custom_op(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X, _ = _data()
    x = distribute_tensor(X, mesh, [Shard(1)]).requires_grad_()
    with record_collectives() as log:
        y = double(x)
    assert log.count() == 0 and y.placements == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), X * 2)
    partial = DTensor.from_local(X * (rank + 1), mesh, [Partial()])
    torch.testing.assert_close(double(partial).full_tensor(), X * 6)


@pytest.mark.distributed(world_size=2)
def test_bad_rules_and_ops(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X, W = _data()
    x, w = distribute_tensor(X, mesh, [Shard(0)]), distribute_tensor(W, mesh, [Shard(0)])
    with pytest.raises(TypeError, match=r"123 \(int\) is not an op"):
        register_sharding(123)
    with pytest.raises(TypeError, match="name at least one op"):
        register_rule()
    bad = {
        "pairs": (lambda x, w: [([Shard(0)],)], r"each must be a pair"),
        "outputs": (lambda x, w: [([Shard(0), None], [Shard(0), Shard(0)])], r"2 output placement\(s\)"),
        "inputs": (lambda x, w: [([Shard(0)], [Shard(0)])], r"1 input placement\(s\) .* 2 DTensor argument"),
        "range": (lambda x, w: [([Shard(2)], [Shard(0), Shard(0)])], r"Shard\(2\) is out of range"),
        "input range": (lambda x, w: [([Shard(0)], [Shard(0), Shard(5)])], r"Shard\(5\) is out of range"),
        "empty": (lambda x, w: [], r"non-empty list"),
        "not placements": (lambda x, w: [(["S0"], [Shard(0), Shard(0)])], r"'S0' is not a placement"),
    }
    from hp_dtensor.ops import dispatch

    saved = dispatch.RULES[torch.ops.hp_test_registration.rowscale.default]
    try:
        for fn, message in bad.values():
            register_sharding(torch.ops.hp_test_registration.rowscale.default)(fn)
            with pytest.raises(ValueError, match=message):
                rowscale(x, w)
        # A sharding that can never fit (rows cut over more ranks than there are rows) is refused.
        register_sharding(rowscale)(lambda x, w: [([Shard(0)], [Shard(0), Shard(0)])])
        tiny = distribute_tensor(torch.ones(1, 3), mesh, [Replicate()])
        with pytest.raises(ValueError, match=r"none of the 1 sharding\(s\) .* fits inputs"):
            rowscale(tiny, tiny)
    finally:
        register_rule(torch.ops.hp_test_registration.rowscale.default)(saved)
    _check([Shard(0)], [Shard(0)], mesh, (Shard(0),), {})  # the real rule is back

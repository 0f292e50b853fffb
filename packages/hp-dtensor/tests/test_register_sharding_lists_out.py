"""``register_sharding`` for ops returning tensor lists and for ``out=`` variants.

A ``Tensor[]`` output takes one placement for all its elements or one per
element (``[[Shard(0), Partial()]]``), as a tensor-list argument does; torch's
``register_sharding`` fails there (it wraps a list with one spec). An ``out=``
variant writes into the caller's out DTensors, placed as the strategy says
(torch leaves it a TODO); [Note: out= variants] in ``hp_dtensor/out_variants.py``.
Checked against the same ops on plain tensors, values and gradients, with the
collectives counted.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, register_rule, register_sharding
from hp_dtensor.ops.calls import Decision
from hp_dtensor.registration import DTensorSpec
from hp_testing import record_collectives


@torch.library.custom_op("hp_test_reg_lists::rowcol", mutates_args=())
def rowcol(x: torch.Tensor) -> list[torch.Tensor]:
    """The row sums and the column sums of ``x``."""
    return [x.sum(1), x.sum(0)]


@rowcol.register_fake
def _(x: torch.Tensor) -> list[torch.Tensor]:
    return [x.new_empty(x.shape[0]), x.new_empty(x.shape[1])]


def _rowcol_backward(ctx, grads):  # type: ignore[no-untyped-def]
    rows, cols = grads
    return rows.unsqueeze(1) + cols.unsqueeze(0)


rowcol.register_autograd(_rowcol_backward, setup_context=lambda ctx, inputs, output: None)


@register_sharding(rowcol)
def rowcol_sharding(x):  # type: ignore[no-untyped-def]
    return [
        ([[Shard(0), Partial()]], [Shard(0)]),  # one placement per element of the Tensor[] output
        ([[Partial(), Shard(0)]], [Shard(1)]),
        ([Replicate()], [Replicate()]),  # one placement for every element
    ]


@torch.library.custom_op("hp_test_reg_lists::halves", mutates_args=())
def halves(x: torch.Tensor) -> list[torch.Tensor]:
    """``x``'s columns in two halves (copies), like ``split``."""
    return [part.clone() for part in x.split(x.shape[1] // 2, dim=1)]


@halves.register_fake
def _(x: torch.Tensor) -> list[torch.Tensor]:
    return [part.clone() for part in x.split(x.shape[1] // 2, dim=1)]


halves.register_autograd(
    lambda ctx, grads: torch.cat(list(grads), dim=1), setup_context=lambda ctx, inputs, output: None
)


@register_sharding(halves)
def halves_sharding(x):  # type: ignore[no-untyped-def]
    return [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()])]


_lib = torch.library.Library("hp_test_reg_out", "DEF")
_lib.define("scale.out(Tensor x, float s, *, Tensor(a!) out) -> Tensor(a!)")
_lib.define("minmax.out(Tensor x, *, Tensor(a!) lo, Tensor(b!) hi) -> (Tensor(a!), Tensor(b!))")
_lib.define("pair.out(Tensor x, *, Tensor(a!)[] out) -> ()")


def _scale_out(x: torch.Tensor, s: float, *, out: torch.Tensor) -> torch.Tensor:
    return torch.mul(x, s, out=out)


def _minmax_out(x: torch.Tensor, *, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch.amin(x, 1, out=lo)
    torch.amax(x, 1, out=hi)
    return lo, hi


def _pair_out(x: torch.Tensor, *, out: list[torch.Tensor]) -> None:
    for target in out:
        target.copy_(x)


for _name, _fn in (("scale.out", _scale_out), ("minmax.out", _minmax_out), ("pair.out", _pair_out)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")
scale_out = torch.ops.hp_test_reg_out.scale.out
minmax_out = torch.ops.hp_test_reg_out.minmax.out


OUT_SEEN: list[DTensorSpec] = []


@register_sharding(scale_out)
def scale_sharding(x, s, *, out):  # type: ignore[no-untyped-def]
    OUT_SEEN.append(out)  # the out tensor is seen, as a spec, like any argument
    return [([Shard(0)], [Shard(0), None]), ([Shard(1)], [Shard(1), None, Shard(1)])]  # out given or left out


@register_sharding(minmax_out)
def minmax_sharding(x, *, lo, hi):  # type: ignore[no-untyped-def]
    return [([Shard(0), Shard(0)], [Shard(0)]), ([Replicate(), Replicate()], [Replicate()])]


def _data() -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.distributed(world_size=2)
def test_tensor_list_outputs(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X = _data()
    ref = X.clone().requires_grad_()
    rows, cols = rowcol(ref)
    (rows.sin().sum() + (cols**2).sum()).backward()
    for placements, expected in (
        ([Shard(0)], ((Shard(0),), (Partial(),))),
        ([Shard(1)], ((Partial(),), (Shard(0),))),
    ):
        x = distribute_tensor(X, mesh, placements).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no replicated fallback
            with record_collectives() as log:
                out = rowcol(x)
            assert log.count() == 0, log.counts()  # each element placed by the strategy, nothing moved
            assert isinstance(out, list) and tuple(o.placements for o in out) == expected
            full_rows, full_cols = (o.full_tensor() for o in out)
            torch.testing.assert_close(full_rows, X.sum(1))
            torch.testing.assert_close(full_cols, X.sum(0))
            (full_rows.sin().sum() + (full_cols**2).sum()).backward()
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad)

    ref = X.clone().requires_grad_()
    ((halves(ref)[0] * 2).sum() + (halves(ref)[1] ** 3).sum()).backward()
    x = distribute_tensor(X, mesh, [Shard(0)]).requires_grad_()
    with record_collectives() as log:
        left, right = halves(x)
    assert log.count() == 0 and left.placements == right.placements == (Shard(0),)
    torch.testing.assert_close(left.full_tensor(), X[:, :3])
    torch.testing.assert_close(right.full_tensor(), X[:, 3:])
    ((left * 2).sum() + (halves(x)[1] ** 3).sum()).full_tensor().backward()
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad)


@pytest.mark.distributed(world_size=2)
def test_out_variants_write_into_the_callers_dtensors(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X = _data()
    for x_placements, out_placements in (
        ([Shard(0)], [Shard(0)]),  # already placed: written in its own local tensor
        ([Shard(0)], [Replicate()]),  # placed otherwise: re-laid as the output, nothing moved
        ([Shard(1)], [Shard(0)]),
    ):
        x = distribute_tensor(X, mesh, x_placements)
        out = distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, out_placements)
        before = out.to_local().data_ptr()
        with record_collectives() as log:
            returned = scale_out(x, 3.0, out=out)
        assert log.count() == 0, log.counts()
        assert returned is out and out.placements == tuple(x_placements)
        assert (out.to_local().data_ptr() == before) == (x_placements == out_placements)
        torch.testing.assert_close(out.full_tensor(), X * 3)
        assert OUT_SEEN[-1].shape == (8, 6) and OUT_SEEN[-1].placements == tuple(out_placements)
    # The out tensor is also the input (an in-place write through out=), as on plain tensors.
    y = distribute_tensor(X, mesh, [Shard(1)])
    assert scale_out(y, 2.0, out=y) is y and y.placements == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), X * 2)
    # torch.mul-style call through the Python binding, two out tensors, an input cut moved once
    x = distribute_tensor(X, mesh, [Shard(1)])
    lo = distribute_tensor(torch.zeros(8, dtype=torch.float64), mesh, [Replicate()])
    hi = distribute_tensor(torch.zeros(8, dtype=torch.float64), mesh, [Shard(0)])
    with record_collectives() as log:
        got = minmax_out(x, lo=lo, hi=hi)
    assert log.counts() == {"all_to_all_single": 1}, log.counts()  # S(1) -> S(0), the cheaper choice
    assert got[0] is lo and got[1] is hi and lo.placements == hi.placements == (Shard(0),)
    torch.testing.assert_close(lo.full_tensor(), X.amin(1))
    torch.testing.assert_close(hi.full_tensor(), X.amax(1))


@pytest.mark.distributed(world_size=2)
def test_bad_out_and_list_shardings(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    X = _data()
    x = distribute_tensor(X, mesh, [Shard(0)])
    wrong_shape = distribute_tensor(torch.zeros(4, 6, dtype=torch.float64), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"shape \(4, 6\) .* result has shape \(8, 6\)"):
        scale_out(x, 2.0, out=wrong_shape)
    with pytest.raises(TypeError, match=r"out= is a Tensor, not a DTensor"):
        scale_out(x, 2.0, out=torch.zeros(8, 6, dtype=torch.float64))
    register_sharding(torch.ops.hp_test_reg_out.pair.out)(lambda x, *, out: [([], [Shard(0), Shard(0)])])
    pair = [distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, [Shard(0)]) for _ in range(2)]
    with pytest.raises(NotImplementedError, match=r"out= is a list of tensors.*call the functional overload"):
        torch.ops.hp_test_reg_out.pair.out(x, out=pair)
    saved = register_sharding  # the rules below replace the module's, which are put back at the end
    try:
        saved(rowcol)(lambda x: [([[Shard(0), Shard(0), Shard(0)]], [Shard(0)])])
        with pytest.raises(ValueError, match=r"tensor-list output of 2 tensors got placements"):
            rowcol(x)
        saved(scale_out)(lambda x, s, *, out: [([Shard(0)], [Shard(0), None, Replicate()])])
        with pytest.raises(
            ValueError, match=r"out argument\(s\) as \[Replicate\(\)\] but the output\(s\) as \[Shard"
        ):
            scale_out(x, 2.0, out=distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, [Shard(0)]))
        register_rule(scale_out)(lambda call: None)
        with pytest.raises(NotImplementedError, match="no replicated fallback"):
            scale_out(x, 2.0, out=distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, [Shard(0)]))
    finally:
        saved(rowcol)(rowcol_sharding)
        saved(scale_out)(scale_sharding)
    assert isinstance(Decision(), Decision)
    assert rowcol(x)[0].placements == (Shard(0),)
    assert isinstance(x, DTensor)

"""The replicated fallback and the checks around rules: never wrong, the same on every rank, loud.

Each case was reproduced on 2 ranks before its fix: a conjugated replicated
DTensor multiplied as if unconjugated (complex rotary embeddings' backward),
``frexp`` handing back the exponent as this rank's plain piece, ``squeeze()``
dropping a dim that is 1 on one rank's piece only (one rank raised an
internal error while the other waited in a collective), ``t()`` of a 0-dim
tensor raising ``IndexError``, and an op that writes into an argument other
than its first leaving that argument unchanged.
"""

from __future__ import annotations

import warnings

import hp_core
import pytest
import torch
from hp_dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_policy,
    fallback_stats,
    reset_fallback_stats,
)
from hp_testing import record_collectives


@torch.library.custom_op("hp_fallback_test::scale_into", mutates_args=("out",))
def _scale_into(x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
    out.copy_(x * factor)


@_scale_into.register_fake
def _(x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
    return None


@torch.library.custom_op("hp_fallback_test::row_sums", mutates_args=())
def _row_sums(x: torch.Tensor) -> torch.Tensor:
    return x.sum(1)


@_row_sums.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0])


PLACEMENTS = [[Replicate()], [Shard(0)], [Shard(1)]]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("placements", PLACEMENTS, ids=str)
def test_lazy_conjugate_and_negative_bits_are_kept(rank, device_mesh_factory, placements) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.complex128)
    g = torch.randn(5, 3, dtype=torch.complex128)
    cases = {
        "g * conj(x)": lambda a, b: b * torch.conj(a),
        "conj(x).imag (a negative view)": lambda a, b: torch.conj(a).imag * b.real,
        "conj(conj(x))": lambda a, b: torch.conj(torch.conj(a)) * b,
        "conj(x) viewed": lambda a, b: torch.conj(a).reshape(15).reshape(5, 3) + b,
        "conj(x) @ g.T": lambda a, b: torch.conj(a) @ b.t(),
        "rotary": lambda a, b: torch.view_as_real(a * torch.conj(b)).flatten(-2),
    }
    for name, fn in cases.items():
        xf = x.clone().requires_grad_()
        ref = fn(xf, g)
        ref.abs().sum().backward()
        xd = distribute_tensor(x, mesh, placements).requires_grad_()
        out = fn(xd, distribute_tensor(g, mesh, placements))
        torch.testing.assert_close(out.full_tensor(), ref, msg=name)
        out.abs().sum().backward()
        # the gradient goes through conj's backward and is gathered with its bits applied
        torch.testing.assert_close(xd.grad.full_tensor(), xf.grad, msg=name)


@pytest.mark.distributed(world_size=2)
def test_every_tensor_output_is_a_dtensor(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    v = torch.linspace(-40, 40, 21, dtype=torch.float64)
    mantissa, exponent = torch.frexp(distribute_tensor(v, mesh, [Shard(0)]))
    ref_m, ref_e = torch.frexp(v)
    assert isinstance(exponent, DTensor) and exponent.placements == (Shard(0),)
    torch.testing.assert_close(mantissa.full_tensor(), ref_m)
    torch.testing.assert_close(exponent.full_tensor(), ref_e)


@pytest.mark.distributed(world_size=2)
def test_squeeze_drops_only_globally_unit_dims(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.randn(3, 1, 4, dtype=torch.float64)  # 3 rows over 2 ranks: rank 1 holds one row
    xd = distribute_tensor(x, mesh, [Shard(0)])
    torch.testing.assert_close(xd.squeeze().full_tensor(), x.squeeze())
    torch.testing.assert_close(xd.squeeze(0).full_tensor(), x.squeeze(0))
    torch.testing.assert_close(xd.squeeze((0, 1)).full_tensor(), x.squeeze((0, 1)))
    m = torch.randn(3, 2, dtype=torch.float64)
    corr = torch.corrcoef(distribute_tensor(m, mesh, [Shard(0)]))
    torch.testing.assert_close(corr.full_tensor(), torch.corrcoef(m))
    a, b = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(4, 5, 2, dtype=torch.float64)
    ad, bd = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()])
    got = torch.tensordot(ad, bd, dims=2)
    torch.testing.assert_close(got.full_tensor(), torch.tensordot(a, b, dims=2))


@pytest.mark.distributed(world_size=2)
def test_zero_dim_shape_ops(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    s = distribute_tensor(torch.tensor(2.5, dtype=torch.float64), mesh, [Replicate()])
    assert s.t().full_tensor().item() == 2.5
    assert s.transpose(0, -1).full_tensor().item() == 2.5
    assert torch.quantile(s, 0.5).full_tensor().item() == 2.5


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("placements", [[Shard(0)], [Replicate()], [Partial()]], ids=str)
def test_fallback_writes_back_into_every_mutated_argument(rank, device_mesh_factory, placements) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.randn(5, 3, dtype=torch.float64)
    xd = distribute_tensor(x, mesh, [Shard(1)])
    out = distribute_tensor(torch.zeros(5, 3, dtype=torch.float64), mesh, [Replicate()]).redistribute(
        placements=placements
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.hp_fallback_test.scale_into(xd, out, 3.0)
    # The op wrote into its second argument: its new value, in its own cut (a partial one is whole now).
    assert isinstance(out, DTensor)
    torch.testing.assert_close(out.full_tensor(), x * 3.0)


@pytest.mark.distributed(world_size=2)
def test_fallback_announces_op_and_bytes_and_can_be_an_error(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    x = torch.randn(6, 4, dtype=torch.float32)
    xd = distribute_tensor(x, mesh, [Shard(0)])
    reset_fallback_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.ops.hp_fallback_test.row_sums(xd)
        torch.ops.hp_fallback_test.row_sums(xd)
    torch.testing.assert_close(y.full_tensor(), x.sum(1))
    messages = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert len(messages) == 1, messages  # once per op
    # 6x4 float32 over 2 ranks: this rank received the other half, 3 rows x 4 x 4 bytes
    assert "hp_fallback_test.row_sums" in messages[0] and "48 bytes" in messages[0]
    assert "register_sharding" in messages[0] and "set_fallback_policy('error')" in messages[0]
    stat = fallback_stats()["hp_fallback_test.row_sums.default"]
    assert (stat.calls, stat.bytes_gathered) == (2, 96)
    with fallback_policy("error"), record_collectives() as log:
        with pytest.raises(NotImplementedError, match=r"no sharding rule for hp_fallback_test\.row_sums"):
            torch.ops.hp_fallback_test.row_sums(xd)
    assert len(log) == 0  # raised before any communication, on every rank
    assert hp_core.all_gather_object("raised") == ["raised", "raised"]


@pytest.mark.distributed(world_size=2)
def test_a_rule_wrong_on_one_rank_falls_back_on_every_rank(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A decision whose local op fails on some rank's piece only is dropped on every rank."""
    from hp_dtensor.ops import Decision, register

    @torch.library.custom_op("hp_fallback_test::first_rows", mutates_args=())
    def first_rows(x: torch.Tensor) -> torch.Tensor:
        return x[:2].clone()

    @first_rows.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 2:  # on the 1-row piece the local op raises
            raise ValueError("needs two rows")
        return x.new_empty(2, *x.shape[1:])

    @register(torch.ops.hp_fallback_test.first_rows.default)
    def wrong(call):  # type: ignore[no-untyped-def]
        # Wrong: keeps Shard(0), which holds for rank 0's 2 rows but not rank 1's 1 row.
        return Decision(outputs=[(Shard(0),)])

    mesh = device_mesh_factory((2,))
    x = torch.randn(3, 2, dtype=torch.float64)
    xd = distribute_tensor(x, mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.ops.hp_fallback_test.first_rows(xd)
    torch.testing.assert_close(got.full_tensor(), x[:2])
    assert any("does not hold on every rank" in str(w.message) for w in caught)
    with fallback_policy("error"), pytest.raises(NotImplementedError, match="does not hold on every rank"):
        torch.ops.hp_fallback_test.first_rows(xd)
    assert hp_core.all_gather_object("raised") == ["raised", "raised"]

"""DTensor random fills draw alike on every rank of the mesh, even when the ranks were seeded apart.

Before the check, ``torch.manual_seed(rank)`` left a ``Replicate()`` DTensor
filled by ``normal_()`` (or a replicated activation through dropout) holding
different values on each rank, and a ``Shard(0)`` fill a mix of unrelated
draws. Now the first fill over a mesh compares a digest of the generator
state over that mesh only, and on disagreement every rank takes mesh
coordinate 0's state: [Note: RNG agreement] in ``hp_dtensor.ops.random_agreement``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hp_dtensor import DTensor, Replicate, Shard, distribute_tensor
from hp_dtensor.ops import random_agreement
from hp_dtensor.ops.random_agreement import (
    ensure_rng_agreement,
    reset_rng_agreement,
    rng_agreement_policy,
    set_rng_agreement_policy,
)
from hp_testing import count_host_syncs, record_collectives

SEED = 1000  # rank r seeds SEED + r where the ranks disagree


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (a test-side exchange, outside any recorded block)."""
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _all_locals(x: DTensor) -> list[torch.Tensor]:
    """Every rank's local tensor."""
    return _gathered(x.to_local())


def _plain(seed: int, shape: tuple[int, ...], fill: str) -> torch.Tensor:
    """What a single process seeded ``seed`` draws for ``torch.empty(shape).<fill>()``."""
    g = torch.Generator().manual_seed(seed)
    return getattr(torch.empty(shape), fill)(generator=g)


def _rng_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "random generator states" in str(w.message)]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("fill", ["normal_", "uniform_"])
def test_replicated_fill_agrees_when_seeded_apart(rank, device_mesh_factory, fill) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    x = distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()])
    torch.manual_seed(SEED + rank)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        getattr(x, fill)()
    assert log.count("all_reduce") == 1 and log.nbytes("all_reduce") == 16
    assert log.count("broadcast") == 1, log
    assert len(_rng_warnings(caught)) == 1
    assert "torch.manual_seed(seed)" in _rng_warnings(caught)[0]
    expected = _plain(SEED, (4, 3), fill)
    for local in _all_locals(x):
        torch.testing.assert_close(local, expected, rtol=0, atol=0)
    # The next fill is free and still alike.
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        getattr(x, fill)()
    assert len(log) == 0 and not _rng_warnings(caught)
    first, second = _all_locals(x)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    reset_rng_agreement()  # a reseed is checked again only when asked (and may warn again)
    torch.manual_seed(2 * SEED + rank)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        getattr(x, fill)()
    assert log.count("all_reduce") == 1 and log.count("broadcast") == 1 and len(_rng_warnings(caught)) == 1
    for local in _all_locals(x):
        torch.testing.assert_close(local, _plain(2 * SEED, (4, 3), fill), rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_shard_fill_is_rank0_seeds_plain_draw(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    x = distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0)])
    torch.manual_seed(SEED + rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x.normal_(2.0, 0.5)
    expected = torch.empty(6, 5).normal_(2.0, 0.5, generator=torch.Generator().manual_seed(SEED))
    torch.testing.assert_close(x.full_tensor(), expected, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_dropout_on_replicated_activation_agrees(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    base = torch.arange(1.0, 25.0).reshape(4, 6)
    x = distribute_tensor(base.clone(), mesh, [Replicate()]).requires_grad_()
    torch.manual_seed(SEED + rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = F.dropout(x, p=0.5, training=True)
    out.sum().backward()
    torch.manual_seed(SEED)
    plain = base.clone().requires_grad_()
    ref = F.dropout(plain, p=0.5, training=True)
    ref.sum().backward()
    for local in _all_locals(out):
        torch.testing.assert_close(local, ref.detach(), rtol=0, atol=0)
    assert x.grad is not None and plain.grad is not None
    for local in _all_locals(x.grad):
        torch.testing.assert_close(local, plain.grad, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_seeded_alike_checks_once_and_then_costs_nothing(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    x = distribute_tensor(torch.zeros(8), mesh, [Replicate()])
    torch.manual_seed(7)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        x.normal_()
    # One digest comparison; the states agree, so no state moves and nothing is said.
    assert log.count("all_reduce") == 1 and log.count("broadcast") == 0 and len(log) == 1
    assert not _rng_warnings(caught)
    torch.testing.assert_close(x.to_local(), _plain(7, (8,), "normal_"), rtol=0, atol=0)
    with record_collectives() as log, count_host_syncs() as syncs:
        for _ in range(3):
            x.uniform_()
            x.bernoulli_(0.5)
    assert len(log) == 0 and syncs.count == 0, syncs.report()
    # A reseed is not re-checked (a per-rank reseed could leave one rank out of the check while its
    # peers wait); reset_rng_agreement() on every rank asks for one new check.
    torch.manual_seed(8)
    with record_collectives() as log:
        x.normal_()
    assert len(log) == 0
    reset_rng_agreement()
    with record_collectives() as log:
        x.normal_()
        x.normal_()
    assert log.count("all_reduce") == 1 and len(log) == 1
    # An explicit generator is the user's choice: never checked.
    reset_rng_agreement()
    with record_collectives() as log:
        x.normal_(generator=torch.Generator().manual_seed(rank))
    assert len(log) == 0


@pytest.mark.distributed(world_size=2)
def test_error_policy_raises_on_every_rank(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    x = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
    torch.manual_seed(SEED + rank)
    with rng_agreement_policy("error"), pytest.raises(RuntimeError, match=r"torch\.manual_seed\(seed\)"):
        x.normal_()
    with pytest.raises(ValueError, match="'strict' is not one of"):
        set_rng_agreement_policy("strict")


@pytest.mark.distributed(world_size=4)
def test_rows_seeded_apart_exchange_within_their_own_row(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A (pp, tp) mesh whose rows seed differently on purpose: a row's DTensor syncs nothing across rows."""
    mesh = device_mesh_factory((2, 2), mesh_dim_names=("pp", "tp"))
    row_mesh = mesh["tp"]
    row = rank // 2
    row_ranks = [2 * row, 2 * row + 1]
    reset_rng_agreement()
    x = distribute_tensor(torch.zeros(4, 4), row_mesh, [Replicate()])
    torch.manual_seed(SEED + row)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        x.normal_()
    assert log.count("all_reduce", group_ranks=row_ranks) == 1 and len(log) == 1
    assert not _rng_warnings(caught)
    locals_ = _all_locals(x)
    for r, local in enumerate(locals_):
        torch.testing.assert_close(local, _plain(SEED + r // 2, (4, 4), "normal_"), rtol=0, atol=0)
    assert not torch.equal(locals_[0], locals_[2])
    # A DTensor over the whole mesh does need one state, coordinate (0, 0)'s: the mesh spans the
    # world, so one exchange over the world's group.
    y = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0), Replicate()])
    reset_rng_agreement()  # a reseed is checked again only when asked
    torch.manual_seed(2 * SEED + rank)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        y.normal_()
    assert log.count("all_reduce", group_ranks=range(4)) == 1 and len(log) == 2
    assert log.count("broadcast", group_ranks=range(4)) == 1
    assert len(_rng_warnings(caught)) == 1
    torch.testing.assert_close(y.full_tensor(), _plain(2 * SEED, (4, 4), "normal_"), rtol=0, atol=0)
    # A 2-D mesh that is part of a larger world (a pipeline stage's dp x tp mesh) has no single
    # group: one exchange along each dim in turn. Pretend the world is larger to take that path.
    real_world_size = random_agreement.hp_core.get_world_size
    random_agreement.hp_core.get_world_size = lambda: 8  # type: ignore[attr-defined]
    try:
        reset_rng_agreement()  # a reseed is checked again only when asked
        torch.manual_seed(3 * SEED + rank)
        with warnings.catch_warnings(), record_collectives() as log:
            warnings.simplefilter("ignore")
            y.normal_()
    finally:
        random_agreement.hp_core.get_world_size = real_world_size  # type: ignore[attr-defined]
    column, row_group = [rank % 2, rank % 2 + 2], row_ranks
    for name in ("all_reduce", "broadcast"):
        assert log.count(name, group_ranks=column) == 1 and log.count(name, group_ranks=row_group) == 1
    assert len(log) == 4
    torch.testing.assert_close(y.full_tensor(), _plain(3 * SEED, (4, 4), "normal_"), rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("factory", ["rand", "randn"])
def test_random_factory_into_dtensor_out_agrees(rank, device_mesh_factory, factory) -> None:  # type: ignore[no-untyped-def]
    """``torch.rand(..., out=dtensor)`` draws the whole tensor as the in-place fills do: alike too."""
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    out = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)])
    torch.manual_seed(SEED + rank)
    with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
        warnings.simplefilter("always")
        getattr(torch, factory)(4, 6, out=out)
    assert log.count("all_reduce") == 1 and log.count("broadcast") == 1
    assert len(_rng_warnings(caught)) == 1
    expected = getattr(torch, factory)(4, 6, generator=torch.Generator().manual_seed(SEED))
    torch.testing.assert_close(out.full_tensor(), expected, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_out_of_place_random_ops_agree(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``rand_like`` and ``native_dropout`` (F.dropout's kernel on CUDA) take the replicated fallback,
    which draws the whole result on every rank: with one state it is a single process's draw."""
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    x = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    torch.manual_seed(SEED + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drawn = torch.rand_like(x)
    assert len(_rng_warnings(caught)) == 1
    expected = torch.rand(6, 4, generator=torch.Generator().manual_seed(SEED))
    torch.testing.assert_close(drawn.full_tensor(), expected, rtol=0, atol=0)

    base = torch.arange(1.0, 13.0).reshape(3, 4)
    r = distribute_tensor(base.clone(), mesh, [Replicate()]).requires_grad_()
    reset_rng_agreement()  # a reseed is checked again only when asked
    torch.manual_seed(3 * SEED + rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = torch.ops.aten.native_dropout(r, 0.5, True)
    out.sum().backward()
    torch.manual_seed(3 * SEED)
    plain = base.clone().requires_grad_()
    ref, _ = torch.ops.aten.native_dropout(plain, 0.5, True)
    ref.sum().backward()
    assert r.grad is not None and plain.grad is not None
    for got, want in ((out, ref.detach()), (r.grad, plain.grad)):
        for local in _all_locals(got):
            torch.testing.assert_close(local, want, rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_direct_call_before_compiled_steps(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``ensure_rng_agreement(mesh, device)`` called eagerly (compiled graphs are not checked) gives
    every rank coordinate 0's whole generator state, so later plain draws match too."""
    mesh = device_mesh_factory((2,))
    reset_rng_agreement()
    torch.manual_seed(SEED + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ensure_rng_agreement(mesh, torch.device("cpu"))
    assert len(_rng_warnings(caught)) == 1
    assert torch.initial_seed() == SEED
    first, second = _gathered(torch.get_rng_state())
    assert torch.equal(first, second)


def test_env_policy_is_checked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``HP_DTENSOR_RNG_AGREEMENT`` picks the policy at import; a typo names the choices."""
    monkeypatch.setenv("HP_DTENSOR_RNG_AGREEMENT", "Error")
    assert random_agreement._initial_policy() == "error"
    monkeypatch.setenv("HP_DTENSOR_RNG_AGREEMENT", "strict")
    with pytest.raises(ValueError, match=r"HP_DTENSOR_RNG_AGREEMENT='strict'.*\['sync', 'error'\]"):
        random_agreement._initial_policy()

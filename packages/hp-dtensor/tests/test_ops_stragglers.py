"""Elementwise and batched ops that used to take the fallback keep their shards (2 ranks).

hardswish, floor_divide, rsub, prelu and fill are elementwise (torch does
not tag them pointwise); cross is elementwise off its vector dim; isin tests
each element against the whole test set; matrix_exp and ldl_factor_ex work
per matrix of a batch; ``new_*`` factories of ``self``'s shape are cut like
``self``. Each case: values and gradients against plain tensors, no
collective forward or backward where the op is local on the cut, never the
fallback. Sizes are odd (uneven cuts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.distributed(world_size=2)
def test_untagged_elementwise_ops_keep_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b = _x(5, 3) * 4, _x(5, 3) + 0.5
    for cut in (S0, S1):
        check(F.hardswish, [a], [cut], mesh, expect=[cut])
        check(lambda x, y: torch.rsub(x, y, alpha=2), [a, b], [cut, cut], mesh, expect=[cut])
        check(lambda x: torch.rsub(x, 3.0), [a], [cut], mesh, expect=[cut])
        check(torch.floor_divide, [a, b], [cut, cut], mesh, expect=[cut], grad=False)
        check(lambda x: torch.floor_divide(x, 0.7), [a], [cut], mesh, expect=[cut], grad=False)
    # broadcast: a replicated row against a cut matrix
    check(torch.floor_divide, [a, b[0]], [S0, R], mesh, expect=[S0], grad=False)

    def inplace(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.floor_divide_(y)
        F.hardswish(x, inplace=True)
        return x

    check(inplace, [a, b], [S0, S0], mesh, expect=[S0], grad=False)


@pytest.mark.distributed(world_size=2)
def test_prelu_weight_per_channel(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, w = _x(3, 5, 4, 3), torch.rand(5, dtype=torch.float64)
    check(F.prelu, [x, w], [S0, R], mesh, expect=[S0])
    check(F.prelu, [x, w], [S1, R], mesh, expect=[S1])
    check(F.prelu, [x, w], [S1, S0], mesh, expect=[S1])  # the weight cut like the channels
    check(F.prelu, [x, w], [S2, R], mesh, expect=[S2])
    check(F.prelu, [x, w[:1]], [S1, R], mesh, expect=[S1])  # one weight for every channel


@pytest.mark.distributed(world_size=2)
def test_fill_keeps_the_cut_and_never_reads_the_values(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _x(5, 3)
    value = torch.tensor(2.5, dtype=torch.float64)
    for cut in (S0, S1):
        check(lambda t: torch.fill(t, 1.5), [x], [cut], mesh, expect=[cut])
        check(lambda t: torch.fill(t, value), [x], [cut], mesh, expect=[cut])
    check(lambda t: torch.fill(t, 1.5), [torch.empty(1, 0, 3)], [S2], mesh, expect=[S2], grad=False)
    # a partial x: its terms are never summed, every rank writes the whole value
    partial = DTensor.from_local(x.clone(), mesh, [Partial("sum")])
    with record_collectives() as log:
        out = torch.fill(partial, value)
    assert len(log) == 0 and out.placements == (R,)
    torch.testing.assert_close(out.full_tensor(), torch.full_like(x, 2.5))


@pytest.mark.distributed(world_size=2)
def test_isin_keeps_the_elements_cut_and_gathers_the_test_set(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    elements, test = torch.randint(0, 9, (5, 3)), torch.tensor([1, 4, 7, 8, 2])
    for cut in (S0, S1):
        check(torch.isin, [elements, test], [cut, R], mesh, expect=[cut])
        check(lambda e, t: torch.isin(e, t, invert=True), [elements, test], [cut, R], mesh, expect=[cut])
        check(lambda e: torch.isin(e, 4), [elements], [cut], mesh, expect=[cut])
    # a cut test set must be gathered: each element is tested against all of it
    check(torch.isin, [elements, test], [S0, S0], mesh, local=False, expect=[S0])
    check(lambda t: torch.isin(4, t), [test], [S0], mesh, local=False, expect=[R])


@pytest.mark.distributed(world_size=2)
def test_cross_is_local_off_the_vector_dim(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    a, b = _x(5, 3, 7), _x(5, 3, 7)
    for cut in (S0, S2):
        check(lambda x, y: torch.cross(x, y, dim=1), [a, b], [cut, cut], mesh, expect=[cut])
        check(lambda x, y: torch.linalg.cross(x, y, dim=1), [a, b], [cut, R], mesh, expect=[cut])
    check(
        lambda x, y: torch.linalg.cross(x, y),
        [a.mT, b[:1].mT],
        [S0, R],
        mesh,
        expect=[S0],
        local_backward=False,
    )
    # the vectors themselves cut: gathered (one operand's other cut is kept where it has one)
    check(lambda x, y: torch.linalg.cross(x, y, dim=1), [a, b], [S1, S1], mesh, local=False, expect=[R])
    check(lambda x, y: torch.linalg.cross(x, y, dim=1), [a, b], [S1, S2], mesh, local=False, expect=[S2])


@pytest.mark.distributed(world_size=2)
def test_batched_matrix_functions_keep_the_batch_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    m = _x(3, 5, 4, 4) * 0.5
    for cut in (S0, S1):
        check(torch.matrix_exp, [m], [cut], mesh, expect=[cut])
    spd = m @ m.mT + torch.eye(4, dtype=torch.float64)
    for hermitian in (False, True):
        out = check(
            lambda s, h=hermitian: torch.linalg.ldl_factor_ex(s, hermitian=h), [spd], [S1], mesh, grad=False
        )
        assert [t.placements for t in out] == [(S1,)] * 3
    # a cut matrix dim is gathered
    check(torch.matrix_exp, [m], [Shard(3)], mesh, local=False, expect=[R])


@pytest.mark.distributed(world_size=2)
def test_new_factories_of_self_shape_follow_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``new_*`` of ``self``'s shape is built piecewise (autograd's new_empty_strided + copy_ stays local)."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _x(5, 3, 4)
    for cut in (S0, S1):
        dt = distribute_tensor(x, mesh, [cut])
        with record_collectives() as log:
            zeros = dt.new_zeros(5, 3, 4)
            full = dt.new_full((5, 3, 4), 2.0)
            empty = dt.new_empty_strided((5, 3, 4), (12, 4, 1))
            empty.copy_(dt)
        assert len(log) == 0
        for t in (zeros, full, empty):
            assert t.placements == (cut,) and t.to_local().shape == dt.to_local().shape
        assert empty.to_local().is_contiguous()
        torch.testing.assert_close(zeros.full_tensor(), torch.zeros_like(x))
        torch.testing.assert_close(full.full_tensor(), torch.full_like(x, 2.0))
        torch.testing.assert_close(empty.full_tensor(), x)
        # a size sharing the cut dim's size: cut alike (a constant may be cut any way)
        column = dt.new_ones(5, 3, 1)
        assert column.placements == (cut,)
        torch.testing.assert_close(column.full_tensor(), torch.ones(5, 3, 1, dtype=x.dtype))
        # another size, or a partial self: built whole on every rank
        assert dt.new_ones(2, 3).placements == (R,)
        assert dt.new_ones(2, 2, 4).placements == (R,)
    partial = DTensor.from_local(x.clone(), mesh, [Partial("sum")])
    ones = partial.new_ones(5, 3, 4)
    assert ones.placements == (R,)
    torch.testing.assert_close(ones.full_tensor(), torch.ones_like(x))


@pytest.mark.distributed(world_size=2)
def test_vander_keeps_the_cut(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """``linalg.vander`` cats a column of ones (``new_ones``) beside the powers: both cut alike."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    check(lambda v: torch.linalg.vander(v, N=4), [_x(5)], [S0], mesh, expect=[S0])
    check(torch.linalg.vander, [_x(3, 5)], [S0], mesh, expect=[S0])


@pytest.mark.distributed(world_size=2)
def test_activation_backward_ops_keep_cuts(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The backward ops of these activations are not tagged pointwise in torch: they used to fall back."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _x(5, 3) * 3
    activations = [
        F.hardsigmoid,
        F.relu6,
        lambda t: F.hardtanh(t, -0.5, 2.0),
        F.mish,
        F.elu,
        F.selu,
        F.celu,
        lambda t: F.leaky_relu(t, 0.2),
        lambda t: F.softplus(t, beta=2.0, threshold=1.0),
        F.softshrink,
        F.hardshrink,
    ]
    for fn in activations:
        for cut in (S0, S1):
            check(fn, [x], [cut], mesh, expect=[cut])


@pytest.mark.distributed(world_size=2)
def test_glu_is_local_off_its_dim(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _x(5, 6, 3)
    check(lambda t: F.glu(t, 1), [x], [S0], mesh, expect=[S0])
    check(lambda t: F.glu(t, 1), [x], [S2], mesh, expect=[S2])
    check(F.glu, [x.mT], [S1], mesh, expect=[S1])
    # the halved dim itself cut: gathered
    check(lambda t: F.glu(t, 1), [x], [S1], mesh, local=False, expect=[R])

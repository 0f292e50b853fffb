"""Halo exchange: convolution and pooling on an input cut along a spatial dim keep that cut.

Each case runs under ``fallback_policy("error")`` against the op on plain
tensors (float64, values, max pooling indices and every gradient). The
communication is counted inside the op: one all-gather of border rows in the
forward; in the backward one for the input gradient's halo going home (a
convolution's weight gradient reads the input's halo the forward kept), each
payload computed here row by row, far below the input's size;
pooling windows that line up with the cut send nothing. Cuts without a
plan (an empty output piece, a window reaching past the neighbour on 4
ranks) are gathered and still right.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Partial, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check

S0, S1, S2, S3, S4, R = Shard(0), Shard(1), Shard(2), Shard(3), Shard(4), Replicate()
SUM = Partial("sum")
GATHER = "all_gather_into_tensor"


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _row_bytes(shape: tuple[int, ...], dim: int) -> int:
    """Bytes of one slice of a float64 tensor of ``shape`` along ``dim``."""
    size = 8
    for d, n in enumerate(shape):
        size *= 1 if d == dim else n
    return size


def _exchange(
    fn: Callable[..., Any], inputs: list[torch.Tensor], placements: list[Any], mesh: Any
) -> tuple[Any, Any, Any]:
    """Run ``fn`` forward and backward on DTensors; the logs of both and the output."""
    dts = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(inputs, placements, strict=True)]
    with fallback_policy("error"):
        with record_collectives() as forward:
            out = fn(*dts)
        loss = (out[0] if isinstance(out, tuple) else out).sum()
        with record_collectives() as backward:
            loss.backward()
    return forward, backward, (out, dts)


@pytest.mark.distributed(world_size=2)
def test_conv_on_cut_height_and_width_sends_border_rows_only(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, w, b = _t(2, 3, 16, 12), _t(4, 3, 3, 3), _t(4)
    for stride in (1, 2):
        fn = lambda x, w, b, s=stride: F.conv2d(x, w, b, stride=s, padding=1)  # noqa: E731
        for dim in (2, 3):
            cut = Shard(dim)
            with fallback_policy("error"):
                check(fn, [x, w, b], [cut, R, R], mesh, expect=[cut], local=False)
            forward, backward, (out, (_, dw, db)) = _exchange(fn, [x, w, b], [cut, R, R], mesh)
            # 2 ranks' buffers of 2 rows. Stride 1: each piece reads 1 row of the other. Stride 2:
            # the left piece's last window ends on its own last row; the right piece reads 1 row,
            # plus 1 because its extended piece starts on a multiple of the stride
            rows = 2 * 2
            assert forward.counts() == {GATHER: 1}, list(forward)
            assert forward.nbytes() == rows * _row_bytes(x.shape, dim) < x.numel() * 8 / 2
            # the backward: only the input gradient's halo home to its owners (the weight gradient
            # reads the input's halo the forward kept)
            assert backward.counts() == {GATHER: 1}, list(backward)
            assert [r.nbytes for r in backward] == [rows * _row_bytes(x.shape, dim)]
            assert out.placements == (cut,)
            assert dw.grad.placements == (SUM,) and db.grad.placements == (SUM,)


_CONVS: list[tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...], list[Any]]] = [
    (lambda x, w: F.conv1d(x, w, padding=2, dilation=2), (2, 3, 15), (4, 3, 3), [S2]),
    (lambda x, w: F.conv2d(x, w, stride=(2, 3), padding=(0, 2)), (2, 3, 11, 13), (2, 3, 3, 4), [S2, S3]),
    (lambda x, w: F.conv2d(x, w, padding="same"), (1, 2, 9, 8), (3, 2, 3, 5), [S2, S3]),
    (lambda x, w: F.conv3d(x, w, stride=2, padding=1), (1, 2, 7, 6, 9), (2, 2, 3, 3, 3), [S2, S3, S4]),
    (lambda x, w: F.conv2d(x, w, padding=1, groups=2), (2, 4, 9, 7), (6, 2, 3, 3), [S2, S3]),
    # transposed: each input row writes kernel rows of the output, stride apart
    (
        lambda x, w: F.conv_transpose1d(x, w, stride=2, padding=1, output_padding=1),
        (2, 3, 9),
        (3, 2, 3),
        [S2],
    ),
    (lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=4, dilation=2), (2, 3, 10), (3, 2, 4), [S2]),
    (
        lambda x, w: F.conv_transpose2d(x, w, stride=(1, 2), padding=(2, 0)),
        (1, 2, 8, 7),
        (2, 3, 5, 2),
        [S2, S3],
    ),
    (
        lambda x, w: F.conv_transpose3d(x, w, stride=2, groups=2),
        (1, 2, 5, 4, 6),
        (2, 1, 2, 3, 2),
        [S2, S3, S4],
    ),
]


@pytest.mark.distributed(world_size=2)
def test_conv_halos_uneven_strided_dilated_grouped(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    with fallback_policy("error"):
        for fn, xs, ws, cuts in _CONVS:
            x, w = _t(*xs), _t(*ws)
            for cut in cuts:
                check(fn, [x, w], [cut, R], mesh, expect=[cut], local=False)


_POOLS: list[tuple[Callable[[torch.Tensor], Any], tuple[int, ...], list[Any]]] = [
    (lambda x: F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True), (2, 3, 11, 10), [S2, S3]),
    (
        lambda x: F.max_pool2d(x, 3, stride=2, padding=1, dilation=2, ceil_mode=True, return_indices=True),
        (2, 2, 13, 12),
        [S2, S3],
    ),
    (lambda x: F.avg_pool2d(x, 3, stride=1), (2, 3, 9, 8), [S2, S3]),
    (
        lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        (2, 3, 12, 11),
        [S2, S3],
    ),
    (lambda x: F.avg_pool2d(x, 3, divisor_override=2, padding=1), (1, 2, 10, 9), [S2, S3]),
    (lambda x: F.max_pool3d(x, 3, 2, 1, return_indices=True), (1, 2, 7, 6, 9), [S2, S3, S4]),
    (lambda x: F.avg_pool3d(x, (2, 3, 3), 2, 1), (1, 2, 7, 6, 9), [S2, S3, S4]),
    (lambda x: F.max_pool1d(x, 3, 2, 1), (2, 3, 13), [S2]),
    (lambda x: F.avg_pool1d(x, 4, 3, 1), (2, 3, 13), [S2]),
    (lambda x: F.max_pool2d(x, 3, 1, 1), (3, 8, 7), [S1, S2]),  # unbatched (C, H, W)
]


@pytest.mark.distributed(world_size=2)
def test_pooling_halos_values_indices_and_gradients(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    with fallback_policy("error"):
        for fn, shape, cuts in _POOLS:
            x = _t(*shape)
            for cut in cuts:
                check(fn, [x], [cut], mesh, expect=[cut], local=False)


@pytest.mark.distributed(world_size=2)
def test_pooling_halo_bytes_and_aligned_windows_send_nothing(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = _t(2, 3, 16, 10)
    # 3x3 windows at stride 2: the right piece reads the left's last row (its extended piece starts
    # on a stride: 2 rows); the left piece reads nothing of the right; 2 ranks' buffers of 2 rows
    fn = lambda x: F.max_pool2d(x, 3, stride=2, padding=1)  # noqa: E731
    forward, backward, (out, _) = _exchange(fn, [x], [S2], mesh)
    assert forward.counts() == {GATHER: 1} and forward.nbytes() == 2 * 2 * _row_bytes(x.shape, 2)
    assert backward.counts() == {GATHER: 1} and backward.nbytes() == 2 * 2 * _row_bytes(x.shape, 2)
    assert out.placements == (S2,)
    # 2x2 windows at stride 2 on pieces of 8 rows: every window lies in one piece
    for fn in (lambda x: F.max_pool2d(x, 2), lambda x: F.avg_pool2d(x, 2)):
        forward, backward, (out, _) = _exchange(fn, [x], [S2], mesh)
        assert len(forward) == 0 and len(backward) == 0, (list(forward), list(backward))
        assert out.placements == (S2,)


@pytest.mark.distributed(world_size=2)
def test_cut_without_a_plan_is_gathered_and_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """One output row over 2 ranks leaves a rank no output: the spatial cut is gathered."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, w = _t(2, 3, 5, 4), _t(2, 3, 3, 3)
    fn = lambda x, w: F.conv2d(x, w, stride=3)  # noqa: E731
    with fallback_policy("error"):
        check(fn, [x, w], [S2, R], mesh, expect=[R], local=False)
        check(lambda x: F.max_pool2d(x, 3, 3), [x], [S3], mesh, expect=[R], local=False)


@pytest.mark.distributed(world_size=4)
def test_halos_on_four_ranks_and_two_mesh_dims(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    line = device_mesh_factory((4,))
    x, w = _t(2, 3, 8, 9), _t(4, 3, 3, 3)
    conv = lambda x, w: F.conv2d(x, w, padding=1)  # noqa: E731
    with fallback_policy("error"):
        check(conv, [x, w], [S2, R], line, expect=[S2], local=False)  # pieces of 2 rows, halos of 1
        # a 7-row window reaches past the neighbour's 2 rows: gathered, still right
        wide = lambda x, w: F.conv2d(x, w, padding=3)  # noqa: E731
        check(wide, [x, _t(4, 3, 7, 1)], [S2, R], line, expect=[R], local=False)
        pool = lambda x: F.avg_pool2d(x, 3, 1, 1)  # noqa: E731
        check(pool, [x], [S2], line, expect=[S2], local=False)
        check(pool, [x], [S3], line, expect=[R], local=False)  # 9 columns by torch.chunk: 3, 3, 3, 0
    mesh = device_mesh_factory((2, 2))
    xd = distribute_tensor(x, mesh, [S2, S3]).requires_grad_()  # H on one mesh dim, W on the other
    wd = distribute_tensor(w, mesh, [R, R]).requires_grad_()
    full_x, full_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = conv(full_x, full_w)
    (ref * ref).sum().backward()
    with fallback_policy("error"):
        with record_collectives() as log:
            out = conv(xd, wd)
        assert log.counts() == {GATHER: 2}  # one exchange per mesh dim; corners travel through both
        assert out.placements == (S2, S3)
        with record_collectives() as back:
            (out * out).sum().backward()
    # the input gradient's halo home along each mesh dim; the input's halos were kept from the forward
    assert back.count(GATHER) == 2, list(back)
    torch.testing.assert_close(out.full_tensor(), ref.detach())
    torch.testing.assert_close(xd.grad.full_tensor(), full_x.grad)
    torch.testing.assert_close(wd.grad.full_tensor(), full_w.grad)
    # batch on one mesh dim, height on the other
    with fallback_policy("error"):
        out = conv(distribute_tensor(x, mesh, [S0, S2]), distribute_tensor(w, mesh, [R, R]))
    assert out.placements == (S0, S2)
    torch.testing.assert_close(out.full_tensor(), ref.detach())


@pytest.mark.distributed(world_size=2)
def test_spatially_parallel_cnn_trains_like_one_process(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """conv, relu, max pool, conv, avg pool on images cut by height: 2 SGD steps against one process.

    The forward sends border rows for the two convolutions only (the 2x2 pools line up with the
    pieces), never an activation.
    """
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)

    def net() -> torch.nn.Sequential:
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(4, 4, 3, padding=1),
            torch.nn.AvgPool2d(2),
        ).double()

    ref, ours = net(), net()
    ours.load_state_dict(ref.state_dict())
    for module in (ours[0], ours[3]):
        for name, param in list(module.named_parameters()):
            setattr(module, name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [R])))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    with fallback_policy("error"):
        for _ in range(2):
            x = _t(2, 3, 16, 12)
            loss_ref = ref(x).square().mean()
            loss_ref.backward()
            images = distribute_tensor(x, mesh, [S2])
            with record_collectives() as log:
                out = ours(images)
            assert out.placements == (S2,)
            assert log.counts() == {GATHER: 2}, list(log)
            assert log.nbytes() == 2 * 2 * (_row_bytes((2, 3, 16, 12), 2) + _row_bytes((2, 4, 8, 6), 2))
            loss = out.square().mean()
            loss.backward()
            torch.testing.assert_close(loss.full_tensor(), loss_ref.detach())
            for p in ours.parameters():
                assert p.grad.placements == (SUM,)  # each rank's rows' terms
                p.grad = p.grad.redistribute(placements=[R])
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad()
            opt.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach())

"""A convolution's backward reuses the input halo its forward received instead of exchanging it again.

On a height cut over 2 ranks a forward and backward cost one exchange each
way (the forward's border rows in, the input gradient's halo home), where
they cost three before; values and the input's, weight's and bias's
gradients against plain float64 tensors. Where nothing was kept (a second
backward of a retained graph, a forward without grad mode) the backward
exchanges again and stays right; a second convolution of the same window on
the same input reuses the rows in its forward too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

S2, R = Shard(2), Replicate()
GATHER = "all_gather_into_tensor"


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _leaves(mesh, tensors, placements):  # type: ignore[no-untyped-def]
    pairs = zip(tensors, placements, strict=True)
    return [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in pairs]


def _plain(tensors):  # type: ignore[no-untyped-def]
    return [t.clone().requires_grad_() for t in tensors]


def _weights(out: torch.Tensor) -> torch.Tensor:
    """Distinct weights per output element, so a gradient on the wrong row is caught."""
    return torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).cos()


@pytest.mark.distributed(world_size=2)
def test_conv_backward_reuses_the_forward_halo(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, w, b = _t(2, 3, 12, 7), _t(4, 3, 5, 3), _t(4)
    for conv in (
        lambda x, w, b: F.conv2d(x, w, b, padding=(2, 1)),
        lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
    ):
        full = _plain([x, w, b])
        ref = conv(*full)
        (ref * _weights(ref)).sum().backward()
        xd, wd, bd = _leaves(mesh, [x, w, b], [S2, R, R])
        with fallback_policy("error"):
            with record_collectives() as forward:
                out = conv(xd, wd, bd)
            loss = (out * distribute_tensor(_weights(ref), mesh, [S2])).sum()
            with record_collectives() as backward:
                loss.backward()
        assert out.placements == (S2,)
        assert forward.counts() == {GATHER: 1}, list(forward)
        # the input gradient's halo going home, then the loss's and the partial gradients' reductions:
        # no second exchange of the input's halo (there were 2 gathers of borders before)
        assert backward.count(GATHER) == 1, list(backward)
        torch.testing.assert_close(out.full_tensor(), ref.detach())
        for d, f in zip((xd, wd, bd), full, strict=True):
            torch.testing.assert_close(d.grad.full_tensor(), f.grad)


@pytest.mark.distributed(world_size=2)
def test_conv_without_kept_rows_exchanges_again(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A retained graph's second backward finds the rows released: it exchanges them again, rightly."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    x, w = _t(1, 2, 10, 6), _t(3, 2, 3, 3)
    conv = lambda x, w: F.conv2d(x, w, padding=1)  # noqa: E731
    full = _plain([x, w])
    ref = conv(*full)
    ref.sum().backward(retain_graph=True)
    ref.sum().backward()
    xd, wd = _leaves(mesh, [x, w], [S2, R])
    with fallback_policy("error"):
        out = conv(xd, wd)
        with record_collectives() as first:
            out.sum().backward(retain_graph=True)
        with record_collectives() as second:
            out.sum().backward()
    assert first.count(GATHER) == 1 and second.count(GATHER) == 2, (list(first), list(second))
    for d, f in zip((xd, wd), full, strict=True):
        torch.testing.assert_close(d.grad.full_tensor(), f.grad)
    # a forward without grad mode keeps nothing: a later backward of the same input (through a new
    # graph) is untouched by it, and the no-grad forward itself is right
    with torch.no_grad(), fallback_policy("error"):
        torch.testing.assert_close(conv(xd, wd).full_tensor(), conv(x, w))


@pytest.mark.distributed(world_size=2)
def test_two_convs_of_one_input_share_its_halo(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Two 3x3 convolutions of one input (two branches): one exchange of its border rows for both."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(2)
    x, w1, w2 = _t(2, 3, 8, 5), _t(4, 3, 3, 3), _t(2, 3, 3, 3)
    conv = lambda x, w: F.conv2d(x, w, padding=1)  # noqa: E731
    full = _plain([x, w1, w2])
    (conv(full[0], full[1]).sum() + conv(full[0], full[2]).square().sum()).backward()
    xd, w1d, w2d = _leaves(mesh, [x, w1, w2], [S2, R, R])
    with fallback_policy("error"):
        with record_collectives() as forward:
            a, b = conv(xd, w1d), conv(xd, w2d)
        with record_collectives() as backward:
            (a.sum() + b.square().sum()).backward()
    assert forward.counts() == {GATHER: 1}, list(forward)
    assert backward.count(GATHER) == 2, list(backward)  # each input gradient's halo home, nothing more
    for d, f in zip((xd, w1d, w2d), full, strict=True):
        torch.testing.assert_close(d.grad.full_tensor(), f.grad)

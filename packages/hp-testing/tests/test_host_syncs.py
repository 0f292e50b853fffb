"""count_host_syncs: every read that would stall a device stream is caught, with its line; nothing else is.

Each kind of read listed in [Note: what counts as a host sync] is planted once
and must be counted once, at the planting line; ordinary ops, meta tensors,
reads of host-resident optimizer steps and the emulation layer's own reads
must not be. A toy wrapper subclass stands in for DTensor: its reads happen
inside its ``__torch_dispatch__``, which a plain dispatch mode would not see
([Note: seeing the ops inside a tensor subclass]).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_testing import count_host_syncs
from torch.utils._pytree import tree_map

HERE = "tests/test_host_syncs.py"


def _line(fn: Callable[[], Any]) -> int:
    """The line the planted read is on: the lambda's own line."""
    return fn.__code__.co_firstlineno


X = torch.tensor([1.0, -2.0, 3.0, -4.0])
MASK = X > 0

# (name, planted read, what the log calls it): one of each kind the note lists.
PLANTED: list[tuple[str, Callable[[], Any], str]] = [
    ("item", lambda: X.sum().item(), "aten._local_scalar_dense"),
    ("float", lambda: float(X[0]), "aten._local_scalar_dense"),
    ("bool", lambda: bool(X.sum() > 0), "aten._local_scalar_dense"),
    ("if", lambda: 1 if X[1] else 0, "aten._local_scalar_dense"),
    ("equal", lambda: torch.equal(X, X), "aten.equal"),
    ("allclose", lambda: torch.allclose(X, X), "aten.allclose"),
    ("nonzero", lambda: X.nonzero(), "aten.nonzero"),
    ("where1", lambda: torch.where(MASK), "aten.nonzero"),
    ("argwhere", lambda: torch.argwhere(X), "aten.nonzero"),
    ("masked_select", lambda: X.masked_select(MASK), "aten.masked_select"),
    ("mask_index", lambda: X[MASK], "aten.index"),
    ("mask_assign", lambda: X.clone().__setitem__(MASK, 0.0), "aten.index_put_"),
    ("repeat_interleave", lambda: X.repeat_interleave(torch.tensor([1, 2, 1, 1])), "aten.repeat_interleave"),
    ("unique", lambda: torch.unique(X), "aten._unique2"),
    ("bincount", lambda: torch.bincount(torch.tensor([0, 2])), "aten.bincount"),
    ("tolist", lambda: X.tolist(), ".tolist()"),
    ("cpu", lambda: X.cpu(), ".cpu()"),
    ("print", lambda: repr(X), "print / repr()"),
    ("fstring", lambda: f"{X}", "print / repr()"),
    ("synchronize", lambda: hp_core.get_platform().handle.synchronize(), "DeviceHandle.synchronize()"),
    ("stream", lambda: hp_core.get_platform().handle.new_stream().synchronize(), "stream.synchronize()"),
    ("event", lambda: hp_core.get_platform().handle.new_event().synchronize(), "event.synchronize()"),
]


@pytest.mark.parametrize(("name", "read", "what"), PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_read_is_counted_once_at_its_line(name: str, read: Callable[[], Any], what: str) -> None:
    with count_host_syncs() as log:
        read()
    assert log.count == 1, log.report()
    (sync,) = log.syncs
    assert sync.what == what, log.report()
    assert sync.site.endswith(f"{HERE.split('/')[-1]}:{_line(read)} in <lambda>"), log.report()
    assert f"1 x {what}" in log.report() and sync.site in log.report()


def test_ordinary_work_counts_nothing() -> None:
    """Arithmetic, reductions kept as tensors, masks used as weights, meta tensors, output_size given."""
    w = torch.randn(4, 3, requires_grad=True)
    with count_host_syncs() as log:
        y = (X @ w).relu().sum()
        y.backward()
        torch.where(MASK, X, 0.0).sum()
        X.masked_fill(MASK, 0.0)
        X.repeat_interleave(torch.tensor([1, 2, 1, 1]), output_size=5)
        torch.linalg.vector_norm(X).clamp(max=1.0)
        meta = torch.empty(4, device="meta")
        meta.index_put_((meta > 0,), torch.tensor(0.0, device="meta"))  # a meta mask reads no data
        torch.tensor([2.0]).to("cpu")  # moving to "its" device is not a read
    assert log.count == 0, log.report()


def test_the_backward_is_seen() -> None:
    """A read inside an autograd Function's backward is counted at the line that reads."""

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if grad.sum() > 0:  # the planted read
                return grad * 2
            return grad

    x = torch.ones(3, requires_grad=True)
    with count_host_syncs() as log:
        ReadsInBackward.apply(x).sum().backward()
    assert log.count == 1, log.report()
    assert "in backward" in log.syncs[0].site, log.report()


class Wrapped(torch.Tensor):
    """A minimal wrapper subclass: each op runs on the inner tensor inside ``__torch_dispatch__``."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)  # type: ignore[return-value]

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrapped = tree_map(lambda a: a.inner if isinstance(a, Wrapped) else a, (args, kwargs or {}))
        if func is torch.ops.aten.sum.default:
            inner = unwrapped[0][0]
            if inner.abs().max() > 100:  # the planted read, inside the subclass
                raise ValueError("too large")
        out = func(*unwrapped[0], **unwrapped[1])
        return tree_map(lambda o: Wrapped(o) if isinstance(o, torch.Tensor) else o, out)


def test_reads_inside_a_subclass_dispatch_are_seen_and_counted_once() -> None:
    w = Wrapped(X.clone())
    with count_host_syncs() as log:
        (w * 2).sum()  # one read, in Wrapped.__torch_dispatch__
        w.sum().item()  # .item() of the wrapper: one read, of the inner tensor
    assert log.count == 3, log.report()  # the sum's check twice, the item once
    sites = [s.site for s in log.syncs]
    assert all("__torch_dispatch__" in s for s in sites), log.report()
    # the outer frames lead back to the test's own lines
    assert all(any("test_reads_inside_a_subclass" in f for f in s.stack) for s in log.syncs), log.report()


def test_printing_is_one_read_and_patches_are_undone() -> None:
    originals = {name: torch.Tensor.__dict__.get(name) for name in ("__repr__", "tolist", "cpu")}
    with count_host_syncs() as log:
        print(X)  # printing calls tolist and item inside: still one read
        with count_host_syncs() as inner:
            X.tolist()
    assert log.count == 2 and inner.count == 1, log.report()
    assert {name: torch.Tensor.__dict__.get(name) for name in originals} == originals
    assert "__repr__" not in sys.modules[__name__].__dict__


def test_host_resident_optimizer_steps_are_allowed_and_allow_adds_frames() -> None:
    """torch's for-loop and foreach AdamW read their CPU ``step`` counters: host tensors on a GPU too."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    for foreach in (False, True):
        opt = torch.optim.AdamW([p], foreach=foreach)
        with count_host_syncs() as log:
            opt.step()
        assert log.count == 0 and len(log.allowed) >= 1, log.report()

    def reads_a_host_counter(counter: torch.Tensor) -> int:
        return int(counter.item())

    counter = torch.tensor(3)
    with count_host_syncs(allow=[f"{__name__.replace('.', '/')}.py:reads_a_host_counter"]) as log:
        reads_a_host_counter(counter)
    assert log.count == 0 and len(log.allowed) == 1, log.report()
    with count_host_syncs() as log:
        reads_a_host_counter(counter)
    assert log.count == 1, log.report()


def test_a_string_for_allow_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"got the string 'a.py:f'; pass \('a.py:f',\)"):
        with count_host_syncs(allow="a.py:f"):
            pass


@pytest.mark.parametrize(
    "backend_name",
    [
        pytest.param(b, marks=pytest.mark.distributed(world_size=2, backend=b, strict=True), id=b)
        for b in ("gloo", "nccl-emu")
    ],
)
def test_collectives_and_the_emulation_layer_make_no_host_sync(rank: int, backend_name: str) -> None:
    """The layer's own checks (strict mode compares snapshots at ``wait()``) are not the program's."""
    t = torch.full((4,), float(rank))
    got = torch.empty(4)
    with count_host_syncs() as log:
        dist.all_reduce(t)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        peer = 1 - rank
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, got, peer)])
        for w in works:
            w.wait()
        total = t.sum().item()  # the planted one
    assert total == 8.0  # (0 + 1) summed twice over 2 ranks, 4 elements
    assert torch.equal(got, t)
    assert log.count == 1 and log.syncs[0].what == "aten._local_scalar_dense", log.report()

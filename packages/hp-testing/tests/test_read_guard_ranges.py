"""The strict read guard's overlap test, on one process without any collective.

The guard's per-op check skips most of the work for tensors that start above
a pending buffer ([Note: the read guard's fast path] in ``_read_guard.py``);
these cases pin that shortcut to the full byte-range answer: a tensor that
starts below a buffer and reaches into it is caught, one that ends where the
buffer begins is not, an empty tensor touches nothing, and the ranges follow
the pending set as work is posted and waited. The planted-bug sessions
(``test_planted_hazards.py``, ``test_checks.py``) cover the same guard end to end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hp_testing._hazards import AsyncHazardError
from hp_testing._read_guard import ReadGuard


@pytest.fixture
def guard() -> Iterator[ReadGuard]:
    g = ReadGuard()
    g.warm_up()
    yield g
    g.clear()


def _raises(fn: object) -> bool:
    try:
        fn()  # type: ignore[operator]
    except AsyncHazardError:
        return True
    return False


def test_reads_that_overlap_a_pending_output_raise(guard: ReadGuard) -> None:
    whole = torch.ones(100)
    pending = whole[40:60]
    guard.add(0, [(pending, "the output tensor", True)], "all_reduce(x)", "t.py:1")
    assert _raises(lambda: pending.sum())
    assert _raises(lambda: pending[5:].sum())  # starts inside
    assert _raises(lambda: whole[:50].sum())  # starts below, reaches into it
    assert _raises(lambda: whole[::10].sum())  # strided over it
    assert _raises(lambda: whole.view(10, 10).t().sum())  # a transposed view over all of it
    assert not _raises(lambda: whole[:40].sum())  # ends where it begins
    assert not _raises(lambda: whole[60:].sum())  # begins where it ends
    assert not _raises(lambda: whole[40:40].sum())  # empty, at its address
    assert not _raises(lambda: torch.ones(100).sum())  # elsewhere


def test_a_pending_input_may_be_read_not_written(guard: ReadGuard) -> None:
    source = torch.ones(8)
    guard.add(0, [(source, "the input tensor", False)], "isend(x)", "t.py:1")
    assert not _raises(lambda: source.sum())
    assert not _raises(lambda: torch.zeros(8).add_(source))  # read as the second argument
    assert _raises(lambda: source.add_(1))
    assert _raises(lambda: source[2:].mul_(2))
    assert _raises(lambda: torch.add(torch.ones(8), 1, out=source))  # written through a keyword


def test_the_ranges_follow_the_pending_set(guard: ReadGuard) -> None:
    first, second = torch.ones(4), torch.ones(4)
    guard.add(0, [(first, "the output tensor", True)], "all_reduce(a)", "t.py:1")
    guard.add(1, [(second, "the output tensor", True)], "all_reduce(b)", "t.py:2")
    with pytest.raises(AsyncHazardError, match=r"all_reduce\(b\) was issued at t.py:2"):
        second.sum()
    guard.remove(1)
    assert not _raises(lambda: second.sum())
    assert _raises(lambda: first.sum())
    guard.remove(0)
    assert not guard.buffers
    assert not _raises(lambda: first.sum())


def test_print_and_tolist_of_a_pending_output_raise(guard: ReadGuard) -> None:
    pending = torch.ones(3)
    guard.add(0, [(pending, "the output tensor", True)], "all_reduce(x)", "t.py:1")
    with pytest.raises(AsyncHazardError, match=r"print / repr\(\) at .*test_read_guard_ranges.py"):
        repr(pending)
    assert _raises(lambda: pending.tolist())
    assert not _raises(lambda: repr(torch.ones(3)))


def test_compiled_code_is_checked_and_the_guard_is_never_compiled(guard: ReadGuard) -> None:
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()  # the rest runs eagerly with dynamo's frame hook set
        return y.sum(0) + 1

    compiled = torch.compile(step, backend="eager")
    pending = torch.ones(6)
    guard.add(0, [(pending, "the output tensor", True)], "all_reduce(x)", "t.py:1")
    for shape in [(3,), (3, 3), (2, 2, 2)]:
        compiled(torch.ones(shape))
    assert _raises(lambda: compiled(pending))
    guard.clear()
    from hp_testing import _read_guard

    for code in (
        _read_guard._Mode.__torch_dispatch__.__code__,
        _read_guard.ReadGuard.inspect.__code__,
        _read_guard.ReadGuard._touch.__code__,
        _read_guard._extent.__code__,
    ):
        assert not _debug_get_cache_entry_list(code), f"dynamo compiled the guard's {code.co_name}"
    torch._dynamo.reset()


class _Wrapper(torch.Tensor):
    """A toy wrapper subclass built like hp-dtensor's DTensor: its attribute is set after construction."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return cls._wrap(inner)

    @classmethod
    def _wrap(cls, inner: torch.Tensor) -> _Wrapper:
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        out._inner = inner  # a frame resumed after _make_wrapper_subclass sees it unset
        return out

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_inner"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: None, size: object, stride: object
    ) -> _Wrapper:
        return _Wrapper(inner["_inner"])

    def __repr__(self) -> str:  # type: ignore[override]
        return f"_Wrapper({self._inner!r})"

    @classmethod
    def __torch_dispatch__(
        cls, func: object, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        plain = [a._inner if isinstance(a, _Wrapper) else a for a in args]
        local = func(*plain, **(kwargs or {}))  # type: ignore[operator]
        out = torch.Tensor._make_wrapper_subclass(cls, local.shape, dtype=local.dtype)
        out._inner = local
        return out


def test_strict_mode_compiles_what_a_plain_run_compiles(guard: ReadGuard) -> None:
    """A compiled frame entered while work is pending is compiled, not run eagerly under dynamo's hook.

    The composition matrix's fsdp-nested-tp-zbv-fp32-noac-compiled case failed
    only under strict mode: dynamo declined the compiled block (a dispatch mode
    was pushed), a hook inside it waited the pending all-gather (the mode
    popped), and dynamo then compiled hp-dtensor's ``__torch_dispatch__`` on its
    own, whose resume frame met a half-built wrapper ([Note: the guard and
    torch.compile]). The toy wrapper here is built the same way.
    """
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    gathered, prefetched = torch.ones(4), torch.ones(4)

    # FSDP's hooks run eagerly inside the compiled block: the pre-forward hook waits this block's
    # all-gather (the mode pops), the post-forward hook issues the next block's (it is pushed again).
    @torch._dynamo.disable
    def pre_forward() -> None:
        guard.remove(0)

    @torch._dynamo.disable
    def post_forward() -> None:
        guard.add(1, [(prefetched, "the output tensor", True)], "all_gather(next)", "t.py:2")

    def block(x: torch.Tensor, w: _Wrapper) -> tuple[torch.Tensor, _Wrapper]:
        y = x + 1
        pre_forward()
        out = w * 2  # without the fix: dynamo compiles _Wrapper.__torch_dispatch__ here, and fails
        post_forward()
        return y, out

    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, backend="eager")
        guard.add(0, [(gathered, "the output tensor", True)], "all_gather(this)", "t.py:1")
        _, out = compiled(torch.ones(3), _Wrapper(torch.ones(3)))
        guard.remove(1)
        assert isinstance(out, _Wrapper) and torch.equal(out._inner, torch.full((3,), 2.0))
        assert _debug_get_cache_entry_list(block.__code__), "strict mode kept dynamo from compiling the block"
        assert not _debug_get_cache_entry_list(_Wrapper.__torch_dispatch__.__code__)
    finally:
        torch._dynamo.reset()


def test_work_waited_inside_a_compiled_call_leaves_a_usable_dispatcher(guard: ReadGuard) -> None:
    """All pending work waited inside a compiled call: the next eager op runs, and later reads are caught.

    torch's compiled-call wrapper restores on exit the dispatch keys it saw on
    entry. The mode used to pop when the last work was waited, so a call entered
    with work pending and left with none kept the Python keys on with no mode,
    and the next op hit an internal assert ("Hit Python dispatch key but no
    arguments had PyInterpreter"). The mode now stays on, inert, until the test
    ends ([Note: the mode stays on until the test ends]).
    """
    import torch._dynamo

    pending, later = torch.ones(4), torch.ones(4)

    @torch._dynamo.disable
    def wait_inside() -> None:
        guard.remove(0)

    def block(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        wait_inside()
        return y + 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, backend="eager")
        guard.add(0, [(pending, "the output tensor", True)], "all_reduce(a)", "t.py:1")
        out = compiled(torch.ones(3))
        assert torch.equal(out + 0, torch.full((3,), 3.0))  # an eager op after the call
        guard.add(1, [(later, "the output tensor", True)], "all_reduce(b)", "t.py:2")
        with pytest.raises(AsyncHazardError, match=r"all_reduce\(b\)"):
            later.sum()
        guard.remove(1)
    finally:
        torch._dynamo.reset()


def test_work_issued_inside_a_compiled_call_is_still_guarded_after_it(guard: ReadGuard) -> None:
    """The mode pushed inside a compiled call: after the call returns, a read of the pending buffer raises.

    The wrapper's exit turns the Python keys off again (they were off at entry);
    the next call the layer records turns them back on, and a read in between
    would go unseen, so the test issues a second call first, as any program that
    keeps communicating does.
    """
    import torch._dynamo

    first, second = torch.ones(4), torch.ones(4)

    @torch._dynamo.disable
    def issue_inside() -> None:
        guard.add(0, [(first, "the output tensor", True)], "all_reduce(a)", "t.py:1")

    def block(x: torch.Tensor) -> torch.Tensor:
        issue_inside()
        return x * 2

    torch._dynamo.reset()
    try:
        torch.compile(block, backend="eager")(torch.ones(3))
        guard.add(1, [(second, "the output tensor", True)], "all_reduce(b)", "t.py:2")
        with pytest.raises(AsyncHazardError, match=r"all_reduce\(a\)"):
            first.sum()
        guard.remove(0)
        guard.remove(1)
    finally:
        torch._dynamo.reset()

"""The layer's argument binding: every call form of every wrapped function reads as ``inspect`` binds it."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch.distributed as dist
from hp_testing.emulation import COLLECTIVES, OBJECT_P2P, P2P, binder

NAMES = [name for name in (*COLLECTIVES, *P2P, *OBJECT_P2P) if hasattr(dist, name)]


def _reference(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _forms(fn: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Positional, keyword, mixed and defaults-only calls, with a distinct marker per argument."""
    params = list(inspect.signature(fn).parameters.values())
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    every = [p.name for p in params]
    value = {name: f"<{name}>" for name in every}
    forms: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (tuple(value[n] for n in required), {}),  # defaults filled in
        ((), {n: value[n] for n in required}),  # required ones by keyword
        (tuple(value[n] for n in every), {}),  # all positional
        ((), {n: value[n] for n in reversed(every)}),  # all by keyword, in another order
    ]
    for split in range(len(every) + 1):  # the first `split` positional, the rest by keyword
        forms.append((tuple(value[n] for n in every[:split]), {n: value[n] for n in every[split:]}))
    return forms


@pytest.mark.parametrize("name", NAMES)
def test_every_call_form_binds_as_inspect_does(name: str) -> None:
    fn = getattr(dist, name)
    bind = binder(fn)
    for args, kwargs in _forms(fn):
        got = bind(args, dict(kwargs))
        want = _reference(fn, args, kwargs)
        assert got == want and list(got) == list(want), (name, args, kwargs)


def test_bad_calls_raise_as_the_function_would() -> None:
    bind = binder(dist.all_reduce)
    for args, kwargs in [
        (("t", "op", "group", "async", "extra"), {}),  # too many positionals
        (("t",), {"tensor": "again"}),  # given twice
        (("t",), {"no_such": 1}),  # unknown keyword
        ((), {"op": "sum"}),  # the tensor is missing
    ]:
        with pytest.raises(TypeError) as ours:
            bind(args, kwargs)
        with pytest.raises(TypeError) as theirs:
            _reference(dist.all_reduce, args, kwargs)
        assert str(ours.value) == str(theirs.value)


def test_signatures_with_star_args_take_inspect() -> None:
    def fn(a: Any, *rest: Any, b: Any = 2, **more: Any) -> None: ...

    bind = binder(fn)
    assert bind((1, 5, 6), {"c": 3}) == _reference(fn, (1, 5, 6), {"c": 3})
    assert bind((1,), {}) == {"a": 1, "rest": (), "b": 2, "more": {}}

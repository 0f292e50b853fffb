"""Profiler labels for FSDP's hooks and collectives, named like FSDP2's (``FSDP::all_gather``, ...).

[Note: profiler labels]
A profile of a step should show which time FSDP spends, under the names a
user of FSDP2 already looks for. ``torch.profiler.record_function`` is
cheap, but it still builds a handle per call, and the hooks run for every
unit every step; so each label is entered only while a profiler is active
(``torch.autograd.profiler._is_profiler_enabled``, a module attribute read
per call), and labels that carry a module name are formatted only then.
The hooks are ``torch._dynamo.disable``-d, so the labels never enter a
compiled graph.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.autograd.profiler as _profiler

__all__ = ["label", "labelled", "profiling"]

F = TypeVar("F", bound=Callable[..., Any])


def profiling() -> bool:
    """Whether a profiler is recording now (labels cost nothing otherwise)."""
    return bool(_profiler._is_profiler_enabled)


def label(name: str | Callable[[], str]) -> contextlib.AbstractContextManager[None]:
    """``record_function(name)`` while profiling, else a no-op; a callable name is built only then."""
    if not _profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(name() if callable(name) else name)


def labelled(name: str) -> Callable[[F], F]:
    """Decorate a hook so that its whole body shows as ``name`` in a profile (see [Note: profiler labels])."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not _profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap

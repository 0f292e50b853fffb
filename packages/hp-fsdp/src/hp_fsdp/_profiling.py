"""Profiler labels for FSDP's hooks and collectives, named like FSDP2's: ``FSDP::all_gather (layers.3)``.

[Note: profiler labels]
A profile of a step should show which time FSDP spends, and on which unit,
under the names a user of FSDP2 already looks for: the label, then the
unit's FQN in parentheses (none for the root, whose FQN is ``""``, as
FSDP2's ``_with_fqn``). ``torch.profiler.record_function`` is cheap, but it
still builds a handle per call, and the hooks run for every unit every step;
so each label is entered only while a profiler is active
(``torch.autograd.profiler._is_profiler_enabled``, a module attribute read
per call), and the text with the FQN is formatted only then. The hooks are
``torch._dynamo.disable``-d, so the labels never enter a compiled graph.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.autograd.profiler as _profiler

__all__ = ["label", "labelled", "of_kwarg", "of_self", "profiling", "with_fqn"]

F = TypeVar("F", bound=Callable[..., Any])


def profiling() -> bool:
    """Whether a profiler is recording now (labels cost nothing otherwise)."""
    return bool(_profiler._is_profiler_enabled)


def with_fqn(name: str, fqn: str) -> str:
    """``name (fqn)``, or ``name`` alone for the root (FQN ``""``), as FSDP2 writes its labels."""
    return f"{name} ({fqn})" if fqn else name


def label(name: str, fqn: str = "") -> contextlib.AbstractContextManager[None]:
    """``record_function(name (fqn))`` while profiling, else a no-op that formats nothing."""
    if not _profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(with_fqn(name, fqn))


def of_self(attribute: str) -> Callable[..., str]:
    """For :func:`labelled` on a method: the FQN is ``self.<attribute>``."""
    return lambda obj, *args, **kwargs: getattr(obj, attribute)


def of_kwarg(key: str) -> Callable[..., str]:
    """For :func:`labelled` on a function: the FQN is its keyword argument ``key`` (``""`` if absent)."""
    return lambda *args, **kwargs: kwargs.get(key, "")


def labelled(name: str, fqn: Callable[..., str] | None = None) -> Callable[[F], F]:
    """Show a function's whole body as ``name`` (with the unit's FQN) in a profile.

    ``fqn`` reads the unit's FQN from the call's arguments (:func:`of_self`,
    :func:`of_kwarg`); it runs only while profiling ([Note: profiler labels]).
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not _profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            text = name if fqn is None else with_fqn(name, fqn(*args, **kwargs))
            with torch.profiler.record_function(text):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap

"""torch's profiler refused on a local rank, with the mode to use instead, before it starts.

Why: [Note: torch's profiler in local mode] (above :func:`refusing_profilers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.autograd.profiler
import torch.autograd.profiler_legacy
import torch.profiler.profiler

from hp_testing._local_world import on_rank

__all__: list[str] = []

PROCESS_MODE = (
    'mode="process" on the test\'s marker (it wins over HP_TEST_MODE=local), hp-run without --local, '
    "or torchrun / hp-run in place of hp_testing.run_local"
)

# (namespace, name, what the user called): the first step each profiler takes that changes the
# profiler's process state, so a refusal leaves nothing to undo. A class's method is looked up
# on the class; a module's function through the module's globals, where torch's classes call it.
_ENTRIES: tuple[tuple[Any, str, str], ...] = (
    (torch.profiler.profiler.profile, "start", "torch.profiler.profile"),
    (torch.profiler.profiler._KinetoProfile, "start", "torch.profiler.profile"),
    (torch.autograd.profiler, "_prepare_profiler", "torch.autograd.profiler.profile"),
    (
        torch.autograd.profiler,
        "_run_on_profiler_start",
        "torch.autograd.profiler (profile, emit_itt, emit_nvtx)",
    ),
    (torch.autograd.profiler, "_enable_profiler", "torch.autograd.profiler (profile, emit_itt, emit_nvtx)"),
    (torch.autograd.profiler_legacy, "_enable_profiler_legacy", "torch.autograd.profiler_legacy.profile"),
)


def refuse_profiler(shown: str) -> None:
    """Raise :class:`hp_testing.local.ConcurrencyNeededError` for ``shown`` on a local rank."""
    from hp_testing.local import ConcurrencyNeededError  # local.py installs this module's guards

    raise ConcurrencyNeededError(
        f"hp_testing local mode: {shown} cannot run on a local rank. torch's profiler is one per "
        "process, and local mode runs every rank in one process (a second rank's profiler crashes "
        f"it); profile in the multi-process mode instead: {PROCESS_MODE}. torch.profiler."
        "record_function alone is fine in local mode."
    )


def _guarded(original: Callable[..., Any], shown: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if on_rank():
            refuse_profiler(shown)
        return original(*args, **kwargs)

    return guarded


# [Note: torch's profiler in local mode]
# torch's profiler (Kineto, and the legacy one) keeps one session per process.
# Local ranks are threads of one process: a second rank that starts its
# profiler while the first one's runs (each blocks in a collective inside its
# ``with profile():`` block, handing the turn on) makes Kineto fail its
# thread check and the process die of a segmentation fault, taking every rank
# and the pytest session with it. A profile of a local run would not mean much
# either: a rank's wait is another rank's compute. So, while a local world
# runs, each profiler's first step that changes process state refuses on a
# rank's thread (the launching thread profiles as before), naming the mode that
# gives each rank a process. The guards go back when the world ends.
@contextmanager
def refusing_profilers() -> Iterator[None]:
    """While the ``with`` block runs, torch's profilers refuse to start on a local rank's thread."""
    saved = [(namespace, name, vars(namespace)[name]) for namespace, name, _ in _ENTRIES]
    for (namespace, name, original), (_, _, shown) in zip(saved, _ENTRIES, strict=True):
        setattr(namespace, name, _guarded(original, shown))
    try:
        yield
    finally:
        for namespace, name, original in saved:
            setattr(namespace, name, original)

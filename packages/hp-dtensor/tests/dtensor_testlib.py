"""Shared pieces of the hp-dtensor tests: a counter of hp_core's collectives.

Test files put this folder on ``sys.path`` and import it (plain Python, so each
rank process imports it the same way).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import hp_core.collectives as hc

NAMES = ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single", "broadcast")


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count calls to hp_core's collectives (hp_dtensor looks them up on the module at call time)."""
    counts: Counter[str] = Counter()
    saved = {name: getattr(hc, name) for name in NAMES}

    def wrap(name: str):  # type: ignore[no-untyped-def]
        original = saved[name]

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name] += 1
            return original(*args, **kwargs)

        return counted

    for name in NAMES:
        setattr(hc, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(hc, name, fn)

"""Module globals that hold no rank's state: one copy for all the ranks a process simulates.

A library declares such a global (a cache whose values depend on no rank,
group or mesh object) with :func:`share_across_ranks`; a simulator that runs
many ranks in one process and gives each rank its own copy of the module
globals (hp-testing's local mode) keeps declared ones shared, so the ranks
compute each entry once. Under torchrun the declaration changes nothing.
Why, and what a declared global must satisfy: [Note: state shared by a
process's ranks] (above :func:`share_across_ranks`).
"""

from __future__ import annotations

import types

__all__ = ["share_across_ranks", "shared_across_ranks"]


class _Declared:
    """The declarations: an object, not a module-level dict, so that it is itself one per process."""

    def __init__(self) -> None:
        self.names: dict[str, frozenset[str]] = {}


_DECLARED = _Declared()


# [Note: state shared by a process's ranks]
# A process that runs every rank of a world (hp-testing's local mode runs each
# rank as a thread, one at a time) must give each rank its own copy of the
# process state a real rank owns alone: the module globals of the libraries,
# which hold groups, meshes, a rank, remembered layouts on this rank's mesh
# objects. A cache whose every entry is a pure function of its key, and whose
# key names no rank, group or mesh object (an op's output shapes on meta
# tensors keyed by global shapes and dtypes, a plan keyed by placements and
# mesh shape), is the same on every rank; kept per rank, 64 ranks compute
# each entry 64 times. Declaring it shared lets the simulator keep one copy.
#
# A declared global must (1) hold values that no rank could compute
# differently, (2) be mutated in place (``cache[key] = value``,
# ``cache.clear()``), since the simulator switches ranks only where one blocks
# in communication and a rebinding would reach every rank at once, and (3) be
# declared at import, right after it is defined: a simulator reads the
# declarations when a module joins its world and never again.
def share_across_ranks(module: str | types.ModuleType, *names: str) -> None:
    """Declare globals of ``module`` that depend on no rank (see [Note: state shared by a process's ranks]).

    Call it at import, after the globals exist: ``share_across_ranks(__name__, "_cache")``.
    """
    name = module.__name__ if isinstance(module, types.ModuleType) else module
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"share_across_ranks: module must be a module or its dotted name, got {module!r}; "
            "declare from the module itself: share_across_ranks(__name__, '_cache')"
        )
    bad = [n for n in names if not isinstance(n, str) or not n.isidentifier()]
    if bad or not names:
        raise ValueError(
            f"share_across_ranks: names must be one or more global names of {name} (identifiers), got "
            f"{list(names)!r}; e.g. share_across_ranks(__name__, '_meta_cache')"
        )
    _DECLARED.names[name] = _DECLARED.names.get(name, frozenset()) | frozenset(names)


def shared_across_ranks(module: str) -> frozenset[str]:
    """The globals of ``module`` (a dotted name) declared shared by every rank of a process."""
    return _DECLARED.names.get(module, frozenset())

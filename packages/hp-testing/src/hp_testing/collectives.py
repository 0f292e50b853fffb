"""Record the collectives a block of code issues through hp_core: which, on which group, how many bytes.

Tests count communication at hp_core's collectives, the same protocol on every
backend, with a recorder that needs no harness ([Note: collective records]);
``nbytes`` is the payload as the algorithms count it ([Note: payload bytes]).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RECORDED", "CollectiveLog", "CollectiveRecord", "record_collectives"]

#: The hp_core collectives that are recorded, with the argument whose size is the payload.
RECORDED: dict[str, str] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
}


# [Note: payload bytes]
# ``nbytes`` is the payload ``P`` of the collective as the algorithms count it:
# the tensor of an all-reduce or a broadcast, the *output* of an all-gather
# (all ranks' pieces), the *input* of a reduce-scatter and of an all-to-all.
# A ring moves ``(W-1)/W * P`` per rank for the all-gather and the
# reduce-scatter and twice that for the all-reduce, which tests compare with.
@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank issued through hp_core ([Note: collective records])."""

    name: str
    group_ranks: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype
    async_op: bool


class CollectiveLog:
    """The records of one :func:`record_collectives` block, in issue order, with counting helpers."""

    def __init__(self) -> None:
        self._records: list[CollectiveRecord] = []

    def __getitem__(self, index: int) -> CollectiveRecord:
        return self._records[index]

    def __iter__(self) -> Iterator[CollectiveRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"CollectiveLog({self._records!r})"

    def append(self, record: CollectiveRecord) -> None:
        self._records.append(record)

    def clear(self) -> None:
        """Forget what was recorded so far (to count phases of one block apart)."""
        self._records.clear()

    def of(
        self, name: str | None = None, *, group_ranks: Sequence[int] | None = None
    ) -> list[CollectiveRecord]:
        """The records of collective ``name`` (any when ``None``), on the group ``group_ranks`` if given."""
        if name is not None and name not in RECORDED:
            raise ValueError(f"{name!r} is not a recorded collective; pick one of {sorted(RECORDED)}")
        ranks = None if group_ranks is None else tuple(group_ranks)
        return [
            r
            for r in self._records
            if (name is None or r.name == name) and (ranks is None or r.group_ranks == ranks)
        ]

    def count(self, name: str | None = None, *, group_ranks: Sequence[int] | None = None) -> int:
        """How many collectives ``name`` (any when ``None``) were issued, on ``group_ranks`` if given."""
        return len(self.of(name, group_ranks=group_ranks))

    def counts(self) -> Counter[str]:
        """Calls per collective name."""
        return Counter(r.name for r in self._records)

    def nbytes(self, name: str | None = None, *, group_ranks: Sequence[int] | None = None) -> int:
        """The payload bytes of the matching records, summed."""
        return sum(r.nbytes for r in self.of(name, group_ranks=group_ranks))


_ACTIVE: list[CollectiveLog] = []


def _group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of the group an hp_core collective ran on (``None``: the world)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    if not isinstance(group, dist.ProcessGroup) and hasattr(group, "get_group"):
        group = group.get_group()  # a 1-D DeviceMesh, as hp_core accepts
    return tuple(dist.get_process_group_ranks(group))


def _recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    payload = RECORDED[name]

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        tensor = bound.arguments[payload]
        record = CollectiveRecord(
            name=name,
            group_ranks=_group_ranks(bound.arguments.get("group")),
            nbytes=tensor.numel() * tensor.element_size(),
            dtype=tensor.dtype,
            async_op=bool(bound.arguments.get("async_op", False)),
        )
        for log in _ACTIVE:
            log.append(record)
        return result

    recorded.__wrapped__ = original  # type: ignore[attr-defined]
    recorded.__doc__ = original.__doc__
    return recorded


class _Installed:
    """The wrapped functions and how many ranks record through them.

    One object shared by the whole process, while ``_ACTIVE`` is each rank's
    own in local mode (hp_testing.collectives is one of the modules whose
    globals every local rank owns, see :mod:`hp_testing._local_state`): the
    wrappers go in when the first rank starts recording and come out when the
    last one stops, so one rank leaving its block does not cut off another.
    A process of the pool is a single rank, and the count is then 0 or 1.
    """

    def __init__(self) -> None:
        self.ranks = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def acquire(self) -> None:
        import hp_core
        import hp_core.collectives as hc

        self.ranks += 1
        if self.ranks > 1:
            return
        for name in RECORDED:
            original = getattr(hc, name)
            wrapper = _recording(name, original)
            for module in (hc, hp_core):
                if getattr(module, name, None) is original:
                    self.saved.append((module, name, original))
                    setattr(module, name, wrapper)

    def release(self) -> None:
        self.ranks -= 1
        if self.ranks > 0:
            return
        for module, name, original in self.saved:
            setattr(module, name, original)
        self.saved.clear()


_INSTALLED = _Installed()


# [Note: collective records]
# Tests of parallel features check communication by counting: FSDP's N+1
# all-gathers for N wrapped blocks, one reduce-scatter per bucket, the
# all-reduce of a pipeline's tower gradients once per step. They count at
# hp_core's collectives, not at ``torch.distributed``: that is the protocol the
# library chose, the same on every backend, while what reaches torch differs by
# backend (gloo has no fused reduce-scatter, so hp_core all-reduces there).
#
# :func:`record_collectives` swaps each tensor collective of ``hp_core`` (the
# names in :data:`RECORDED`) for a wrapper while the block runs, on the module
# ``hp_core.collectives`` and on the ``hp_core`` package itself, since callers
# reach them both ways (``hc.all_reduce(...)`` and ``from hp_core import
# all_reduce`` inside a function). Every call that returns normally appends a
# :class:`CollectiveRecord` to the log of this process; a call that raises
# (bad input) is not recorded, since nothing was issued. Recorders nest: an
# inner block's calls appear in the outer log too. Nothing here needs the
# hp-testing harness, so the recorder works under plain ``torchrun``.
@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveLog]:
    """Record, on this rank, every hp_core collective issued inside the block.

    ``with record_collectives() as log: ...`` then ``log.count("all_gather_into_tensor")``,
    ``log.nbytes("reduce_scatter_tensor")``, ``log.of("all_reduce", group_ranks=[0, 1])``
    or the records themselves ([Note: collective records]). The outermost block
    installs the wrappers and removes them on exit, exceptions included.
    """
    log = CollectiveLog()
    if not _ACTIVE:
        _INSTALLED.acquire()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)
        if not _ACTIVE:
            _INSTALLED.release()

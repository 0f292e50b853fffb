"""Placements: how one mesh dim holds a tensor.

A DTensor carries one placement per mesh dim. Each says what the ranks along
that mesh dim hold of the global tensor:

* ``Shard(dim)``: consecutive pieces along tensor dim ``dim``, cut like
  ``torch.chunk`` (the last ranks may hold fewer rows, or none);
* ``Replicate()``: every rank holds the same values;
* ``Partial(reduce_op)``: every rank holds a term, and the global value is the
  reduction (``sum``, ``avg``, ``max`` or ``min``) of the terms;
* ``Partial("norm", p)``: every rank holds the p-norm of its piece, and the
  global value is the p-norm of those terms (see [Note: norm partials]).

[Note: norm partials]
A p-norm over a sharded dim is the p-norm of the per-rank p-norms:
``(sum_r n_r**p)**(1/p)`` for a finite ``p``, ``max_r n_r`` for ``inf``,
``min_r n_r`` for ``-inf``. So a norm computes locally and stays partial, and
reducing it is one all-reduce (of ``n_r**p`` by sum, then the root; or of
``n_r`` by max / min): for a gradient norm that is one scalar per mesh dim
instead of every gradient gathered. The terms are norms, never negative, so
a norm of such a value with the same ``p`` stays partial too (the total norm
of ``clip_grad_norm_`` is the norm of the stacked per-gradient norms). It is
not linear: every other op reduces it first. The 0-"norm" (a count of
non-zeros) is a plain ``Partial("sum")``.

Placements are frozen dataclasses: equal by value and hashable, so layouts
built from them can key caches of sharding decisions and redistribution plans.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["PARTIAL_OPS", "Partial", "Placement", "Replicate", "Shard"]

PARTIAL_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "norm")


class Placement:
    """Base class of the three placements; use the ``is_*`` helpers instead of isinstance chains."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """Whether this is a ``Shard`` (on ``dim`` when given)."""
        return False

    def is_replicate(self) -> bool:
        """Whether this is ``Replicate()``."""
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """Whether this is a ``Partial`` (with ``reduce_op`` when given)."""
        return False

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """Code that rebuilds this placement, for graphs that hold it as a constant (torch.compile)."""
        return f"hp_dtensor.placements.{self!r}", {"hp_dtensor": importlib.import_module("hp_dtensor")}


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Pieces of tensor dim ``dim``, one per rank along the mesh dim, cut like ``torch.chunk``.

    ``dim`` may be negative when given by users; layouts normalise it against
    the tensor's rank, so ``Shard(-1)`` on a 2-D tensor compares equal to
    ``Shard(1)`` once it is part of a DTensor.
    """

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(
                f"Shard(dim): dim must be an int (a tensor dim, negative counts from the end), got "
                f"{type(self.dim).__name__} {self.dim!r}; e.g. Shard(0) or Shard(-1)."
            )

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """The same full values on every rank along the mesh dim."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a term; the global value is their ``reduce_op`` (sum, avg, max, min, norm).

    Produced by ops such as ``S(1) @ S(0)`` (a sum of partial products) and
    resolved lazily: the reduction happens only when a later op or a
    redistribute needs the value, which lets a reduce-scatter replace an
    all-reduce when the consumer wants shards. ``Partial("norm", p)`` holds
    per-rank p-norms (``norm_type`` is ``p``, 2 by default; see [Note: norm
    partials]).
    """

    reduce_op: str = "sum"
    norm_type: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reduce_op, str):
            raise TypeError(
                f"Partial(reduce_op={self.reduce_op!r}): reduce_op is a string, one of {list(PARTIAL_OPS)}, "
                f"not a {type(self.reduce_op).__name__}; e.g. Partial('sum')."
            )
        if self.reduce_op not in PARTIAL_OPS:
            raise ValueError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; use one of {list(PARTIAL_OPS)}."
            )
        if self.reduce_op != "norm":
            if self.norm_type is not None:
                raise ValueError(
                    f"Partial({self.reduce_op!r}, norm_type={self.norm_type!r}): only a 'norm' partial has "
                    f"a norm_type; use Partial('norm', {self.norm_type!r}) or Partial({self.reduce_op!r})."
                )
            return
        p = 2.0 if self.norm_type is None else self.norm_type
        if isinstance(p, bool) or not isinstance(p, (int, float)) or p != p or p == 0:
            raise ValueError(
                f"Partial('norm', norm_type={p!r}): norm_type is the p of a p-norm, a non-zero number "
                "(inf and -inf included); a 0-norm counts non-zeros and is a Partial('sum')."
            )
        object.__setattr__(self, "norm_type", float(p))

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def __repr__(self) -> str:
        if self.reduce_op == "norm":
            return f"Partial('norm', {_float_repr(self.norm_type)})"
        return f"Partial({self.reduce_op!r})"

    def __str__(self) -> str:
        if self.reduce_op == "norm":
            return f"P(norm{self.norm_type:g})"
        return f"P({self.reduce_op})"


def _float_repr(value: float | None) -> str:
    """``repr`` that evaluates back (``float('inf')``, not ``inf``), for ``__fx_repr__``."""
    if value is not None and value in (float("inf"), float("-inf")):
        return f"float({str(value)!r})"
    return repr(value)

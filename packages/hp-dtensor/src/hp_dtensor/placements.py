"""Placements: what the ranks along one mesh dim hold of a DTensor's global tensor.

* ``Shard(dim)``: consecutive pieces along tensor dim ``dim``, cut like
  ``torch.chunk`` (the last ranks may hold fewer rows, or none);
* ``Replicate()``: every rank holds the same values;
* ``Partial(reduce_op)``: every rank holds a term, and the global value is the
  reduction (``sum``, ``avg``, ``max``, ``min`` or ``product``) of the terms;
* ``Partial("norm", p)``: every rank holds the p-norm of its piece, and the
  global value is the p-norm of those terms (see [Note: norm partials]);
* ``StridedShard(dim, split_factor)``: tensor dim ``dim`` is cut into
  ``split_factor`` blocks and every rank holds its ``torch.chunk`` piece of
  each block (what a view merging a cut inner dim leaves; see [Note: strided
  shards]). Placements are frozen dataclasses (equal by value, hashable: they key
  caches); torch's compare equal ([Note: torch placements]).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch.distributed.tensor._ops._math_ops import _NormPartial as _TorchNormPartial
from torch.distributed.tensor.placement_types import Partial as _TorchPartial
from torch.distributed.tensor.placement_types import Placement as _TorchPlacement
from torch.distributed.tensor.placement_types import Replicate as _TorchReplicate
from torch.distributed.tensor.placement_types import Shard as _TorchShard
from torch.distributed.tensor.placement_types import _StridedShard as _TorchStridedShard

if TYPE_CHECKING:
    import torch

__all__ = [
    "PARTIAL_OPS",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "as_placement",
    "is_torch_placement",
    "torch_equivalent",
]

PARTIAL_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product", "norm")


class StepRunner(Protocol):
    """The work one redistribution step may do along one mesh dim; :mod:`hp_dtensor.redistribute` runs it.

    A placement's :meth:`Placement.run_step` says *which* of these a change
    to another placement is; the runner knows the mesh dim, the layout and
    whether the collective is left in flight.
    """

    def all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor: ...
    def all_to_all(self, local: torch.Tensor, src_dim: int, dst_dim: int) -> torch.Tensor: ...
    def chunk(self, local: torch.Tensor, dim: int) -> torch.Tensor: ...
    def to_partial(self, local: torch.Tensor, target: Partial) -> torch.Tensor: ...
    def reduce(self, local: torch.Tensor, source: Partial, shard_dim: int | None) -> torch.Tensor: ...
    def strided_gather(self, local: torch.Tensor, dim: int, split_factor: int) -> torch.Tensor: ...
    def strided_chunk(self, local: torch.Tensor, dim: int, split_factor: int) -> torch.Tensor: ...
    def strided_to_shard(
        self, local: torch.Tensor, src_dim: int, split_factor: int, dst_dim: int
    ) -> torch.Tensor: ...


class Placement:
    """Base class of the three placements; use the ``is_*`` helpers instead of isinstance chains."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """Whether this cuts a tensor dim (``dim`` when given): a ``Shard`` or a ``StridedShard``."""
        return False

    def is_replicate(self) -> bool:
        """Whether this is ``Replicate()``."""
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """Whether this is a ``Partial`` (with ``reduce_op`` when given)."""
        return False

    # [Note: placement transforms]
    # Each placement says what changing it to another placement along one mesh
    # dim costs and does, as torch's placements carry their own transforms:
    # :meth:`step_to` names the collective (the planner's edge, or None when
    # there is no direct step and the plan goes through ``Replicate``), and
    # :meth:`run_step` does it through a :class:`StepRunner`. ``free(d)`` says
    # whether no higher mesh dim also cuts tensor dim ``d`` ([Note: nested shard
    # order] in :mod:`hp_dtensor.planner`): only then is a cut of ``d`` along
    # this mesh dim one contiguous piece per rank.
    def step_to(self, target: Placement, free: Callable[[int], bool]) -> str | None:
        """The collective that changes this placement into ``target`` directly, or None if none does."""
        return None

    def run_step(self, target: Placement, local: torch.Tensor, runner: StepRunner) -> torch.Tensor:
        """This rank's piece after the step :meth:`step_to` named (the planner only plans those)."""
        raise AssertionError(f"no direct step {self} -> {target}")

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """Code that rebuilds this placement, for graphs that hold it as a constant (torch.compile)."""
        return f"hp_dtensor.placements.{self!r}", {"hp_dtensor": importlib.import_module("hp_dtensor")}


def _step_from_cut(dim: int, target: Placement, free: Callable[[int], bool]) -> str | None:
    """The step from a cut of ``dim``: gathered to R, or re-cut to a ``Shard`` of a free dim; else None."""
    if not free(dim):
        return None
    if isinstance(target, Replicate):
        return "all_gather"
    if isinstance(target, Shard) and free(target.dim):
        return "all_to_all"
    return None


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

    def step_to(self, target: Placement, free: Callable[[int], bool]) -> str | None:
        return _step_from_cut(self.dim, target, free)  # S -> P goes through R

    def run_step(self, target: Placement, local: torch.Tensor, runner: StepRunner) -> torch.Tensor:
        if isinstance(target, Replicate):
            return runner.all_gather(local, self.dim)
        if isinstance(target, Shard):
            return runner.all_to_all(local, self.dim, target.dim)
        return Placement.run_step(self, target, local, runner)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return self.dim == other.dim  # type: ignore[attr-defined]
        return _equal_to_torch(self, other)

    def __hash__(self) -> int:
        return hash(self.dim)  # torch's Shard's hash ([Note: torch placements])

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """The same full values on every rank along the mesh dim."""

    def is_replicate(self) -> bool:
        return True

    def step_to(self, target: Placement, free: Callable[[int], bool]) -> str | None:
        if isinstance(target, (Shard, StridedShard)):
            return "local_chunk" if free(target.dim) else None
        return "local" if isinstance(target, Partial) else None

    def run_step(self, target: Placement, local: torch.Tensor, runner: StepRunner) -> torch.Tensor:
        if isinstance(target, Shard):
            return runner.chunk(local, target.dim)
        if isinstance(target, StridedShard):
            return runner.strided_chunk(local, target.dim, target.split_factor)
        if isinstance(target, Partial):
            return runner.to_partial(local, target)
        return Placement.run_step(self, target, local, runner)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return True
        return _equal_to_torch(self, other)

    def __hash__(self) -> int:
        return -1  # torch's Replicate's hash ([Note: torch placements])

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


# [Note: strided shards]
# A view that merges dims (``(b, s, h, d) -> (b, s, h * d)``, ``flatten``)
# with a cut dim that is not the outermost of the merged group leaves every
# rank a piece of each outer index: with ``h`` cut in two, rank 0 holds rows
# ``[0, d * h / 2)`` of every one of the ``b * s`` blocks of the merged dim.
# No ``Shard`` describes that, so the view used to gather. ``StridedShard(dim,
# split_factor)`` does: tensor dim ``dim`` is cut into ``split_factor`` blocks
# (``torch.chunk``), and each rank holds its ``torch.chunk`` piece of every
# block, in block order. It is torch's ``_StridedShard`` (same meaning, same
# uneven rule), so interop maps one to the other. ``split_factor=1`` is plain
# ``Shard(dim)``; the constructor refuses it so that one cut has one spelling.
# The view that splits the dim again gives back ``Shard`` with no
# communication; redistribution gathers it (all-gather plus a local reorder of
# the rows), cuts it from a replicated value locally, and moves it to a
# ``Shard`` of another dim in one all-to-all plus the reorder.
@dataclass(frozen=True, slots=True)
class StridedShard(Placement):
    """``split_factor`` blocks of tensor dim ``dim``, each cut like ``torch.chunk``: a piece of each per rank.

    Rank ``r`` of a mesh dim of size ``n`` holds, for every block ``j`` of
    ``torch.chunk(t, split_factor, dim)``, the piece ``torch.chunk(block_j, n,
    dim)[r]``, concatenated in block order. ``is_shard()`` answers True (the
    dim is cut, as torch's ``_StridedShard`` answers), but it is not a
    ``Shard``: ``isinstance(p, Shard)`` is False, so code written for
    contiguous pieces never mistakes it for one. See [Note: strided shards].
    """

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        for name in ("dim", "split_factor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"StridedShard({name}={value!r}): {name} must be an int, got {type(value).__name__}; "
                    "e.g. StridedShard(0, split_factor=4)."
                )
        if self.split_factor < 2:
            raise ValueError(
                f"StridedShard(dim={self.dim}, split_factor={self.split_factor}): split_factor must be at "
                f"least 2 (split_factor=1 is Shard({self.dim}); use that)."
            )

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def step_to(self, target: Placement, free: Callable[[int], bool]) -> str | None:
        if isinstance(target, Shard) and target.dim == self.dim:
            return None  # the same dim cut another way: through R
        return _step_from_cut(self.dim, target, free)

    def run_step(self, target: Placement, local: torch.Tensor, runner: StepRunner) -> torch.Tensor:
        if isinstance(target, Replicate):
            return runner.strided_gather(local, self.dim, self.split_factor)
        if isinstance(target, Shard):
            return runner.strided_to_shard(local, self.dim, self.split_factor, target.dim)
        return Placement.run_step(self, target, local, runner)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return self.dim == other.dim and self.split_factor == other.split_factor  # type: ignore[attr-defined]
        return _equal_to_torch(self, other)

    def __hash__(self) -> int:
        return hash((self.dim, self.split_factor))  # torch's _StridedShard's hash ([Note: torch placements])

    def __repr__(self) -> str:
        return f"StridedShard(dim={self.dim}, split_factor={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


# [Note: norm partials]
# A p-norm over a sharded dim is the p-norm of the per-rank p-norms:
# ``(sum_r n_r**p)**(1/p)`` for a finite ``p``, ``max_r n_r`` for ``inf``,
# ``min_r n_r`` for ``-inf``. So a norm computes locally and stays partial, and
# reducing it is one all-reduce (of ``n_r**p`` by sum, then the root; or of
# ``n_r`` by max / min): for a gradient norm that is one scalar per mesh dim
# instead of every gradient gathered. The terms are norms, never negative, so
# a norm of such a value with the same ``p`` stays partial too (the total norm
# of ``clip_grad_norm_`` is the norm of the stacked per-gradient norms). It is
# not linear: every other op reduces it first. The 0-"norm" (a count of
# non-zeros) is a plain ``Partial("sum")``.
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

    def step_to(self, target: Placement, free: Callable[[int], bool]) -> str | None:
        if isinstance(target, Replicate):
            return "all_reduce"
        if isinstance(target, Shard) and free(target.dim):
            return "reduce_scatter"
        return None  # P -> P of another op goes through R

    def run_step(self, target: Placement, local: torch.Tensor, runner: StepRunner) -> torch.Tensor:
        if isinstance(target, Replicate):
            return runner.reduce(local, self, None)
        if isinstance(target, Shard):
            return runner.reduce(local, self, target.dim)
        return Placement.run_step(self, target, local, runner)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return self.reduce_op == other.reduce_op and self.norm_type == other.norm_type  # type: ignore[attr-defined]
        return _equal_to_torch(self, other)

    def __hash__(self) -> int:
        if self.reduce_op == "norm":
            return hash((self.reduce_op, self.norm_type))
        return 1 + hash(self.reduce_op)  # torch's Partial's hash ([Note: torch placements])

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


# -- torch's placements (see [Note: torch placements]) -------------------------------


def torch_equivalent(value: Any) -> Placement | None:
    """Our placement for one of torch's placements we have; None for anything else.

    Exact types only: torch's ``_MaskPartial`` describes other data and has
    no equivalent here; ``_NormPartial`` is our ``Partial("norm", p)`` and
    ``_StridedShard`` our ``StridedShard`` (``Shard`` when its split factor is 1).
    """
    kind = type(value)
    if kind is _TorchShard:
        return Shard(value.dim)
    if kind is _TorchStridedShard:
        factor = int(value.split_factor)
        return Shard(value.dim) if factor == 1 else StridedShard(value.dim, factor)
    if kind is _TorchReplicate:
        return Replicate()
    if kind is _TorchPartial and value.reduce_op in PARTIAL_OPS and value.reduce_op != "norm":
        return Partial(value.reduce_op)
    if kind is _TorchNormPartial:  # its reduce_op says "sum" but it reduces |x|^p: our norm partial
        return Partial("norm", float(value.norm_type))
    return None


def is_torch_placement(value: Any) -> bool:
    """Whether ``value`` is one of torch's placements (any kind, supported or not)."""
    return isinstance(value, _TorchPlacement)


# [Note: torch placements]
# torch's ``Shard(d)``, ``Replicate()`` and ``Partial(op)`` (op sum, avg, max or
# min) mean what ours do, so every entry that takes placements accepts them:
# :func:`as_placement` converts them where placements are checked
# (``layout.normalize_placements``, the TP styles' layouts), and nothing past
# that point sees a torch placement. Ours also compare equal to those: code
# written for torch tests ``placement == Shard(0)`` with torch's class against
# our DTensor's ``.placements``. torch's placements are C++-backed and their
# ``__eq__`` answers NotImplemented for a type it does not know, so Python asks
# ours in both orders (``torch == ours`` and ``ours == torch``). Equal values
# must share a hash, so ours hash as torch's do (``hash(dim)``, ``-1`` and
# ``1 + hash(op)``, ``hash((dim, split_factor))``): a set or dict mixing both
# stays consistent. torch's ``_StridedShard`` is our ``StridedShard`` (equal,
# and accepted; one with split factor 1 is accepted as ``Shard`` but, as in
# torch, equal to no ``Shard``). Its subclasses that mean something else
# (``_NormPartial``, ``_MaskPartial``) are neither equal to ours nor accepted.
def as_placement(value: Any, what: str) -> Placement:
    """``value`` as our placement: ours as they are, torch's equivalents converted; else a TypeError.

    ``what`` names the argument in the error (e.g. ``"distribute_tensor: placements[0]"``).
    """
    if isinstance(value, Placement):
        return value
    converted = torch_equivalent(value)
    if converted is not None:
        return converted
    kind = type(value)
    if is_torch_placement(value):
        raise TypeError(
            f"{what}={value!r} is torch's {kind.__module__}.{kind.__qualname__}, which has no hp_dtensor "
            "equivalent; hp_dtensor takes Shard(d), Replicate() and "
            "Partial('sum' | 'avg' | 'max' | 'min' | 'product'), torch's or its own (and StridedShard, "
            "torch's _StridedShard). "
            "Redistribute to one of those first."
        )
    raise TypeError(
        f"{what}={value!r} ({kind.__module__}.{kind.__qualname__}) is not a placement; use "
        "hp_dtensor.Shard(d), Replicate() or Partial(op) (or torch's Shard, Replicate, Partial)."
    )


def _equal_to_torch(ours: Placement, other: object) -> bool:
    """``ours == other`` for an ``other`` of another class: True only for torch's equivalent."""
    if isinstance(other, Placement) or type(other) is _TorchNormPartial:
        return False  # torch's _NormPartial compares unequal to ours: keep == symmetric
    if type(other) is _TorchStridedShard and not isinstance(ours, StridedShard):
        return False  # torch's _StridedShard(d, 1) is not equal to its Shard(d): keep hashes consistent
    converted = torch_equivalent(other)
    if converted is None:
        return NotImplemented
    return converted == ours

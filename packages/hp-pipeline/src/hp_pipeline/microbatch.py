"""Split a batch into micro-batches and merge the last stage's outputs back.

A schedule's ``step(*args, **kwargs)`` receives the whole batch. Each
positional and keyword argument is split according to its chunk spec:

* :class:`TensorChunkSpec` (``dim``): a tensor cut into ``m`` pieces along
  ``dim`` with ``torch.tensor_split``, so a batch of 10 over 4 micro-batches
  gives pieces of 3, 3, 2, 2 rather than an error;
* :data:`REPLICATE`: the same value handed to every micro-batch (a flag, a
  shared mask, a Python number).

Without a spec, tensors are split along dim 0 and everything else is
replicated ([Note: default chunk specs]); [Note: nested batches], [Note:
merge specs].
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "REPLICATE",
    "ChunkSpec",
    "TensorChunkSpec",
    "as_chunk_spec",
    "merge_chunks",
    "split_args_kwargs",
    "split_target",
]


# [Note: default chunk specs]
# Without a spec, tensors are split along dim 0 and everything else is
# replicated, which is what a batch-first model wants; a tuple, list or dict
# is looked into, so each tensor inside it is split along dim 0 too
# ([Note: nested batches]). Specs are given as a sequence parallel to ``args``
# and a mapping parallel to ``kwargs``, like torch.distributed.pipelining's
# ``args_chunk_spec`` / ``kwargs_chunk_spec``; torch's own ``TensorChunkSpec``
# objects are accepted wherever ours are (:func:`as_chunk_spec`).


@dataclass(frozen=True)
class TensorChunkSpec:
    """Split a tensor argument into micro-batches along ``split_dim``."""

    split_dim: int = 0


class _Replicate:
    """Marker: give the whole value to every micro-batch."""

    _instance: _Replicate | None = None

    def __new__(cls) -> _Replicate:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REPLICATE"


REPLICATE = _Replicate()
"""Chunk spec that hands the same value to every micro-batch."""

ChunkSpec = TensorChunkSpec | _Replicate

_TORCH_MICROBATCH = "torch.distributed.pipelining.microbatch"


def _torch_microbatch() -> Any:
    """torch's microbatch module if it is loaded, else ``None``.

    A torch spec object can only exist once its module has been imported, so
    looking in ``sys.modules`` recognises one without importing
    torch.distributed.pipelining (and what it pulls in) for everyone else.
    """
    return sys.modules.get(_TORCH_MICROBATCH)


def as_chunk_spec(spec: object) -> object:
    """``spec`` in our terms: torch's ``TensorChunkSpec`` becomes ours with the same ``split_dim``.

    torch's replicate marker (its ``_Replicate`` class, which torch's own code
    accepts as the class or an instance) becomes :data:`REPLICATE`. Anything
    else is returned unchanged, for the caller to accept or refuse.
    """
    torch_mb = _torch_microbatch()
    if torch_mb is not None:
        if isinstance(spec, torch_mb.TensorChunkSpec):
            return TensorChunkSpec(spec.split_dim)
        if spec is torch_mb._Replicate or isinstance(spec, torch_mb._Replicate):
            return REPLICATE
    return spec


def _is_torch_reducer(spec: object) -> bool:
    """One of torch's merge reducers (``sum_reducer``): an ``init_value`` folded with ``reduce_fn``."""
    torch_mb = _torch_microbatch()
    return torch_mb is not None and isinstance(spec, torch_mb._CustomReducer)


def _default_spec(value: object) -> ChunkSpec | None:
    if isinstance(value, torch.Tensor):
        return TensorChunkSpec(0)
    return None if isinstance(value, (tuple, list, dict)) else REPLICATE


def _cut(name: str, value: torch.Tensor, dim: int, m: int) -> list[Any]:
    if not -value.ndim <= dim < value.ndim:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)} but its chunk spec splits dim {dim}; "
            f"use a dim in {-value.ndim} .. {value.ndim - 1}"
        )
    size = value.shape[dim]
    if size < m:
        raise ValueError(
            f"{name} has size {size} along dim {dim} but the schedule needs n_microbatches={m} "
            f"pieces; pass a batch of at least {m} along dim {dim} or use fewer micro-batches"
        )
    return list(torch.tensor_split(value, m, dim=dim))


def _rebuild(like: Any, items: list[Any]) -> Any:
    """A container of ``like``'s type holding ``items`` (a named tuple takes them as fields)."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)


# [Note: nested batches]
# A batch often travels as a structure: ``step(target=(labels, weights))``, a
# dict of inputs, a list of masks. Handing such a value whole to every
# micro-batch would pair micro-batch ``k``'s outputs with the *whole* batch's
# labels: the loss would be silently wrong, not an error. So every tensor found
# inside a tuple (named tuples included), list or dict is cut along dim 0 like a
# bare tensor, and the structure is rebuilt around the pieces; other leaves
# (numbers, strings, ``None``) go whole to every micro-batch. This is what
# torch does for ``args`` / ``kwargs`` through its pytree (its ``target`` must
# be one tensor); the target of a schedule follows the same rule here. A 0-d
# tensor has no dim 0 to cut and is refused, naming the channel for
# whole-batch values. A structure without a tensor is handed on as the same
# object.


def _split_nested(name: str, value: object, m: int, whole: str) -> list[Any] | None:
    """``value``'s pieces per [Note: nested batches], or ``None`` when it holds no tensor.

    ``whole`` is the way to hand a 0-d tensor to every micro-batch, for the error.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise ValueError(
                f"{name} is a 0-d tensor ({value!r}), which has no dim 0 to split into micro-batches; {whole}"
            )
        return _cut(name, value, 0, m)
    if isinstance(value, (tuple, list)):
        parts = [_split_nested(f"{name}[{i}]", v, m, whole) for i, v in enumerate(value)]
        if all(p is None for p in parts):
            return None
        return [
            _rebuild(value, [v if p is None else p[k] for v, p in zip(value, parts, strict=True)])
            for k in range(m)
        ]
    if type(value) in (dict, OrderedDict):
        assert isinstance(value, dict)
        pieces = {key: _split_nested(f"{name}[{key!r}]", v, m, whole) for key, v in value.items()}
        if all(p is None for p in pieces.values()):
            return None
        return [
            type(value)((key, value[key] if p is None else p[k]) for key, p in pieces.items())
            for k in range(m)
        ]
    return None


def _split_one(name: str, value: object, spec: object, m: int) -> list[Any]:
    spec = _default_spec(value) if spec is None else as_chunk_spec(spec)
    if spec is None:  # a container: [Note: nested batches]
        pieces = _split_nested(name, value, m, "give the argument the spec REPLICATE to pass it whole")
        return [value] * m if pieces is None else pieces
    if isinstance(spec, _Replicate):
        return [value] * m
    if not isinstance(spec, TensorChunkSpec):
        raise TypeError(f"the chunk spec of {name} is {spec!r}; use TensorChunkSpec(dim) or REPLICATE")
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} has chunk spec {spec} but is a {type(value).__name__}, not a tensor; "
            "give it the spec REPLICATE to pass it whole to every micro-batch"
        )
    return _cut(name, value, spec.split_dim, m)


def split_args_kwargs(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    n_microbatches: int,
    args_chunk_spec: Sequence[ChunkSpec | None] | None = None,
    kwargs_chunk_spec: Mapping[str, ChunkSpec | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Cut ``args`` and ``kwargs`` into ``n_microbatches`` argument tuples and dicts."""
    m = n_microbatches
    if args_chunk_spec is not None and len(args_chunk_spec) != len(args):
        raise ValueError(
            f"args_chunk_spec has {len(args_chunk_spec)} entries but step() got {len(args)} "
            "positional arguments; give one spec (or None for the default) per argument"
        )
    unknown = sorted(set(kwargs_chunk_spec or {}) - set(kwargs))
    if unknown:
        raise ValueError(
            f"kwargs_chunk_spec names {unknown}, which step() did not receive "
            f"(it got {sorted(kwargs)}); drop them or pass those keyword arguments"
        )
    arg_pieces = [
        _split_one(
            f"positional argument {i}", value, None if args_chunk_spec is None else args_chunk_spec[i], m
        )
        for i, value in enumerate(args)
    ]
    kwarg_pieces = {
        key: _split_one(f"keyword argument {key!r}", value, (kwargs_chunk_spec or {}).get(key), m)
        for key, value in kwargs.items()
    }
    arg_mbs = [tuple(pieces[i] for pieces in arg_pieces) for i in range(m)]
    kwarg_mbs = [{key: pieces[i] for key, pieces in kwarg_pieces.items()} for i in range(m)]
    return arg_mbs, kwarg_mbs


def split_target(target: Any, n_microbatches: int) -> list[Any]:
    """The target of each micro-batch: every tensor in ``target`` cut along dim 0 ([Note: nested batches]).

    A bare tensor, or a tuple / list / dict of them (``(labels, weights)``,
    ``{"labels": y, "mask": w}``); other leaves go whole to every micro-batch.
    """
    pieces = _split_nested(
        "target",
        target,
        n_microbatches,
        "pass a whole-batch value to the loss through step(loss_kwargs={...}), which every "
        "micro-batch's loss_fn receives whole",
    )
    return [target] * n_microbatches if pieces is None else pieces


def _merge_tensors(where: str, values: Sequence[Any], dim: int) -> torch.Tensor:
    bad = [k for k, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"output_merge_spec concatenates {where} along dim {dim}, but micro-batch {bad[0]} gave a "
            f"{type(values[bad[0]]).__name__} there, not a tensor; give that leaf of the spec REPLICATE "
            "instead"
        )
    if values[0].ndim == 0:
        return torch.stack(list(values))
    return torch.cat(list(values), dim=dim)


def _merge_replicated(where: str, values: Sequence[Any]) -> Any:
    first = values[0]
    for k, v in enumerate(values[1:], start=1):
        same = (
            isinstance(v, torch.Tensor) and torch.equal(first, v)
            if isinstance(first, torch.Tensor)
            else not isinstance(v, torch.Tensor) and v == first
        )
        if not same:
            raise ValueError(
                f"{where} has the merge spec REPLICATE but micro-batch {k} gave a value that differs from "
                "micro-batch 0's; give that leaf TensorChunkSpec(dim) to concatenate the pieces instead"
            )
    return first


# [Note: merge specs]
# ``output_merge_spec`` says how the last stage's per-micro-batch outputs become
# one value. An int (ours) concatenates every tensor of the output along that
# dim; ``None`` (torch's default) is dim 0. torch's form is a tuple, list or
# dict of leaf specs, one per tensor of the output: ``TensorChunkSpec(dim)``
# (concatenate along ``dim``), ``REPLICATE`` (every micro-batch gave the same
# value: keep one, or fail if they differ) or one of torch's reducers such as
# ``sum_reducer`` (fold the values with it). As in torch, the spec's leaves are
# matched with the output's leaves in order (both flattened), a count that
# differs is an error, and the merged value takes the spec's structure: a
# one-tensor output merged with ``(TensorChunkSpec(0),)`` comes back as a
# 1-tuple, as torch returns it. A ``None`` leaf means what it means in torch
# (whose merge treats any leaf that is neither a chunk spec nor a reducer so):
# every micro-batch gave the same value, kept once, as ``REPLICATE``. We also
# take an int leaf, for "along this dim". A 0-d tensor (a per-micro-batch
# scalar) is stacked into a vector, since it has no dim to concatenate along.


def _merge_leaf(where: str, values: Sequence[Any], spec: object) -> Any:
    """One leaf of the output, merged by its leaf of the spec ([Note: merge specs])."""
    spec = as_chunk_spec(spec)
    if spec is None or isinstance(spec, _Replicate):
        return _merge_replicated(where, values)
    if _is_torch_reducer(spec):
        acc = spec.init_value  # type: ignore[attr-defined]
        for v in values:
            acc = spec.reduce_fn(acc, v)  # type: ignore[attr-defined]
        return acc
    if isinstance(spec, TensorChunkSpec):
        return _merge_tensors(where, values, spec.split_dim)
    if isinstance(spec, int) and not isinstance(spec, bool):
        return _merge_default(values, spec)
    raise TypeError(
        f"output_merge_spec's leaf for {where} is {spec!r} ({type(spec).__name__}); each leaf must be "
        "TensorChunkSpec(dim), an int dim, or REPLICATE / None (the same value from every micro-batch)"
    )


def _leaves(value: object) -> list[Any]:
    """``value``'s leaves, depth first: tuples, lists and dicts are looked into, anything else is a leaf."""
    if isinstance(value, (tuple, list)):
        return [leaf for part in value for leaf in _leaves(part)]
    if isinstance(value, dict):
        return [leaf for part in value.values() for leaf in _leaves(part)]
    return [value]


def _rebuild_like(structure: object, leaves: Iterator[Any]) -> Any:
    """``structure`` with each of its leaves replaced by the next of ``leaves``."""
    if isinstance(structure, (tuple, list)):
        return _rebuild(structure, [_rebuild_like(part, leaves) for part in structure])
    if isinstance(structure, dict):
        mapping_type: Any = type(structure)
        return mapping_type((key, _rebuild_like(part, leaves)) for key, part in structure.items())
    return next(leaves)


def _merge_by_spec(chunks: Sequence[Any], spec: object) -> Any:
    """torch's form of the merge ([Note: merge specs]): leaf by leaf, in the spec's structure."""
    specs = _leaves(spec)
    per_micro = [_leaves(chunk) for chunk in chunks]
    for k, leaves in enumerate(per_micro):
        if len(leaves) != len(specs):
            raise ValueError(
                f"output_merge_spec={spec!r} has {len(specs)} leaves but micro-batch {k}'s output from "
                f"the last stage has {len(leaves)} ({_shape_of(chunks[k])}); give one spec per tensor "
                "of the output, in its order, e.g. (TensorChunkSpec(0), TensorChunkSpec(1)) for a pair"
            )
    merged = [
        _merge_leaf(f"output leaf {i}", [leaves[i] for leaves in per_micro], leaf_spec)
        for i, leaf_spec in enumerate(specs)
    ]
    return _rebuild_like(spec, iter(merged))


def _shape_of(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with the keys {sorted(map(repr, value))}"
    return f"a {type(value).__name__}"


def _merge_default(chunks: Sequence[Any], merge_dim: int) -> Any:
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        if first.ndim == 0:
            return torch.stack(list(chunks))
        return torch.cat(list(chunks), dim=merge_dim)
    if isinstance(first, (tuple, list)):
        merged = [_merge_default([c[i] for c in chunks], merge_dim) for i in range(len(first))]
        return type(first)(merged)
    return list(chunks)


def merge_chunks(chunks: Sequence[Any], chunk_spec: object = 0) -> Any:
    """Merge per-micro-batch outputs into one value by ``chunk_spec`` ([Note: merge specs]).

    ``chunk_spec`` is an int dim (every tensor concatenated along it; ``None``
    is dim 0) or torch's form, a structure with a ``TensorChunkSpec`` /
    ``REPLICATE`` / reducer per tensor of the output. With an int, non-tensor
    leaves are returned as a list, one per micro-batch, since there is no
    general way to merge them.
    """
    if not chunks:
        raise ValueError("merge_chunks needs at least one micro-batch output")
    if chunk_spec is None or (isinstance(chunk_spec, int) and not isinstance(chunk_spec, bool)):
        return _merge_default(chunks, 0 if chunk_spec is None else chunk_spec)
    return _merge_by_spec(chunks, chunk_spec)

"""Split a batch into micro-batches and merge the last stage's outputs back.

A schedule's ``step(*args, **kwargs)`` receives the whole batch. Each
positional and keyword argument is split according to its chunk spec:

* :class:`TensorChunkSpec` (``dim``): a tensor cut into ``m`` pieces along
  ``dim`` with ``torch.tensor_split``, so a batch of 10 over 4 micro-batches
  gives pieces of 3, 3, 2, 2 rather than an error;
* :data:`REPLICATE`: the same value handed to every micro-batch (a flag, a
  shared mask, a Python number).

Without a spec, tensors are split along dim 0 and everything else is
replicated, which is what a batch-first model wants. Specs are given as a
sequence parallel to ``args`` and a mapping parallel to ``kwargs``, like
torch.distributed.pipelining's ``args_chunk_spec`` / ``kwargs_chunk_spec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REPLICATE", "ChunkSpec", "TensorChunkSpec", "merge_chunks", "split_args_kwargs"]


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


def _default_spec(value: object) -> ChunkSpec:
    return TensorChunkSpec(0) if isinstance(value, torch.Tensor) else REPLICATE


def _split_one(name: str, value: object, spec: ChunkSpec | None, m: int) -> list[Any]:
    spec = _default_spec(value) if spec is None else spec
    if isinstance(spec, _Replicate):
        return [value] * m
    if not isinstance(spec, TensorChunkSpec):
        raise TypeError(f"the chunk spec of {name} is {spec!r}; use TensorChunkSpec(dim) or REPLICATE")
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} has chunk spec {spec} but is a {type(value).__name__}, not a tensor; "
            "give it the spec REPLICATE to pass it whole to every micro-batch"
        )
    dim = spec.split_dim
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


def merge_chunks(chunks: Sequence[Any], merge_dim: int = 0) -> Any:
    """Concatenate per-micro-batch outputs (tensors, or tuples/lists of tensors) along ``merge_dim``.

    Non-tensor leaves are returned as a list, one per micro-batch, since there
    is no general way to merge them.
    """
    if not chunks:
        raise ValueError("merge_chunks needs at least one micro-batch output")
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        if first.ndim == 0:
            return torch.stack(list(chunks))
        return torch.cat(list(chunks), dim=merge_dim)
    if isinstance(first, (tuple, list)):
        merged = [merge_chunks([c[i] for c in chunks], merge_dim) for i in range(len(first))]
        return type(first)(merged)
    return list(chunks)

"""torch.distributed.checkpoint (DCP) support for hp_dtensor DTensors, by the hooks DCP calls.

DCP does not need to know our DTensor: before falling back to its own types
it asks any tensor for three methods,

* ``__create_write_items__(fqn, obj)``: what this rank writes (one shard
  chunk: offsets and sizes in the global tensor);
* ``__create_chunk_list__()``: which chunk of the global tensor this rank
  holds, so a load reads exactly the overlapping pieces of whatever was
  saved (any world size or sharding);
* ``__get_tensor_shard__(index)``: the local tensor to read from / load into
  in place.

[Note: why hp_fsdp installs them]
These belong on ``hp_dtensor.DTensor`` itself. Until hp-dtensor ships them,
hp_fsdp adds them when ``fully_shard`` runs, and only where the class has no
such attribute yet, so hp-dtensor's own versions win as soon as they exist.
Replicated pieces (HSDP's replicate dim) produce the same index on every
replica, and DCP's planner writes one copy.
"""

from __future__ import annotations

from typing import Any

import torch
from hp_dtensor import DTensor, Partial

__all__ = ["install_checkpoint_hooks"]


def _local_chunk(dt: Any) -> tuple[torch.Size, torch.Size]:
    layout = dt._layout
    if any(isinstance(p, Partial) for p in layout.placements):
        raise ValueError(
            f"checkpointing a DTensor with Partial placements {layout.placements} is not supported; "
            "redistribute it to Shard/Replicate first."
        )
    return torch.Size(layout.local_offset()), torch.Size(dt._local.shape)


def _create_write_items(self: Any, fqn: str, obj: Any) -> list[Any]:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    offsets, sizes = _local_chunk(self)
    if self._local.numel() == 0:
        return []  # a rank past the end of an uneven dim holds nothing to write
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties.create_from_tensor(self._local),
                size=torch.Size(self._layout.shape),
            ),
        )
    ]


def _create_chunk_list(self: Any) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    offsets, sizes = _local_chunk(self)
    if self._local.numel() == 0:
        return []
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def _get_tensor_shard(self: Any, index: Any) -> torch.Tensor:
    offsets, _ = _local_chunk(self)
    if index.offset is not None and torch.Size(index.offset) != offsets:
        raise ValueError(
            f"DCP asked for the shard of {index.fqn!r} at offset {tuple(index.offset)}, but this rank holds "
            f"the one at {tuple(offsets)}."
        )
    local: torch.Tensor = self._local
    return local


_HOOKS = {
    "__create_write_items__": _create_write_items,
    "__create_chunk_list__": _create_chunk_list,
    "__get_tensor_shard__": _get_tensor_shard,
}


def install_checkpoint_hooks() -> None:
    """Give ``hp_dtensor.DTensor`` the DCP hooks it lacks (see [Note: why hp_fsdp installs them])."""
    for name, fn in _HOOKS.items():
        if not hasattr(DTensor, name):
            setattr(DTensor, name, fn)

"""DTensor's side of torch.distributed.checkpoint (DCP): the piece of the global tensor a rank saves, loads.

:class:`DTensor` answers DCP's three protocol methods by calling this module,
so a tensor-parallel model checkpoints with hp_dtensor alone and any save
loads into any other layout, mesh or world size ([Note: DCP protocol]).
``Partial`` placements are refused: a rank's local tensor is a term, not a
piece of the values; the error names the placements to redistribute to first.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hp_dtensor.placements import Partial, Placement, Replicate

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

    from hp_dtensor.layout import Layout

__all__ = ["chunk_list", "tensor_shard", "write_items"]


def _refuse_partial(layout: Layout, what: str) -> None:
    placements = layout.placements
    if not any(isinstance(p, Partial) for p in placements):
        return
    fixed: list[Placement] = [Replicate() if isinstance(p, Partial) else p for p in placements]
    raise ValueError(
        f"{what}: cannot checkpoint a DTensor with placements {list(placements)}: on a Partial mesh dim each "
        "rank holds a term of the values, not the values. Fix: redistribute to Replicate first, "
        f"dt.redistribute(placements={fixed}), and checkpoint that."
    )


def _box(layout: Layout, local: torch.Tensor, what: str) -> tuple[torch.Size, torch.Size] | None:
    """This rank's (offsets, sizes) in the global tensor, or None when it has nothing to save or load.

    See [Note: DCP protocol] for why every layout gives one box and why empty
    pieces of a non-empty tensor give none.
    """
    _refuse_partial(layout, what)
    if layout.mesh.get_coordinate() is None:
        return None  # this rank is outside the tensor's mesh: it holds no piece
    if local.numel() == 0 and math.prod(layout.shape) != 0:
        return None
    return torch.Size(layout.local_offset()), torch.Size(local.shape)


# [Note: DCP protocol]
# DCP does not know hp's DTensor. Before it treats a state-dict value as a
# plain tensor it asks the value for three methods, and :class:`DTensor`
# defines them by calling this module:
#
# * ``__create_write_items__(fqn, obj)`` -> :func:`write_items`: the piece this
#   rank writes, as offsets and sizes in the global tensor;
# * ``__create_chunk_list__()`` -> :func:`chunk_list`: the piece this rank
#   holds, so a load reads exactly the overlapping parts of whatever was saved
#   (another layout, mesh or world size);
# * ``__get_tensor_shard__(index)`` -> :func:`tensor_shard`: the local tensor to
#   write from or to load into, in place.
#
# Without them DCP takes a DTensor for a whole plain tensor: every rank writes
# the wrapper itself with ``torch.save`` (its class pickled along), and
# ``dcp.load`` then refuses the file (``weights_only`` does not allow
# ``hp_dtensor.dtensor.DTensor``). They live here, on the tensor type, so that
# a tensor-parallel model checkpoints with hp_dtensor alone; hp_fsdp's
# parameters are DTensors too and need nothing of their own.
#
# Why one box per rank is exact for every hp layout: each rank's local tensor
# is one contiguous box of the global tensor. Even and ``torch.chunk`` cuts,
# nested cuts of one tensor dim by several mesh dims (each piece cut again in
# mesh-dim order) and ragged per-rank sizes all give a box that starts at
# :meth:`Layout.local_offset` and has the local tensor's shape ([Note: uneven
# and ragged shards] in :mod:`hp_dtensor.layout`). Replicas hold the same box,
# so their write items carry the same index, and DCP's planner keeps one
# writer among them.
#
# Empty pieces: an uneven cut can leave a rank with no elements (7 rows over
# 4 ranks: 2, 2, 2, 1; 6 over 4: 2, 2, 2, 0). Such a rank writes nothing and
# asks for nothing, because its box would add no data and an empty box at
# another rank's offset would share that rank's index (DCP keeps one item
# per index and could drop the one with data). When the whole tensor has no
# elements every rank writes its (empty) box all the same, so the key is in
# the checkpoint and a load of it finds it.
def write_items(layout: Layout, local: torch.Tensor, fqn: str) -> list[WriteItem]:
    """The write item for this rank's piece (``local``, under ``layout``) at the key ``fqn`` (none or one)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    box = _box(layout, local, f"dcp.save of {fqn!r}")
    if box is None:
        return []
    offsets, sizes = box
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties.create_from_tensor(local),
                size=torch.Size(layout.shape),
            ),
        )
    ]


def chunk_list(layout: Layout, local: torch.Tensor) -> list[ChunkStorageMetadata]:
    """The box of the global tensor this rank holds, for DCP's load planner (none or one)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    box = _box(layout, local, "dcp.load")
    if box is None:
        return []
    offsets, sizes = box
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def tensor_shard(layout: Layout, local: torch.Tensor, index: MetadataIndex) -> torch.Tensor:
    """The local tensor DCP writes from or loads into (in place, so the DTensor sees the loaded values)."""
    what = f"DCP's lookup of {index.fqn!r}"
    _refuse_partial(layout, what)
    if index.offset is not None:
        mine = torch.Size(layout.local_offset())
        if torch.Size(index.offset) != mine:
            raise ValueError(
                f"{what}: asked for the piece at offset {tuple(index.offset)}, but this rank holds the "
                f"one at {tuple(mine)} (placements {list(layout.placements)}). The tensor's layout "
                "changed between DCP's planning and its reads or writes; keep the state dict's tensors "
                "as they are until dcp.save / dcp.load returns."
            )
    return local

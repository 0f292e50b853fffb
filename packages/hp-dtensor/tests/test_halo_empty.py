"""Halo exchange of an empty piece on a line of four ranks: nothing is posted, and nothing is read.

A zero-size dim other than the cut one (an empty batch) makes every border
buffer empty, so the neighbour exchange posts no transfer and hands back no
rows; the halo is then the empty piece, and the op runs as on whole tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, fallback_policy

sys.path.insert(0, str(Path(__file__).parent))
from local_compare import check


@pytest.mark.distributed(world_size=4)
def test_conv_of_an_empty_batch_on_four_ranks(rank: int, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(0)
    x, w = torch.randn(0, 3, 12, dtype=torch.float64), torch.randn(4, 3, 3, dtype=torch.float64)
    conv = lambda x, w: F.conv1d(x, w, padding=1)  # noqa: E731
    with fallback_policy("error"):
        check(conv, [x, w], [Shard(2), Replicate()], mesh, expect=[Shard(2)], local=False)

"""A unit whose module runs twice in one forward (weights reused by calling the block again)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import (
    Transformer,
    build,
    count_collectives,
    global_batch,
    loss_fn,
    parity,
    ref_copy,
    shard_blocks,
)


class Reused(Transformer):
    """Block 0 runs twice, then block 1."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = self.blocks[0](h)
        h = self.blocks[0](h)
        h = self.blocks[1](h)
        return self.head(self.norm(h))


def _build() -> Reused:
    model = build()
    model.__class__ = Reused
    return model  # type: ignore[return-value]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("reshard", [True, False])
def test_block_run_twice_parity(rank: int, world_size: int, reshard: bool) -> None:
    model = _build()
    ref = ref_copy(model)
    shard_blocks(model, reshard_after_forward=reshard)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=4)


@pytest.mark.distributed(world_size=2)
def test_block_run_twice_counts(rank: int, world_size: int) -> None:
    model = shard_blocks(_build())
    tokens, targets = global_batch(0, world_size)
    loss_fn(model, tokens[:2], targets[:2]).backward()  # warm-up (lazy init)
    with count_collectives() as counter:
        loss_fn(model, tokens[:2], targets[:2]).backward()
    # forward: root, block0 twice (resharded in between), block1; backward: block1 and block0
    # gather once each (block0 stays gathered across both of its calls' backward), and each unit
    # reduce-scatters once (autograd sums block0's two contributions into one gradient)
    assert counter.calls == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 0}

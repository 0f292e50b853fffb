"""A Hugging Face ``transformers`` model, built from its config, trains under per-layer fully_shard."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Shard
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"  # built from a config: nothing may be downloaded

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import VOCAB, parity, ref_copy


class CausalLM(nn.Module):
    """The HF model returning plain logits, so the shared parity loop can drive it."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.hf(input_ids=tokens).logits
        return logits


def _llama() -> CausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,  # 13: uneven over 2 ranks
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return CausalLM(LlamaForCausalLM(config).double())


@pytest.mark.distributed(world_size=2)
def test_llama_per_layer_parity_with_tied_embedding(rank: int, world_size: int) -> None:
    from hp_fsdp import fully_shard

    model = _llama()
    hf: Any = model.hf
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # the config ties them
    ref = ref_copy(model)
    for layer in hf.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # the tied weight stays one Parameter, sharded once (13 rows over 2 ranks: 7 / 6)
    tied = hf.lm_head.weight
    assert tied is hf.model.embed_tokens.weight
    assert isinstance(tied, DTensor) and tied.placements == (Shard(0),)
    assert tied.to_local().shape == ([7, 6][rank], 32)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # losses, every gradient (the tied one summed over both uses) and every parameter after AdamW
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=4)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight


@pytest.mark.distributed(world_size=2, timeout=300)
def test_llama_layers_compiled_under_fully_shard(rank: int, world_size: int) -> None:
    """torchtitan's recipe: ``fully_shard`` each decoder layer, then ``layer.compile()``; eager parity."""
    import torch._dynamo
    from hp_fsdp import fully_shard

    torch._dynamo.reset()  # the pooled ranks are reused: start from empty caches
    model = _llama()
    hf: Any = model.hf
    ref = ref_copy(model)
    for layer in hf.model.layers:
        fully_shard(layer)
        layer.compile(backend="aot_eager")
    fully_shard(model)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=1)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0, "the layers were not compiled"
    with torch._dynamo.config.patch(error_on_recompile=True):  # nothing compiles after the first step
        parity(model, ref, dp_rank=rank, dp_world=world_size, steps=2)

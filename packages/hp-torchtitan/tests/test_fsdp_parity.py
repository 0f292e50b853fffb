"""torchtitan's Llama 3 debug model, 5 steps of FSDP on 2 ranks: hp's spec against torchtitan's own.

Same initial weights (one unsharded init, loaded into both), same tokens (a
tokenizer trained offline on tests/assets/tiny_corpus.txt), fp32, torchtitan's
gradient clipping, its default fused AdamW and LR warmup. The losses must agree
to 1e-5 and so must every parameter after the last step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

CORPUS = Path(__file__).parent / "assets" / "tiny_corpus.txt"
STEPS = 5


def _batches(rank: int, world: int) -> list:  # type: ignore[type-arg]
    from hp_torchtitan.data import build_tokenizer, packed_batches
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = HuggingFaceTokenizer(tokenizer_path=str(build_tokenizer(CORPUS, folder)))
        tokens = tokenizer.encode(CORPUS.read_text(), add_bos=True, add_eos=True)
    return packed_batches(tokens, steps=STEPS, local_batch_size=2, seq_len=64, dp_rank=rank, dp_degree=world)


@pytest.mark.distributed(world_size=2)
def test_hp_llama3_fsdp_matches_torchtitan(rank) -> None:  # type: ignore[no-untyped-def]
    import hp_torchtitan
    from hp_torchtitan.driver import RunConfig, full_initial_weights, train_losses
    from hp_torchtitan.spec import with_sdpa_attention
    from torchtitan.models.llama3 import model_registry

    torch_spec = with_sdpa_attention(model_registry("debugmodel"))
    hp_spec = with_sdpa_attention(hp_torchtitan.hp_llama3_spec("debugmodel"))
    assert hp_spec.parallelize_fn is hp_torchtitan.parallelize_decoder
    batches = _batches(rank, 2)
    weights = full_initial_weights(torch_spec, seed=0)
    config = RunConfig(steps=STEPS)

    torch_losses, torch_model = train_losses(torch_spec, batches, weights, config)
    hp_losses, hp_model = train_losses(hp_spec, batches, weights, config)

    assert torch_losses[-1] < torch_losses[0] - 1.0, torch_losses  # it trains
    torch.testing.assert_close(
        torch.tensor(hp_losses), torch.tensor(torch_losses), rtol=0, atol=1e-5, msg=f"{hp_losses}"
    )
    hp_params = dict(hp_model.named_parameters())
    for name, param in torch_model.named_parameters():
        theirs = param.full_tensor()
        ours = hp_params[name].full_tensor()
        assert type(hp_params[name]).__module__.startswith("hp_dtensor"), name
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)

"""MPipe: a vision tower and a text decoder under ``ScheduleMPipe``; checked against one process.

Run on 2 local CPU ranks:   hp-run -n 2 examples/mpipe.py
or on a cluster, unchanged: torchrun --nproc-per-node 2 examples/mpipe.py

A tiny vision-language model: a vision tower turns each sample's image patches
into feature vectors, which go in front of the text tokens of a two-stage
causal decoder (stage 0 on rank 0, stage 1 on rank 1). Instead of running the
tower on stage 0 for every micro-batch, MPipe gives each micro-batch an owner
rank that runs the tower for it during the pipeline's idle warm-up and sends
the features to stage 0; the feature gradients come back to the owner, and at
the end of the step the tower's gradients are summed over the ranks (every rank
holds a replica of the tower). The loss is the mean over all text tokens of the
batch (``normalize_by_tokens``), as in single-process training.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from example_common import finish
from hp_core import init_distributed
from hp_pipeline import PipelineStage, ScheduleMPipe
from torch import nn

DIM, PATCH, PATCHES, SEQ, VOCAB = 16, 12, 3, 6, 32


class Tower(nn.Module):
    """Image patches (batch, PATCHES, PATCH) -> features (batch, PATCHES, DIM)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(PATCH, DIM), nn.Linear(DIM, DIM)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(patches)))


class DecoderLayer(nn.Module):
    """One causal transformer layer (no biases: a key bias gets a zero gradient that AdamW would
    turn into noise-driven steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], dtype=h.dtype)
        return self.layer(h, src_mask=mask, is_causal=True)


class First(nn.Module):
    """Stage 0: called as ``module(text_ids, features)``: image features first, then the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = DecoderLayer()

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.cat([features, self.embed(ids)], dim=1))


class Last(nn.Module):
    """Stage 1: one more layer and the head, on the text positions only."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = DecoderLayer()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(h)[:, PATCHES:])


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss MPipe wants with ``normalize_by_tokens``: summed over tokens; it divides by the count."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # exact comparison through AdamW, see examples/fsdp.py

    init_distributed()
    rank, p = dist.get_rank(), dist.get_world_size()
    if p != 2:
        raise SystemExit(f"mpipe.py has two text stages, one per rank: run it on 2 ranks, not {p}")
    torch.manual_seed(0)  # the same initial weights on every rank
    tower, stages = Tower(), [First(), Last()]
    ref_tower, ref_stages = copy.deepcopy(tower), copy.deepcopy(stages)

    stage = PipelineStage(stages[rank], rank, p)
    schedule = ScheduleMPipe(
        stage,
        args.microbatches,
        preprocess=tower,  # a replica on every rank; rank 0's weights are broadcast at construction
        loss_fn=token_sum,
        normalize_by_tokens=True,  # divide by the global number of labelled tokens
    )
    opt = torch.optim.AdamW([*stages[rank].parameters(), *tower.parameters()], lr=1e-2)
    ref_opt = torch.optim.AdamW(
        [*ref_tower.parameters(), *(q for m in ref_stages for q in m.parameters())], lr=1e-2
    )
    print(f"rank {rank} runs the tower for micro-batches {list(schedule.owned_micros)}", flush=True)

    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(args.steps):
        patches = torch.randn(args.batch, PATCHES, PATCH, generator=gen)
        ids = torch.randint(0, VOCAB, (args.batch, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (args.batch, SEQ), generator=gen)
        losses: list[torch.Tensor] = []
        # Without in-schedule loading every rank passes the batch: stage 0 uses the text, the
        # last stage the labels, each owner the patches of its own micro-batches.
        schedule.step(ids, target=labels, losses=losses, preprocess_inputs=patches)
        opt.step()
        opt.zero_grad()

        ref_logits = ref_stages[1](ref_stages[0](ids, ref_tower(patches)))
        ref_loss = F.cross_entropy(ref_logits.flatten(0, -2), labels.flatten())  # mean over all tokens
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        if rank == p - 1:  # each micro-batch's loss is already divided by the batch's token count
            loss = float(torch.stack(losses).sum())
            worst = max(worst, abs(loss - float(ref_loss.detach())))
            print(f"step {step}: loss {loss:.6f}   one process {float(ref_loss.detach()):.6f}")

    with torch.no_grad():
        pairs = [*zip(stages[rank].parameters(), ref_stages[rank].parameters(), strict=True)]
        pairs += zip(tower.parameters(), ref_tower.parameters(), strict=True)  # every rank's replica
        for a, b in pairs:
            worst = max(worst, float((a - b).abs().max()))
    finish(worst, args.tolerance, f"MPipe over {p} ranks")


if __name__ == "__main__":
    main()

"""Train a small transformer language model data-parallel, and prove it matches one process.

Run on 4 local CPU ranks:   hp-run -n 4 examples/train_lm.py
or on a cluster, unchanged: torchrun --nproc-per-node 8 examples/train_lm.py

Every rank holds a full replica and trains on its slice of each global batch;
after backward the gradients are averaged with one fused all-reduce (all grads
flattened into a single buffer, as DDP's buckets do). Rank 0 also trains a deep
copy of the initial model in a single process on the whole global batch, then
prints the loss of both each step and, at the end, the largest parameter
difference. With equal slices, the mean of per-rank mean losses is the global
mean loss, so the two runs must agree up to float rounding.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from hp_core import all_reduce, get_platform, init_device_mesh, init_distributed


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic language: each token is an affine function of the last, with noise."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    steps = torch.arange(seq + 1)
    tokens = (start * 7 + steps * 3) % vocab
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def average_gradients(model: nn.Module, group: object) -> None:
    """One all-reduce for every gradient: flatten, average, copy back."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, op="avg", group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=97)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="float64 by default: Adam divides by sqrt(v), which turns float32 rounding in the "
        "gradient sum into visible parameter noise; in float64 the runs agree to ~1e-12",
    )
    parser.add_argument(
        "--tolerance", type=float, default=None, help="default 1e-9 (float64), 1e-3 (float32)"
    )
    args = parser.parse_args()
    tolerance = args.tolerance if args.tolerance is not None else (1e-9 if args.dtype == "float64" else 1e-3)
    torch.set_default_dtype(getattr(torch, args.dtype))

    init_distributed()
    platform = get_platform()
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(platform.device_type, (world,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank("dp")
    if args.global_batch % world:
        raise SystemExit(
            f"--global-batch {args.global_batch} does not split evenly over {world} ranks; "
            f"use a multiple of {world}"
        )
    local = args.global_batch // world
    device = platform.device()

    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyLM(args.vocab, args.dim, 4, args.layers, args.seq).to(device)
    reference = copy.deepcopy(model) if rank == 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3) if reference is not None else None

    if rank == 0:
        print(
            f"data-parallel over {world} ranks ({platform.backend}), global batch {args.global_batch}, "
            f"{sum(p.numel() for p in model.parameters()):,} {args.dtype} parameters"
        )
    worst_loss_gap = 0.0
    for step in range(args.steps):
        inputs, targets = make_batch(step, args.global_batch, args.seq, args.vocab)
        inputs, targets = inputs.to(device), targets.to(device)
        mine = slice(rank * local, (rank + 1) * local)
        loss = loss_of(model, inputs[mine], targets[mine])
        opt.zero_grad()
        loss.backward()
        average_gradients(model, mesh.get_group("dp"))
        opt.step()
        global_loss = loss.detach().clone()
        all_reduce(global_loss, op="avg", group=mesh.get_group("dp"))
        if reference is not None and ref_opt is not None:
            ref_loss = loss_of(reference, inputs, targets)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            worst_loss_gap = max(worst_loss_gap, abs(global_loss.item() - ref_loss.item()))
            print(f"step {step}: loss {global_loss.item():.6f}   single process {ref_loss.item():.6f}")

    if reference is not None:
        diff = max(
            (p - q).abs().max().item()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        )
        print(f"largest loss difference from single-process training: {worst_loss_gap:.3e}")
        print(f"largest parameter difference from single-process training: {diff:.3e}")
        if not (math.isfinite(diff) and diff <= tolerance and worst_loss_gap <= tolerance):
            raise SystemExit(f"data-parallel training drifted from the single-process run (> {tolerance:g})")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Step time and peak memory: hp_fsdp.fully_shard against torch's own fully_shard.

Both wrap the same small transformer per block plus the root, on the same
ranks, with the same data, and train with AdamW. Steps are measured
alternately (hp, torch, hp, torch, ...) so drifting machine load hits both
sides alike; the figure per side is the median step. Peak memory is the high
-water mark of CPU tensor allocations during a step (median of a few steps),
read from the torch profiler's memory events (CPU has no allocator counters).

Run: ``hp-run -n 4 benchmarks/fsdp_step.py`` (measures 2 and 4 ranks; with
``-n 2`` only 2). Prints a table, then as its last line one JSON object.

``--compile`` compiles every block after ``fully_shard`` (``block.compile()``,
inductor, torchtitan's recipe) on both sides and also times hp's eager step:
the ratios then name the compiled anchor (``torch_fully_shard_compiled_...``)
and our own eager step (``hp_eager_step_time_...``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
import warnings
from typing import Any

import hp_core
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hp_core import DeviceMesh
from torch import nn
from torch.profiler import ProfilerActivity, profile


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        x = x + self.proj(att.softmax(-1) @ v)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _shard_hp(model: Model, mesh: DeviceMesh) -> Model:
    from hp_fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _shard_torch(model: Model, mesh: DeviceMesh) -> Model:
    from torch.distributed.fsdp import fully_shard

    torch_mesh = mesh.to_torch()
    for block in model.blocks:
        fully_shard(block, mesh=torch_mesh)
    fully_shard(model, mesh=torch_mesh)
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _peak_bytes(fn: Any) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ]
    current = peak = 0
    for _, nbytes in sorted(events):
        current += nbytes
        peak = max(peak, current)
    return peak


def _compiled(model: Model, backend: str) -> Model:
    for block in model.blocks:
        block.compile(backend=backend)
    return model


def measure(mesh: DeviceMesh, group: Any, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    base = Model(args.vocab, args.dim, args.blocks)
    models: dict[str, nn.Module] = {
        "hp": _shard_hp(copy.deepcopy(base), mesh),
        "torch": _shard_torch(copy.deepcopy(base), mesh),
    }
    if args.compile:
        models["hp"] = _compiled(models["hp"], args.backend)  # type: ignore[arg-type]
        models["torch"] = _compiled(models["torch"], args.backend)  # type: ignore[arg-type]
        models["hp_eager"] = _shard_hp(copy.deepcopy(base), mesh)
    order = list(models)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    rank = mesh.get_local_rank(0)
    g = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    times: dict[str, list[float]] = {name: [] for name in order}
    for it in range(args.warmup + args.iters):
        for name in order if it % 2 == 0 else order[::-1]:
            dist.barrier(group=group)
            start = time.perf_counter()
            _step(models[name], opts[name], tokens, targets)
            elapsed = time.perf_counter() - start
            if it >= args.warmup:
                times[name].append(elapsed)
    # The peak depends on when background communication threads finish, so it varies a little
    # from step to step: take the median of a few profiled steps per side, alternating.
    samples: dict[str, list[int]] = {"hp": [], "torch": []}
    for it in range(args.memory_steps):
        for name in ("hp", "torch") if it % 2 == 0 else ("torch", "hp"):
            dist.barrier(group=group)
            samples[name].append(
                _peak_bytes(lambda name=name: _step(models[name], opts[name], tokens, targets))
            )
    peaks = {name: float(statistics.median(values)) for name, values in samples.items()}
    # the slowest rank sets the pace of a step; the largest rank sets the memory need
    eager = statistics.median(times["hp_eager"]) if "hp_eager" in times else float("nan")
    out = torch.tensor(
        [
            statistics.median(times["hp"]),
            statistics.median(times["torch"]),
            peaks["hp"],
            peaks["torch"],
            eager,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return {
        "hp_step_s": out[0].item(),
        "torch_step_s": out[1].item(),
        "hp_peak": out[2].item(),
        "torch_peak": out[3].item(),
        "hp_eager_step_s": out[4].item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compile each block after fully_shard")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend with --compile")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # torch FSDP2's advice, not ours
    hp_core.init_distributed()
    world = hp_core.get_world_size()
    rank = hp_core.get_rank()
    device_type = hp_core.get_platform().device_type
    results: dict[int, dict[str, float]] = {}
    for size in sorted({min(2, world), world}):
        # every rank takes part in creating the sub-group; only its members measure
        mesh = DeviceMesh(device_type, torch.arange(size), mesh_dim_names=("dp",))
        if rank < size:
            results[size] = measure(mesh, mesh.get_group(0), args)
        dist.barrier()
    if rank == 0:
        print(
            f"fsdp_step: transformer dim={args.dim} blocks={args.blocks} vocab={args.vocab} "
            f"batch={args.batch}x{args.seq} per rank, AdamW, {args.iters} alternating steps, median"
            + (f", blocks compiled ({args.backend})" if args.compile else "")
        )
        print(
            f"{'ranks':>5} | {'hp ms':>8} | {'torch ms':>8} | {'time ratio':>10} | "
            f"{'hp peak MiB':>11} | {'torch peak MiB':>14} | {'mem ratio':>9}"
        )
        ratios: dict[str, float] = {}
        raw: dict[str, Any] = {}
        for size, r in results.items():
            t_ratio = r["hp_step_s"] / r["torch_step_s"]
            m_ratio = r["hp_peak"] / r["torch_peak"] if r["torch_peak"] else float("nan")
            hp_ms, torch_ms = 1e3 * r["hp_step_s"], 1e3 * r["torch_step_s"]
            print(
                f"{size:>5} | {hp_ms:>8.2f} | {torch_ms:>8.2f} | {t_ratio:>10.3f} | "
                f"{r['hp_peak'] / 2**20:>11.2f} | {r['torch_peak'] / 2**20:>14.2f} | {m_ratio:>9.3f}"
            )
            anchor = "torch_fully_shard_compiled" if args.compile else "torch_fully_shard"
            ratios[f"{anchor}_step_time_{size}r"] = round(t_ratio, 4)
            ratios[f"{anchor}_peak_memory_{size}r"] = round(m_ratio, 4)
            if args.compile:
                eager_ratio = r["hp_step_s"] / r["hp_eager_step_s"]
                ratios[f"hp_eager_step_time_{size}r"] = round(eager_ratio, 4)
                eager_ms = 1e3 * r["hp_eager_step_s"]
                print(f"{'':>5}   hp compiled / hp eager step: {eager_ratio:.3f} ({eager_ms:.2f} ms eager)")
            raw[f"{size}r"] = {k: round(v, 6) for k, v in r.items()}
        print(json.dumps({"benchmark": "fsdp_step", "ratios": ratios, "raw": raw, "config": vars(args)}))
    hp_core.destroy_distributed()


if __name__ == "__main__":
    main()

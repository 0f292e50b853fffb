"""Compiled tensor-parallel training step: hp_dtensor against torch.distributed.tensor, both compiled.

The same MLP stack (column-wise ``up``, row-wise ``down`` in each block) is
parallelized over all ranks by each library, compiled whole with
``torch.compile(fullgraph=True)`` (inductor unless ``--backend``), and
trained with SGD on the same data. hp's uncompiled model runs too, as the
second anchor: the gain compile brings to our own step. Steps alternate
between the models (the order flips every iteration) after a barrier, and a
figure is the median step of the slowest rank.

Run: ``hp-run -n 2 benchmarks/tp_compile_step.py`` (or ``-n 4``). Prints a
table, then as its last line one JSON object whose ``ratios`` are ours over
the anchor (below 1.0: we are faster).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import hp_core
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _parallel(model: Stack, mesh: Any, library: str) -> Stack:
    if library == "hp":
        from hp_dtensor import ColwiseParallel, RowwiseParallel, parallelize_module
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = mesh.to_torch()
    for block in model.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    hp_core.init_distributed()
    world = hp_core.get_world_size()
    mesh = hp_core.init_device_mesh(hp_core.get_platform().device_type, (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    base = Stack(args.dim, args.blocks)
    models: dict[str, nn.Module] = {
        "hp": _parallel(copy.deepcopy(base), mesh, "hp"),
        "torch": _parallel(copy.deepcopy(base), mesh, "torch"),
        "hp_eager": _parallel(copy.deepcopy(base), mesh, "hp"),
    }
    runners = {
        "hp": torch.compile(models["hp"], backend=args.backend, fullgraph=True),
        "torch": torch.compile(models["torch"], backend=args.backend, fullgraph=True),
        "hp_eager": models["hp_eager"],
    }
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    x = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(1))
    order = list(runners)
    times: dict[str, list[float]] = {name: [] for name in order}
    for it in range(args.warmup + args.iters):
        for name in order if it % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            runners[name](x).pow(2).mean().backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if it >= args.warmup:
                times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[name]) for name in order], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    step = dict(zip(order, medians.tolist(), strict=True))
    if hp_core.get_rank() == 0:
        print(
            f"tp_compile_step: {args.blocks} MLP blocks dim={args.dim}, {args.tokens} tokens, tp={world}, "
            f"fullgraph {args.backend}, SGD, {args.iters} alternating steps, median of the slowest rank"
        )
        print(f"{'model':>22} | {'step ms':>8}")
        for name, label in (
            ("hp", "hp compiled"),
            ("torch", "torch DTensor compiled"),
            ("hp_eager", "hp eager"),
        ):
            print(f"{label:>22} | {1e3 * step[name]:>8.2f}")
        ratios = {
            f"torch_tp_compiled_step_time_{world}r": round(step["hp"] / step["torch"], 4),
            f"hp_eager_step_time_{world}r": round(step["hp"] / step["hp_eager"], 4),
        }
        for key, value in ratios.items():
            print(f"{key}: {value:.3f}")
        raw = {f"{name}_step_s": round(value, 6) for name, value in step.items()}
        print(
            json.dumps({"benchmark": "tp_compile_step", "ratios": ratios, "raw": raw, "config": vars(args)})
        )
    hp_core.destroy_distributed()


if __name__ == "__main__":
    main()

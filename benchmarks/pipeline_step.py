"""Step time of hp-pipeline's schedules against torch.distributed.pipelining's, side by side.

Run on 4 CPU ranks over gloo:

    hp-run -n 4 benchmarks/pipeline_step.py [--width 256] [--microbatches 8] [--steps 10]

Both libraries train the same MLP (same weights, batch and micro-batches) with
the same schedule; each step time is the median over ``--steps`` steps after
warm-up, the maximum over ranks. Rank 0 prints a table, each schedule's
simulated bubble against its textbook formula, and as the last line one JSON
object whose ``ratios`` are our step time over torch's (below 1.0: we are faster).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def make_layers(n: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)]


def chunk(layers: list[nn.Module], stage: int, num_stages: int) -> nn.Module:
    per = len(layers) // num_stages
    return nn.Sequential(*copy.deepcopy(layers[stage * per : (stage + 1) * per]))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def time_steps(schedule: Any, first: bool, last: bool, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    def one() -> None:
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(x, target=y if last else None, losses=losses if last else None)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()

    for _ in range(3):
        one()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        one()
        times.append(time.perf_counter() - start)
    local = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local.item())


def build(lib: str, kind: str, layers: list[nn.Module], m: int) -> tuple[Any, bool, bool]:
    rank, p = dist.get_rank(), dist.get_world_size()
    v = 2 if kind == "Interleaved1F1B" else 1
    num_stages = v * p
    mine = [rank + j * p for j in range(v)]
    if lib == "ours":
        import hp_pipeline as hp

        stages: Any = [hp.PipelineStage(chunk(layers, s, num_stages), s, num_stages) for s in mine]
        cls: Any = hp.Schedule1F1B if kind == "1F1B" else hp.ScheduleInterleaved1F1B
    else:
        from torch.distributed import pipelining as tp

        device = torch.device("cpu")
        stages = [tp.PipelineStage(chunk(layers, s, num_stages), s, num_stages, device) for s in mine]
        cls = tp.Schedule1F1B if kind == "1F1B" else tp.ScheduleInterleaved1F1B
    schedule = cls(stages[0] if v == 1 else stages, m, loss_fn)
    return schedule, 0 in mine, num_stages - 1 in mine


def bubbles(p: int, m: int) -> list[dict[str, Any]]:
    import hp_pipeline as hp

    rows = []
    unit = hp.StepCosts(forward=1, backward=1)
    split = hp.StepCosts(forward=1, backward_input=1, backward_weight=1)
    cases: list[tuple[str, Any, Any, Any, str]] = [
        ("GPipe", hp.build_gpipe_order(p, m), unit, Fraction(p - 1, m + p - 1), "ratio (p-1)/(m+p-1)"),
        ("1F1B", hp.build_1f1b_order(p, m), unit, Fraction(p - 1, m + p - 1), "ratio (p-1)/(m+p-1)"),
        (
            "Interleaved1F1B v=2",
            hp.build_interleaved_1f1b_order(p, m, 2),
            unit,
            Fraction(p - 1, 2 * m),
            "overhead (p-1)/(v*m)",
        ),
    ]
    for name, order, costs, formula, label in cases:
        result = hp.simulate(order, costs)
        figure = result.bubble_overhead[0] if "overhead" in label else result.bubble_ratio[0]
        rows.append({"schedule": name, "simulated": figure, "formula": formula, "label": label})
    zb = hp.simulate(hp.build_zero_bubble_h1_order(p, m), split)
    ob = hp.simulate(hp.build_1f1b_order(p, m), split_as_full(split))
    rows.append(
        {
            "schedule": "ZB-H1 (F=I=W)",
            "simulated": zb.bubble_overhead[0] / ob.bubble_overhead[0],
            "formula": Fraction(1, 3),
            "label": "bubble / 1F1B's bubble",
        }
    )
    return rows


def split_as_full(split: Any) -> Any:
    import hp_pipeline as hp

    return hp.StepCosts(forward=split.forward, backward=split.backward_input + split.backward_weight)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    layers = make_layers(2 * p, args.width)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    y = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(2))
    results: dict[str, dict[str, float]] = {}
    for kind in ("1F1B", "Interleaved1F1B"):
        for lib in ("torch", "ours", "torch", "ours"):  # alternate to even out drift
            schedule, first, last = build(lib, kind, layers, args.microbatches)
            seconds = time_steps(schedule, first, last, x, y, args.steps)
            best = results.setdefault(kind, {}).get(lib)
            results[kind][lib] = seconds if best is None else min(best, seconds)
    if rank == 0:
        print(f"pipeline step, {p} ranks (gloo, CPU), MLP {2 * p} x Linear({args.width}), ")
        print(f"batch {args.batch}, {args.microbatches} micro-batches, median of {args.steps} steps")
        print(f"{'schedule':<18}{'torch ms':>12}{'ours ms':>12}{'ours/torch':>12}")
        ratios = {}
        for kind, row in results.items():
            ratio = row["ours"] / row["torch"]
            ratios[f"Schedule{kind}"] = round(ratio, 4)
            print(f"{kind:<18}{row['torch'] * 1e3:>12.2f}{row['ours'] * 1e3:>12.2f}{ratio:>12.3f}")
        print()
        print(f"simulated bubble, p={p}, m={args.microbatches}")
        rows = bubbles(p, args.microbatches)
        for row in rows:
            ok = "equal" if row["simulated"] == row["formula"] else "DIFFERENT"
            print(
                f"{row['schedule']:<22}{row['label']:<26}{row['simulated']!s:>10}{row['formula']!s:>10}  {ok}"
            )
        summary = {
            "benchmark": "pipeline_step",
            "ratios": ratios,
            "step_ms": {k: {lib: round(v * 1e3, 3) for lib, v in row.items()} for k, row in results.items()},
            "bubbles": {
                row["schedule"]: {"simulated": str(row["simulated"]), "formula": str(row["formula"])}
                for row in rows
            },
            "config": {
                "ranks": p,
                "width": args.width,
                "batch": args.batch,
                "microbatches": args.microbatches,
            },
        }
        print(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

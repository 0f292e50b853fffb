"""Activation memory of 1F1B with activation swap against without, and what swapping costs in step time.

Run on 4 CPU ranks over gloo:

    hp-run -n 4 --no-checks benchmarks/pipeline_memory.py [--width 512] [--layers 4] [--batch 256]
        [--microbatches 8] [--rounds 20]

The default size (micro-batches of 32 x 512 floats) gives each saved tensor
some work to go with it. The session's cost per saved tensor is fixed (a
Python pack and unpack call, a handle, two copies), so on much smaller
tensors it weighs more: at ``--width 256 --batch 64`` (8 x 256 per
micro-batch, each op a few microseconds) one run gave 1.04 in wall time on
the shared 2-core machine (paired 1.10) and 1.16 in CPU time.

Every rank trains the same MLP (``--layers`` x (Linear, GELU) per stage, one
stage per rank) with ``Schedule1F1B`` three ways, in one run and one process
group:

* ``off``: ``swap_policy=None``, the schedule as it is (the step-time anchor);
* ``counted``: ``SwapPolicy(stages=())``, which swaps nothing but counts the
  saved activations the stage keeps (the memory anchor);
* ``swap``: ``SwapPolicy(keep_newest=0)``, every micro-batch's saved
  activations go to host memory after its forward and come back one compute
  step before its backward.

Memory is the executor's accounting ([Note: activation accounting] in
``hp_pipeline.swap``): the peak bytes of saved activations resident on the
compute device during one step, per rank. The simulator's peak (micro-batches
resident on the device per rank, ``simulate(order).peak_device_activations_per_rank``)
times one micro-batch's bytes must equal it; the table says whether it does.
The gradients of the three runs are compared too (they must be identical).

Step time: ``--rounds`` rounds, each one step of ``off`` and one of ``swap``,
alternating which goes first; a step's time is its slowest rank's, from a
barrier; its CPU time is every rank's together (steadier than wall time on a
shared machine). On CPU a swap is a synchronous memory copy on the compute
thread (there is no side stream to hide it behind), so the ratio is an upper
bound of what an accelerator with copy engines pays.

Last line: one JSON object with ``ratios`` ``activation_peak_with_swap``
(largest per-rank peak with swap / without; aim <= 0.5) and
``step_time_with_swap`` (median step time with / without; aim <= 1.1).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MODES = ("off", "counted", "swap")


def make_stages(p: int, layers: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())])
        for _ in range(p)
    ]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def policy_of(mode: str) -> Any:
    import hp_pipeline as hp

    return {"off": None, "counted": hp.SwapPolicy(stages=()), "swap": hp.SwapPolicy(keep_newest=0)}[mode]


def build(mode: str, modules: list[nn.Module], m: int) -> Any:
    import hp_pipeline as hp

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = hp.PipelineStage(copy.deepcopy(modules[rank]), rank, p)
    return hp.Schedule1F1B(stage, m, loss_fn, swap_policy=policy_of(mode))


def run_step(schedule: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    for param in schedule.stages[0].submod.parameters():
        param.grad = None
    if rank == 0:
        schedule.step(x)
    elif rank == p - 1:
        schedule.step(target=y)
    else:
        schedule.step()


def timed_step(schedule: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One step from a common start (barrier): this rank's wall and CPU seconds."""
    dist.barrier()
    cpu, start = time.process_time(), time.perf_counter()
    run_step(schedule, x, y)
    return time.perf_counter() - start, time.process_time() - cpu


def grads(schedule: Any) -> list[torch.Tensor]:
    return [param.grad.clone() for param in schedule.stages[0].submod.parameters()]


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, by rank."""
    local = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="(Linear, GELU) pairs per stage")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    import hp_pipeline as hp

    rank, p, m = dist.get_rank(), dist.get_world_size(), args.microbatches
    modules = make_stages(p, args.layers, args.width)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    y = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(2))
    schedules = {mode: build(mode, modules, m) for mode in MODES}
    for _ in range(args.warmup):
        for schedule in schedules.values():
            run_step(schedule, x, y)

    # One checked step of each: gradients, and the accounting of that step.
    results = {}
    for mode, schedule in schedules.items():
        run_step(schedule, x, y)
        results[mode] = (grads(schedule), schedule.activation_memory())
    diff = max(
        float((a - b).abs().max())
        for mode in ("counted", "swap")
        for a, b in zip(results[mode][0], results["off"][0], strict=True)
    )
    off_stats, on_stats = results["counted"][1], results["swap"][1]
    per_micro = set(off_stats.bytes_by_micro.values())
    if len(per_micro) != 1:
        raise RuntimeError(f"rank {rank}: micro-batches keep different bytes {sorted(per_micro)}")
    unit = per_micro.pop()
    measured = gather([off_stats.peak_bytes, on_stats.peak_bytes, unit, on_stats.swapped_out, diff])

    wall: dict[str, list[float]] = {"off": [], "swap": []}
    cpu: dict[str, list[float]] = {"off": [], "swap": []}
    for r in range(args.rounds):
        for mode in ("off", "swap") if r % 2 == 0 else ("swap", "off"):
            w, c = timed_step(schedules[mode], x, y)
            wall[mode].append(w)
            cpu[mode].append(c)
    slowest, cpu_total = {}, {}
    for mode in wall:
        # A step lasts until its slowest rank is done; the CPU it costs is every rank's together.
        t = torch.tensor(wall[mode], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[mode] = t.tolist()
        c = torch.tensor(cpu[mode], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
        cpu_total[mode] = c.tolist()

    if rank == 0:
        sim_off = hp.simulate(schedules["counted"].order)
        sim_on = hp.simulate(schedules["swap"].order)
        rows = []
        for r in range(p):
            peak_off, peak_on, unit, swapped, _ = measured[r]
            sim_peak_off = sim_off.peak_device_activations_per_rank[r]
            sim_peak_on = sim_on.peak_device_activations_per_rank[r]
            rows.append(
                {
                    "rank": r,
                    "peak_off": int(peak_off),
                    "peak_on": int(peak_on),
                    "micro_bytes": int(unit),
                    "swapped_out": int(swapped),
                    "sim_off": sim_peak_off,
                    "sim_on": sim_peak_on,
                    "agree": sim_peak_off * unit == peak_off and sim_peak_on * unit == peak_on,
                }
            )
        max_diff = max(row[4] for row in measured)
        peak_ratio = max(r["peak_on"] for r in rows) / max(r["peak_off"] for r in rows)
        median = {mode: statistics.median(times) for mode, times in slowest.items()}
        paired = statistics.median(a / b for a, b in zip(slowest["swap"], slowest["off"], strict=True))
        time_ratio = median["swap"] / median["off"]
        cpu_median = {mode: statistics.median(times) for mode, times in cpu_total.items()}
        cpu_ratio = cpu_median["swap"] / cpu_median["off"]
        print(
            f"pipeline activation memory, Schedule1F1B p={p} m={m}, {p} ranks (gloo, CPU), "
            f"{args.layers} x (Linear({args.width}), GELU) per stage, batch {args.batch}"
        )
        print("peak: saved activations resident on the compute device during a step (executor's accounting)")
        print("sim: simulated peak micro-batches on the device; agree: sim x micro-batch bytes == measured")
        print(
            f"{'rank':>4}{'no swap B':>12}{'swap B':>12}{'ratio':>8}{'micro B':>10}{'swapped':>9}"
            f"{'sim no swap':>13}{'sim swap':>10}{'agree':>7}"
        )
        for row in rows:
            print(
                f"{row['rank']:>4}{row['peak_off']:>12}{row['peak_on']:>12}"
                f"{row['peak_on'] / row['peak_off']:>8.3f}{row['micro_bytes']:>10}{row['swapped_out']:>9}"
                f"{row['sim_off']:>13}{row['sim_on']:>10}{'yes' if row['agree'] else 'NO':>7}"
            )
        print(f"largest per-rank peak, swap / no swap: {peak_ratio:.3f}")
        print(
            f"step ms (median of {args.rounds}, slowest rank): no swap {median['off'] * 1e3:.2f}, "
            f"swap {median['swap'] * 1e3:.2f}, ratio {time_ratio:.3f} (paired {paired:.3f})"
        )
        print(
            f"CPU ms per step (median, all ranks): no swap {cpu_median['off'] * 1e3:.2f}, "
            f"swap {cpu_median['swap'] * 1e3:.2f}, ratio {cpu_ratio:.3f}"
        )
        print(f"gradients, swap and counted against no swap: max |diff| = {max_diff:.1e}")
        summary = {
            "benchmark": "pipeline_memory",
            "ratios": {
                "activation_peak_with_swap": round(peak_ratio, 4),
                "step_time_with_swap": round(time_ratio, 4),
            },
            "paired_ratios": {"step_time_with_swap": round(paired, 4)},
            "cpu_ratios": {"step_time_with_swap": round(cpu_ratio, 4)},
            "peak_bytes": {str(r["rank"]): {"no_swap": r["peak_off"], "swap": r["peak_on"]} for r in rows},
            "simulated_peak_microbatches": {
                str(r["rank"]): {"no_swap": r["sim_off"], "swap": r["sim_on"]} for r in rows
            },
            "simulator_agrees": all(r["agree"] for r in rows),
            "step_ms": {mode: round(t * 1e3, 3) for mode, t in median.items()},
            "cpu_ms": {mode: round(t * 1e3, 3) for mode, t in cpu_median.items()},
            "max_abs_grad_diff": max_diff,
            "config": {
                "schedule": "1F1B",
                "ranks": p,
                "microbatches": m,
                "width": args.width,
                "layers_per_stage": args.layers,
                "batch": args.batch,
                "rounds": args.rounds,
                "policy": "SwapPolicy(keep_newest=0)",
                "cores": os.cpu_count(),
            },
        }
        print(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Step time of hp-pipeline's schedules against torch.distributed.pipelining's, side by side.

Run on 4 CPU ranks over gloo, bare (as under torchrun):

    hp-run --no-checks -n 4 benchmarks/pipeline_step.py [--width 256] [--microbatches 8] [--rounds 40]
        [--steps 1] [--schedules 1F1B,Interleaved1F1B,LoopedBFS,InterleavedZeroBubble,ZBVZeroBubble,DualPipeV]

``--no-checks`` matters: by default ``hp-run`` puts hp-testing's cross-rank
checks under ``torch.distributed``, and they cost a few TCPStore round trips
and store polls per *call* (every ``isend``/``irecv``, every
``batch_isend_irecv``), far more than the transfer itself on this model.
Torch's schedules post a micro-batch's transfers as one ``batch_isend_irecv``
and ours post each operation on its own on gloo ([Note: direct p2p] in
``hp_pipeline.executor``), so under the checks the comparison measures the
number of calls the layer sees, not the libraries. The benchmark still runs
there, says so, and records the layer in its JSON (``config.layer``).

Both libraries train the same MLP (same weights, the same batch cut into the
same micro-batches) with the same schedule, in one run and in one process
group. Each schedule is named as torch names it and taken from each library's
``get_schedule_class``; the multi-stage ones run two stages per rank (loop or
V placement, as the class requires). Each library first runs ``--warmup`` untimed steps (the first step of
each learns shapes); then one step of each is checked against the other
(losses and every gradient, the largest difference is printed). The timed
part is ``--rounds`` rounds of ``--steps`` steps per library, the order of the
libraries alternating from round to round, so both see the same machine load.
Every step starts from a barrier with the gradients cleared (torch divides
``.grad`` in place at the end of a step, so accumulating would change its
work); a step's time is its slowest rank's, its CPU time the sum of every
rank's CPU time (all threads). Reported: the median step time per library,
``ratios`` = ours / torch of those medians (below 1.0: we are faster),
``paired_ratios`` = the median of the per-round ratios, and the same for CPU
time. Rank 0 prints a table, each schedule's simulated bubble against its
textbook formula, and as the last line one JSON object.

Timings on a machine with fewer cores than ranks (or shared with other jobs)
are noisy: the ranks take turns on the cores, so step time follows the total
CPU work and wake-ups rather than the pipeline's critical path. Alternating
per step and taking medians evens out slow drift, not bursts.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
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


def modules_of(schedule: Any) -> list[nn.Module]:
    stages = getattr(schedule, "_stages", None)  # ours: a dict; torch's multi-stage: a list
    if stages is None:
        stages = [schedule._stage]  # torch's single-stage
    elif isinstance(stages, dict):
        stages = list(stages.values())
    return [stage.submod for stage in stages]


def zero_grads(schedule: Any) -> None:
    for module in modules_of(schedule):
        for param in module.parameters():
            param.grad = None


def run_step(schedule: Any, first: bool, last: bool, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    if first:
        schedule.step(x, target=y if last else None, losses=losses if last else None)
    elif last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return losses


def timed_step(
    schedule: Any, first: bool, last: bool, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """One step from a common start (barrier): this rank's wall and CPU seconds (all its threads)."""
    zero_grads(schedule)  # same work every step for both libraries (torch divides .grad by m in place)
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    run_step(schedule, first, last, x, y)
    return time.perf_counter() - wall, time.process_time() - cpu


def check_same(schedules: dict[str, Any], first: bool, last: bool, x: torch.Tensor, y: torch.Tensor) -> float:
    """Both libraries on the same step: the largest difference of losses and gradients (over ranks)."""
    results = {}
    for lib, schedule in schedules.items():
        zero_grads(schedule)
        losses = run_step(schedule, first, last, x, y)
        grads = [p.grad.clone() for p in modules_of(schedule) for p in p.parameters() if p.grad is not None]
        results[lib] = (losses, grads)
    diff = 0.0
    (l_a, g_a), (l_b, g_b) = results["ours"], results["torch"]
    if len(l_a) != len(l_b) or len(g_a) != len(g_b):
        diff = float("inf")
    for a, b in zip([*l_a, *g_a], [*l_b, *g_b], strict=False):
        diff = max(diff, float((a.detach() - b.detach()).abs().max()))
    local = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local.item())


# Schedule name -> placement of its two stages per rank; the others run one stage per rank.
MULTI_STAGE = {
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
KINDS = ("1F1B", *MULTI_STAGE)


def build(lib: str, kind: str, layers: list[nn.Module], m: int) -> tuple[Any, bool, bool]:
    rank, p = dist.get_rank(), dist.get_world_size()
    style = MULTI_STAGE.get(kind)
    v = 1 if style is None else 2
    num_stages = v * p
    mine = [rank, 2 * p - 1 - rank] if style == "v" else [rank + j * p for j in range(v)]
    if lib == "ours":
        import hp_pipeline as hp

        stages: Any = [hp.PipelineStage(chunk(layers, s, num_stages), s, num_stages) for s in mine]
        cls: Any = hp.get_schedule_class(kind)
    else:
        from torch.distributed import pipelining as tp
        from torch.distributed.pipelining.schedules import get_schedule_class

        device = torch.device("cpu")
        stages = [tp.PipelineStage(chunk(layers, s, num_stages), s, num_stages, device) for s in mine]
        cls = get_schedule_class(kind)
    schedule = cls(stages[0] if v == 1 else stages, m, loss_fn)
    return schedule, 0 in mine, num_stages - 1 in mine


def bubbles(p: int, m: int) -> list[dict[str, Any]]:
    import hp_pipeline as hp

    rows = []
    unit = hp.StepCosts(forward=1, backward=1)
    split = hp.StepCosts(forward=1, backward=2, backward_input=1, backward_weight=1)
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
    # The schedules named after torch's (one chunk per step cost; formulas in the README).
    rows.append(
        {
            "schedule": "LoopedBFS v=2",
            "simulated": hp.simulate(hp.build_looped_bfs_order(p, m, 2), unit).bubble_overhead[0],
            "formula": Fraction(p - 1, 2 * m),
            "label": "overhead (p-1)/(v*m)",
        }
    )
    izb = hp.simulate(hp.build_interleaved_zero_bubble_order(p, m, 2), split)
    rows.append(
        {
            "schedule": "InterleavedZB (F=I=W)",
            "simulated": izb.idle_time[0],
            "formula": Fraction(p - 1),
            "label": "idle (p-1)(F+I-W)",
        }
    )
    if m >= 2 * p:
        joint = hp.StepCosts(forward=1, backward=2, backward_input=1, backward_weight=1, overlap_f_b=3)
        dpv = hp.simulate(hp.build_dualpipev_order(p, m), joint)
        rows.append(
            {
                "schedule": "DualPipeV (F&B=F+B)",
                "simulated": dpv.idle_time[0],
                "formula": Fraction((p - 1) * (3 + 2 - 3)),
                "label": "idle (PP/2-1)(F&B+B-3W)",
            }
        )
    return rows


def split_as_full(split: Any) -> Any:
    import hp_pipeline as hp

    return hp.StepCosts(forward=split.forward, backward=split.backward_input + split.backward_weight)


def measure(
    kind: str, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace
) -> dict[str, Any]:
    """Both libraries' schedules side by side; rounds alternate which one goes first."""
    schedules: dict[str, Any] = {}
    for lib in LIBS:
        schedules[lib], first, last = build(lib, kind, layers, args.microbatches)
    for _ in range(args.warmup):
        for lib in LIBS:
            zero_grads(schedules[lib])
            run_step(schedules[lib], first, last, x, y)
    max_diff = check_same(schedules, first, last, x, y)
    wall: dict[str, list[float]] = {lib: [] for lib in LIBS}
    cpu: dict[str, list[float]] = {lib: [] for lib in LIBS}
    for r in range(args.rounds):
        for lib in LIBS if r % 2 == 0 else LIBS[::-1]:
            for _ in range(args.steps):
                w, c = timed_step(schedules[lib], first, last, x, y)
                wall[lib].append(w)
                cpu[lib].append(c)
    row: dict[str, Any] = {"max_abs_diff": max_diff}
    per_step: dict[str, list[float]] = {}
    for lib in LIBS:
        # A step lasts until its slowest rank is done; the CPU it costs is every rank's together.
        w_t = torch.tensor(wall[lib], dtype=torch.float64)
        c_t = torch.tensor(cpu[lib], dtype=torch.float64)
        dist.all_reduce(w_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(c_t, op=dist.ReduceOp.SUM)
        per_step[lib], per_step[f"{lib}_cpu"] = w_t.tolist(), c_t.tolist()
        row[lib] = statistics.median(per_step[lib])
        row[f"{lib}_cpu"] = statistics.median(per_step[f"{lib}_cpu"])
    for key in ("", "_cpu"):  # step j of ours against step j of torch: the same round, the same load
        pairs = zip(per_step[f"ours{key}"], per_step[f"torch{key}"], strict=True)
        row[f"paired{key}"] = statistics.median(a / b for a, b in pairs)
    return row


LIBS = ("torch", "ours")


def harness_layer() -> str | None:
    """hp-testing's layer under ``torch.distributed``, when the launcher installed one (``hp-run``'s default).

    Its per-call checks would dominate both libraries' step times (see the
    module docstring), so the run reports it instead of timing it silently.
    """
    emulation = sys.modules.get("hp_testing.emulation")
    layer = None if emulation is None else emulation.active_layer()
    if layer is None:
        return None
    on = {True: "on", False: "off"}
    return f"{layer.profile.name}, checks {on[bool(layer.checks)]}, strict {on[bool(layer.strict)]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per library")
    parser.add_argument("--rounds", type=int, default=40, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per library and round")
    parser.add_argument(
        "--schedules",
        default=",".join(KINDS),
        help=f"comma-separated torch schedule names, from {','.join(KINDS)}",
    )
    args = parser.parse_args()
    kinds = [k.strip() for k in args.schedules.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"--schedules: unknown {unknown}; choose from {list(KINDS)}")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    layers = make_layers(2 * p, args.width)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    y = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(2))
    results = {kind: measure(kind, layers, x, y, args) for kind in kinds}
    layer = harness_layer()
    if rank == 0:
        n = args.rounds * args.steps
        print(f"pipeline step, {p} ranks (gloo, CPU), MLP {2 * p} x Linear({args.width}), ")
        print(
            f"batch {args.batch}, {args.microbatches} micro-batches; median of {n} steps per library "
            f"({args.rounds} alternating rounds of {args.steps}, after {args.warmup} warm-up steps)"
        )
        print("step ms: slowest rank, each step from a barrier; CPU ms: all ranks' CPU time per step;")
        print("paired: median over rounds of ours/torch within the round")
        if layer is not None:
            print(
                f"NOTE: hp-testing's layer is active ({layer}); its per-call store checks dominate these "
                "times. Run with hp-run --no-checks to time the libraries."
            )
        print(
            f"{'schedule':<22}{'torch ms':>10}{'ours ms':>10}{'ours/torch':>12}{'paired':>8}"
            f"{'torch CPU':>11}{'ours CPU':>10}{'CPU ratio':>11}{'paired':>8}{'max |diff|':>12}"
        )
        ratios, cpu_ratios, paired, paired_cpu = {}, {}, {}, {}
        for kind, row in results.items():
            ratio = row["ours"] / row["torch"]
            cpu_ratio = row["ours_cpu"] / row["torch_cpu"]
            ratios[f"Schedule{kind}"] = round(ratio, 4)
            cpu_ratios[f"Schedule{kind}"] = round(cpu_ratio, 4)
            paired[f"Schedule{kind}"] = round(row["paired"], 4)
            paired_cpu[f"Schedule{kind}"] = round(row["paired_cpu"], 4)
            print(
                f"{kind:<22}{row['torch'] * 1e3:>10.2f}{row['ours'] * 1e3:>10.2f}{ratio:>12.3f}"
                f"{row['paired']:>8.3f}{row['torch_cpu'] * 1e3:>11.2f}{row['ours_cpu'] * 1e3:>10.2f}"
                f"{cpu_ratio:>11.3f}{row['paired_cpu']:>8.3f}"
                f"{row['max_abs_diff']:>12.2e}"
            )
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
            "paired_ratios": paired,
            "cpu_ratios": cpu_ratios,
            "paired_cpu_ratios": paired_cpu,
            "step_ms": {k: {lib: round(row[lib] * 1e3, 3) for lib in LIBS} for k, row in results.items()},
            "cpu_ms": {
                k: {lib: round(row[f"{lib}_cpu"] * 1e3, 3) for lib in LIBS} for k, row in results.items()
            },
            "max_abs_diff": {k: row["max_abs_diff"] for k, row in results.items()},
            "bubbles": {
                row["schedule"]: {"simulated": str(row["simulated"]), "formula": str(row["formula"])}
                for row in rows
            },
            "config": {
                "ranks": p,
                "width": args.width,
                "batch": args.batch,
                "microbatches": args.microbatches,
                "warmup": args.warmup,
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "cores": os.cpu_count(),
                "layer": layer,
                "load_average": [round(v, 2) for v in os.getloadavg()],
            },
        }
        print(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""MPipe against plain 1F1B with the vision tower on stage 0, side by side in one run.

Run on CPU ranks over gloo (``hp-run`` or plain ``torchrun``):

    hp-run -n 4 benchmarks/mpipe_step.py [--width 512] [--batch 4096] [--layers 3] \\
        [--microbatches 32] [--steps 16] [--compute cpu|timed] [--forward-ms 2]

Two kinds of compute:

* ``cpu`` (default): real Linear+GELU layers, one compute thread per rank.
  Step time then follows the busiest rank's CPU only where every rank has a
  core of its own, and CPU effects that an accelerator does not have (gloo
  copying on the compute core, caches shared between ranks) take part;
* ``timed``: every text stage and the tower is one small real layer plus a
  timed wait (``--forward-ms``, twice that in backward) that occupies no core,
  as when an accelerator runs the kernels and the host waits. The tower then
  costs exactly one text stage, four ranks fit on a 2-core machine, and the
  measured ratio is the schedule's and the executor's, with real transfers,
  loading, autograd and Python overhead.

Two configurations, each printed with its own table:

* ``p = world size`` (4 with ``-n 4``): the issue's configuration;
* ``p = 2`` on ranks 0 and 1 only (the other ranks wait in a barrier).

Every rank runs one compute thread (``torch.set_num_threads(1)``) and, where
the machine has a physical core per rank, is pinned to cores of its own
(:func:`pin_rank`), so the step time is the pipeline's critical path, which
is what MPipe shortens. With ``cpu`` compute on a machine with fewer free
cores than ranks the ranks take turns on the cores and wall time follows the *total* work, which
MPipe does not reduce (it moves the tower's work off stage 0): balancing
cannot show there, and the table says so.

Each table puts the measured speedup (1F1B step time over MPipe step time)
next to the simulator's (``simulate()`` of the same orders with the tower
costing one text stage: ``F = PF = 1``, ``B = PB = 2``; and again with the
forward and backward times of one micro-batch through the tower and a
middle text stage, measured in the process, whose ratio shows how close the
tower is to "one text stage"), and the CPU time of each rank per step.
The defaults (128 rows per micro-batch, ``m = 8p`` micro-batches at
``p = 4``) keep each micro-batch's compute large against the fixed cost of
a gloo message and keep the pipeline's fill and drain (``(p-1)/m`` of the
step, the same for both schedules) from hiding the balance; with
``--batch 2048 --microbatches 16`` the 1F1B bubble is twice as large a share
of the step. The machine's load average is printed with each table: other
processes on the cores make wall times noisy.

The model is a toy vision-language model: a tower of ``--layers`` Linear+GELU
layers (about the cost of one text stage) turns each sample's pixels into one
feature vector; the text part is ``p`` stages of ``--layers`` layers each; the
last stage projects to a vocabulary and takes a token cross-entropy.

* anchor: ``Schedule1F1B``, stage 0's module runs the tower for every
  micro-batch, and every rank reads the whole batch from the dataset (the
  usual data loader in front of a pipeline);
* ours: ``ScheduleMPipe`` with in-schedule loading: micro-batch ``k``'s tower
  runs on rank ``k % p``, which alone reads it (``PPRankOwnedSampler``); stage
  0 and the last stage get only the ids / labels they need.

Both schedules are built side by side and, after warm-up, take turns for
``--steps`` rounds of one step each (the order flips every round), every step
started from a barrier and timed on its slowest rank. The headline ratio is
the median over rounds of MPipe's step time over the anchor's in the same
round (drift of the machine cancels); the medians of each are printed too.
The CPU time per step of each rank,
and of the busiest rank (the bottleneck once every rank has its own core or
device), is printed next to it. Bytes are counted in the dataset's
``__getitem__`` of each rank. Rank 0 prints a table, then as the last line one
JSON object whose ``ratios`` are ours over the anchor (below 1.0: MPipe wins).
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
from torch.utils.data import DataLoader, Dataset, SequentialSampler

VOCAB = 64


#: ``--compute timed``: (forward ms, backward ms) each text stage and the tower wait instead of
#: computing; ``None``: real CPU compute.
TIMED_MS: tuple[float, float] | None = None


class _Wait(torch.autograd.Function):
    """Identity whose forward and backward take a fixed time without using a core (a timed wait)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class Timed(nn.Module):
    """A stage's worth of work as an accelerator would run it: the host only waits for it."""

    def __init__(self, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(x, self.forward_s, self.backward_s)


def mlp(width: int, layers: int) -> nn.Sequential:
    if TIMED_MS is not None:  # one small real layer (real gradients) plus the stage's time
        return nn.Sequential(nn.Linear(width, width), Timed(*TIMED_MS))
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])


class Tower(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = mlp(width, layers)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.body(pixels)


class First(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.body = mlp(width, layers)

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(ids) + features)


class TowerOnStage0(nn.Module):
    """The anchor's stage 0: the tower inside the first stage."""

    def __init__(self, tower: Tower, first: nn.Module) -> None:
        super().__init__()
        self.tower, self.first = tower, first

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        return self.first(ids, self.tower(pixels))


class Last(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = mlp(width, layers)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(h))


class Samples(Dataset):
    """Synthetic samples; counts the bytes this process reads."""

    def __init__(self, n: int, width: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.pixels = torch.randn(n, width, generator=gen)
        self.ids = torch.randint(0, VOCAB, (n,), generator=gen)
        self.labels = torch.randint(0, VOCAB, (n,), generator=gen)
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        item = {"pixel_values": self.pixels[j], "input_ids": self.ids[j], "labels": self.labels[j]}
        self.bytes_read += sum(t.numel() * t.element_size() for t in item.values())
        return item


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels, reduction="sum")


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)


def build_modules(p: int, width: int, layers: int) -> tuple[Tower, list[nn.Module]]:
    torch.manual_seed(0)
    tower = Tower(width, layers)
    stages: list[nn.Module] = [
        First(width, layers),
        *[mlp(width, layers) for _ in range(p - 2)],
        Last(width, layers),
    ]
    return tower, stages


def build_plain(args: Any, data: Samples, tower: Tower, modules: list[nn.Module], group: Any) -> Any:
    """The anchor's one training step on this rank (1F1B, the tower inside stage 0)."""
    import hp_pipeline as hp

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    module = (
        TowerOnStage0(copy.deepcopy(tower), copy.deepcopy(modules[0]))
        if rank == 0
        else copy.deepcopy(modules[rank])
    )
    stage = hp.PipelineStage(module, rank, p, group=group)
    schedule = hp.Schedule1F1B(stage, args.microbatches, token_mean)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    loader = iter(DataLoader(data, batch_size=args.batch, sampler=SequentialSampler(data)))

    def one() -> None:
        batch = next(loader)  # every rank reads the whole batch
        opt.zero_grad()
        if rank == 0:
            schedule.step(batch["input_ids"], batch["pixel_values"])
        elif rank == p - 1:
            schedule.step(target=batch["labels"])
        else:
            schedule.step()
        opt.step()

    return one


def build_mpipe(args: Any, data: Samples, tower: Tower, modules: list[nn.Module], group: Any) -> Any:
    """MPipe's one training step on this rank (in-schedule loading, tower on the owners)."""
    import hp_pipeline as hp

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    my_tower = copy.deepcopy(tower)
    module = copy.deepcopy(modules[rank])
    schedule = hp.ScheduleMPipe(
        hp.PipelineStage(module, rank, p, group=group),
        args.microbatches,
        preprocess=my_tower,
        loss_fn=token_sum,
        in_schedule_loading=True,
        normalize_by_tokens=True,
    )
    opt = torch.optim.SGD([*module.parameters(), *my_tower.parameters()], lr=1e-3)
    mbs = args.batch // args.microbatches
    sampler = hp.PPRankOwnedSampler(SequentialSampler(data), schedule.owned_micros, mbs, args.microbatches)
    loader = iter(DataLoader(data, batch_size=mbs, sampler=sampler))

    def one() -> None:
        opt.zero_grad()
        schedule.step(data=loader)
        opt.step()

    return one


WARMUP = 3


def timed_rounds(
    steps: dict[str, Any], rounds: int, group: Any
) -> tuple[dict[str, list[float]], list[float]]:
    """Alternate the schedules step by step for ``rounds`` rounds (the order flips each round).

    Returns each schedule's wall time per round (the slowest rank's, each
    step started from a barrier) and this rank's CPU time per round. Both
    schedules live side by side, so drift of the machine hits both alike,
    and the per-round ratio pairs steps taken moments apart.
    """
    names = list(steps)
    for _ in range(WARMUP):
        for name in names:
            steps[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            dist.barrier(group)
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    slowest = {}
    for name in names:
        local = torch.tensor(wall[name], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        slowest[name] = local.tolist()
    return slowest, [statistics.median(cpu[name]) * 1e3 for name in names]


def gather(value: float, group: Any, dtype: torch.dtype = torch.int64) -> list[float]:
    out = [torch.zeros(1, dtype=dtype) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([value], dtype=dtype), group=group)
    return [t.item() for t in out]


def measured_costs(args: Any, reps: int = 20) -> dict[str, float]:
    """Median ms of one micro-batch's forward and backward through the tower and a middle text stage.

    Measured in this process with one thread; the middle stage's input needs
    its gradient (it is another stage's output), the tower's pixels do not.
    """
    torch.manual_seed(0)
    rows = args.batch // args.microbatches
    tower, stage = Tower(args.width, args.layers), mlp(args.width, args.layers)
    pixels = torch.randn(rows, args.width)
    hidden = torch.randn(rows, args.width, requires_grad=True)
    times: dict[str, list[float]] = {"F": [], "B": [], "PF": [], "PB": []}
    for k in range(reps + 3):
        for module, x, fwd, bwd in ((stage, hidden, "F", "B"), (tower, pixels, "PF", "PB")):
            start = time.perf_counter()
            out = module(x)
            mid = time.perf_counter()
            out.backward(torch.ones_like(out))
            end = time.perf_counter()
            if k >= 3:
                times[fwd].append((mid - start) * 1e3)
                times[bwd].append((end - mid) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def simulated_ratio(p: int, m: int, measured: dict[str, float] | None = None) -> float:
    """Makespan of the MPipe order over the tower-on-stage-0 order.

    The tower costs one text stage (``F=PF=1, B=PB=2``), or, with
    ``measured``, the costs :func:`measured_costs` found (every text stage
    costing what the middle one does).
    """
    import hp_pipeline as hp

    T = hp.MetaStepType
    if measured is None:
        costs = hp.StepCosts(forward=1, backward=2, preprocess_forward=1, preprocess_backward=2)
    else:
        costs = hp.StepCosts(
            forward=measured["F"],
            backward=measured["B"],
            preprocess_forward=measured["PF"],
            preprocess_backward=measured["PB"],
        )
    mpipe = hp.simulate(hp.mpipe_order(p, m), costs).makespan
    base = hp.build_1f1b_order(p, m)
    row0 = []
    for s in base[0]:
        if s.type is T.FWD:
            row0.append(hp.MetaStep(s.micro_index, T.PREPROCESS_FWD, 0))
        row0.append(s)
        if s.type is T.BWD:
            row0.append(hp.MetaStep(s.micro_index, T.PREPROCESS_BWD, 0))
    base[0] = row0
    plain = hp.simulate(hp.insert_comms(base), costs).makespan
    return float(mpipe / plain)


def free_cores() -> int:
    """Cores this process may run on (the affinity mask), the honest bound on parallel ranks."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def physical_cores() -> list[list[int]]:
    """This process's CPUs grouped by physical core (a core's hyper-threads together), from sysfs."""
    groups: dict[str, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                key = f.read().strip()
        except OSError:
            key = str(cpu)
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def pin_rank(rank: int, world: int) -> str:
    """Give each rank physical cores of its own (with their hyper-threads); say what was done.

    Two ranks on the two hyper-threads of one core run each other's compute
    at a fraction of the speed, which no schedule can fix and which varies
    from run to run; gloo's transfer threads, started later, stay on the
    rank's own cores too.
    """
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no CPU affinity on this OS)"
    cores = physical_cores()
    if len(cores) < world:
        return f"not pinned ({len(cores)} physical core(s) for {world} ranks)"
    mine = [cpu for k, core in enumerate(cores) if k % world == rank for cpu in core]
    os.sched_setaffinity(0, mine)
    return f"pinned: {len(cores) // world} physical core(s) of its own per rank"


FREE_CORES = free_cores()
PINNING = "not pinned"


def measure(args: Any, ranks: list[int], label: str) -> dict[str, Any] | None:
    """Run both schedules on the pipeline ``ranks`` (a new group; the other ranks skip) and report.

    Every rank of the world calls this (``new_group`` is collective); only
    ``ranks`` work, the others wait in the closing barrier. Returns the
    summary on the group's first rank, ``None`` elsewhere.
    """
    group = dist.new_group(ranks)
    summary = None
    if dist.get_rank() in ranks:
        rank, p = dist.get_rank(group), len(ranks)
        tower, modules = build_modules(p, args.width, args.layers)
        data = {name: Samples((args.steps + WARMUP) * args.batch, args.width) for name in ("plain", "mpipe")}
        steps = {
            "plain": build_plain(args, data["plain"], tower, modules, group),
            "mpipe": build_mpipe(args, data["mpipe"], tower, modules, group),
        }
        wall, my_cpu = timed_rounds(steps, args.steps, group)
        seconds = {name: statistics.median(times) for name, times in wall.items()}
        paired = statistics.median(m / a for m, a in zip(wall["mpipe"], wall["plain"], strict=True))
        bytes_read = {name: [int(b) for b in gather(d.bytes_read, group)] for name, d in data.items()}
        cpu_ms = {name: gather(my_cpu[k], group, torch.float64) for k, name in enumerate(steps)}
        if rank == 0:
            summary = report(args, p, label, seconds, paired, bytes_read, cpu_ms)
    dist.barrier()
    return summary


def report(
    args: Any,
    p: int,
    label: str,
    seconds: dict[str, float],
    paired: float,
    bytes_read: dict[str, list[int]],
    cpu_ms: dict[str, list[float]],
) -> dict[str, Any]:
    """Print one configuration's table; return its figures for the JSON line.

    The headline ratio is ``paired``, the median over rounds of MPipe's step
    time over the anchor's in the same round; the ratio of the two medians
    is printed beside it.
    """
    sim = simulated_ratio(p, args.microbatches)
    costs = measured_costs(args)
    sim_measured = simulated_ratio(p, args.microbatches, costs)
    tower_share = (costs["PF"] + costs["PB"]) / (costs["F"] + costs["B"])
    ratio = paired
    read_ratio = sum(bytes_read["mpipe"]) / sum(bytes_read["plain"])
    cores = FREE_CORES
    print()
    print(f"== {label}: {p} ranks on {cores} free core(s), 1 thread per rank ", end="")
    if TIMED_MS is not None:
        f_ms, b_ms = TIMED_MS
        print(f"(timed compute: F {f_ms} ms, B {b_ms} ms per stage and the tower; ranks wait, not compute)")
    else:
        print("(oversubscribed: wall time ~ total work)" if p > cores else "(a core per rank)")
    print(f"CPU placement: {PINNING}")
    print(
        f"width {args.width}, {args.layers} layers per text stage and in the tower, batch {args.batch}, ",
        end="",
    )
    print(f"{args.microbatches} micro-batches, {args.steps} rounds of one step each, alternating")
    print(f"{'':<34}{'1F1B, tower on stage 0':>24}{'MPipe':>12}{'MPipe/1F1B':>12}")
    plain_ms, mpipe_ms = seconds["plain"] * 1e3, seconds["mpipe"] * 1e3
    print(f"{'step time, median (ms)':<34}{plain_ms:>24.2f}{mpipe_ms:>12.2f}{mpipe_ms / plain_ms:>12.3f}")
    print(f"{'step time, paired ratio (median)':<34}{'':>24}{'':>12}{ratio:>12.3f}")
    for r in range(p):
        a_ms, b_ms = cpu_ms["plain"][r], cpu_ms["mpipe"][r]
        print(f"{f'CPU time per step, rank {r} (ms)':<34}{a_ms:>24.2f}{b_ms:>12.2f}{b_ms / a_ms:>12.3f}")
    busiest = max(cpu_ms["mpipe"]) / max(cpu_ms["plain"])
    top_plain, top_mpipe = max(cpu_ms["plain"]), max(cpu_ms["mpipe"])
    print(f"{'CPU time of the busiest rank':<34}{top_plain:>24.2f}{top_mpipe:>12.2f}{busiest:>12.3f}")
    for r in range(p):
        a, b = bytes_read["plain"][r], bytes_read["mpipe"][r]
        print(f"{f'dataset bytes read, rank {r}':<34}{a:>24}{b:>12}{b / a:>12.3f}")
    a, b = sum(bytes_read["plain"]), sum(bytes_read["mpipe"])
    print(f"{'dataset bytes read, all ranks':<34}{a:>24}{b:>12}{read_ratio:>12.3f}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average (1 min) at the end: {load:.1f} on {os.cpu_count()} core(s)")
    print(f"{'simulated makespan (tower = F)':<34}{'':>24}{'':>12}{sim:>12.3f}")
    shown = ", ".join(f"{k} {v:.2f}" for k, v in costs.items())
    print(f"one micro-batch, measured (ms): {shown}; tower / text stage = {tower_share:.2f}")
    print(f"{'simulated makespan (those costs)':<34}{'':>24}{'':>12}{sim_measured:>12.3f}")
    print(
        f"speedup of MPipe over 1F1B: measured {1 / ratio:.2f}x, simulated {1 / sim:.2f}x "
        f"(tower = one stage) / {1 / sim_measured:.2f}x (measured costs), aim >= 1.30x"
    )
    return {
        "ranks": p,
        "free_cores": cores,
        "cpu_placement": PINNING,
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "step_time_ratio": round(ratio, 4),
        "step_time_ratio_of_medians": round(seconds["mpipe"] / seconds["plain"], 4),
        "bytes_read_ratio": round(read_ratio, 4),
        "busiest_rank_cpu_time_ratio": round(busiest, 4),
        "simulated_makespan_ratio": round(sim, 4),
        "simulated_makespan_ratio_measured_costs": round(sim_measured, 4),
        "micro_batch_costs_ms": {k: round(v, 3) for k, v in costs.items()},
        "tower_over_text_stage": round(tower_share, 3),
        "measured_speedup": round(1 / ratio, 3),
        "simulated_speedup": round(1 / sim, 3),
        "step_ms": {k: round(v * 1e3, 3) for k, v in seconds.items()},
        "cpu_ms_per_rank": {k: [round(x, 3) for x in v] for k, v in cpu_ms.items()},
        "bytes_read_per_rank": bytes_read,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--compute",
        choices=("cpu", "timed"),
        default="cpu",
        help="cpu: real compute, one core per rank; timed: each stage and the tower wait "
        "--forward-ms / twice that in backward instead (as on an accelerator; cores are not the limit)",
    )
    parser.add_argument("--forward-ms", type=float, default=2.0)
    args = parser.parse_args()
    global PINNING, TIMED_MS
    if args.compute == "timed":
        TIMED_MS = (args.forward_ms, 2 * args.forward_ms)
        args.width, args.layers = min(args.width, 64), 1
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    PINNING = pin_rank(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))), world_env)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one compute thread per rank: ranks = cores needed
    world = dist.get_world_size()
    if world < 2:
        raise SystemExit("run on 2 or more ranks: hp-run -n 4 benchmarks/mpipe_step.py")
    configs: list[tuple[str, list[int]]] = []
    if world > 2:
        configs.append((f"{world} ranks (the issue's configuration)", list(range(world))))
    configs.append(("2 ranks, a core each", [0, 1]))
    results = {}
    for label, ranks in configs:
        summary = measure(args, ranks, label)
        if summary is not None:
            results[f"p{len(ranks)}{'_timed' if TIMED_MS else ''}"] = summary
    if dist.get_rank() == 0:
        main_key = f"p{world if world > 2 else 2}{'_timed' if TIMED_MS else ''}"
        out = {
            "benchmark": "mpipe_step",
            "ratios": {
                f"Schedule1F1B_tower_on_stage0_{key}_{what}": value[field]
                for key, value in results.items()
                for what, field in (
                    ("step_time", "step_time_ratio"),
                    ("bytes_read", "bytes_read_ratio"),
                    ("busiest_rank_cpu_time", "busiest_rank_cpu_time_ratio"),
                )
            },
            "headline": main_key,
            "configs": results,
            "config": {
                "world": world,
                "width": args.width,
                "layers": args.layers,
                "batch": args.batch,
                "microbatches": args.microbatches,
                "steps": args.steps,
                "compute": args.compute,
                "timed_ms": list(TIMED_MS) if TIMED_MS else None,
            },
        }
        print(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

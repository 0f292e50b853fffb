"""MPipe against plain 1F1B with the vision tower on stage 0, side by side in one run.

Run on 4 CPU ranks over gloo:

    hp-run -n 4 benchmarks/mpipe_step.py [--width 384] [--batch 256] [--layers 3] \\
        [--microbatches 8] [--steps 8]

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

Step time is the median over ``--steps`` steps after warm-up, the maximum over
ranks, best of two alternating rounds. With fewer free cores than ranks (a
shared laptop) the ranks take turns on the cores and wall time measures the
total work, not the pipeline's critical path; the CPU time per step of each
rank, and of the busiest rank (the bottleneck once every rank has its own
core or device), is printed next to it, with the simulator's makespan ratio
for the same shapes (tower cost = one text stage). Bytes are counted in the dataset's
``__getitem__`` of each rank. Rank 0 prints a table, then as the last line one
JSON object whose ``ratios`` are ours over the anchor (below 1.0: MPipe wins).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler

VOCAB = 64


def mlp(width: int, layers: int) -> nn.Sequential:
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

    def __init__(self, tower: Tower, first: First) -> None:
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


def run_plain(args: Any, data: Samples, tower: Tower, modules: list[nn.Module], steps: int) -> float:
    import hp_pipeline as hp

    rank, p = dist.get_rank(), dist.get_world_size()
    module = (
        TowerOnStage0(copy.deepcopy(tower), copy.deepcopy(modules[0]))
        if rank == 0
        else copy.deepcopy(modules[rank])
    )
    schedule = hp.Schedule1F1B(hp.PipelineStage(module, rank, p), args.microbatches, token_mean)
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

    return timed(one, steps)


def run_mpipe(args: Any, data: Samples, tower: Tower, modules: list[nn.Module], steps: int) -> float:
    import hp_pipeline as hp

    rank, p = dist.get_rank(), dist.get_world_size()
    my_tower = copy.deepcopy(tower)
    module = copy.deepcopy(modules[rank])
    schedule = hp.ScheduleMPipe(
        hp.PipelineStage(module, rank, p),
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

    return timed(one, steps)


def timed(one: Any, steps: int) -> float:
    """Median wall time of a step (max over ranks); records this rank's median CPU time too."""
    for _ in range(3):
        one()
    times, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        one()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    CPU_MS.append(statistics.median(cpu) * 1e3)
    local = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local.item())


CPU_MS: list[float] = []


def gather(value: int) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64))
    return [int(t.item()) for t in out]


def simulated_ratio(p: int, m: int) -> float:
    """Makespan of the MPipe order over the tower-on-stage-0 order, tower = one text stage (F=1, B=2)."""
    import hp_pipeline as hp

    T = hp.MetaStepType
    costs = hp.StepCosts(forward=1, backward=2, preprocess_forward=1, preprocess_backward=2)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    if p < 2:
        raise SystemExit("run on 2 or more ranks: hp-run -n 4 benchmarks/mpipe_step.py")
    tower, modules = build_modules(p, args.width, args.layers)
    total_steps = 2 * (args.steps + 3)
    seconds: dict[str, float] = {}
    bytes_read: dict[str, list[int]] = {}
    cpu_ms: dict[str, list[float]] = {}
    for name in ("plain", "mpipe", "plain", "mpipe"):  # alternate to even out drift
        data = Samples(total_steps * args.batch, args.width)
        runner = run_plain if name == "plain" else run_mpipe
        t = runner(args, data, tower, modules, args.steps)
        seconds[name] = min(seconds.get(name, t), t)
        bytes_read[name] = gather(data.bytes_read)
        cpu = [torch.zeros(1, dtype=torch.float64) for _ in range(p)]
        dist.all_gather(cpu, torch.tensor([CPU_MS[-1]], dtype=torch.float64))
        row = [float(c.item()) for c in cpu]
        best = cpu_ms.get(name, row)
        cpu_ms[name] = [min(a, b) for a, b in zip(best, row, strict=True)]
    if rank == 0:
        sim = simulated_ratio(p, args.microbatches)
        ratio = seconds["mpipe"] / seconds["plain"]
        read_ratio = sum(bytes_read["mpipe"]) / sum(bytes_read["plain"])
        print(f"MPipe step, {p} ranks (gloo, CPU), width {args.width}, {args.layers} layers per text stage")
        print(f"and in the tower, batch {args.batch}, {args.microbatches} micro-batches, ", end="")
        print(f"median of {args.steps} steps")
        print(f"{'':<34}{'1F1B, tower on stage 0':>24}{'MPipe':>12}{'MPipe/1F1B':>12}")
        plain_ms, mpipe_ms = seconds["plain"] * 1e3, seconds["mpipe"] * 1e3
        print(f"{'step time (ms)':<34}{plain_ms:>24.2f}{mpipe_ms:>12.2f}{ratio:>12.3f}")
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
        print(f"{'simulated makespan (tower = F)':<34}{'':>24}{'':>12}{sim:>12.3f}")
        summary = {
            "benchmark": "mpipe_step",
            "ratios": {
                "Schedule1F1B_tower_on_stage0_step_time": round(ratio, 4),
                "Schedule1F1B_tower_on_stage0_bytes_read": round(read_ratio, 4),
                "Schedule1F1B_tower_on_stage0_busiest_rank_cpu_time": round(busiest, 4),
            },
            "cpu_ms_per_rank": {k: [round(x, 3) for x in v] for k, v in cpu_ms.items()},
            "step_ms": {k: round(v * 1e3, 3) for k, v in seconds.items()},
            "bytes_read_per_rank": bytes_read,
            "simulated_makespan_ratio": round(sim, 4),
            "config": {
                "ranks": p,
                "width": args.width,
                "layers": args.layers,
                "batch": args.batch,
                "microbatches": args.microbatches,
                "steps": args.steps,
            },
        }
        print(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

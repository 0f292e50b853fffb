"""The main job's multimodal variant: a vision tower and a text decoder, ScheduleMPipe against 1F1B.

Run by ``bash scripts/demo.sh --mpipe`` (4 emulated ranks), or by hand:

    hp-run -n 4 --emulate nccl examples/multimodal_mpipe.py --steps 6 --out demo-out

or under plain ``torchrun --nproc-per-node 4`` on CPU ranks (gloo). Everything stays on the CPU,
as in ``examples/mpipe.py``: on GPUs the modules, the data and the small report tensors would
have to move to the device first. The model is a tiny vision-language
model: a vision tower (patch embedding, a residual MLP block, a projection)
turns each image into one feature vector per patch, which goes in front of the
caption's tokens of a text decoder made of the main job's Llama blocks, split
into one pipeline stage per rank. It is trained twice in the same run, from the
same initial weights on the same data, the two taking turns step by step:

- ``ScheduleMPipe`` with in-schedule loading: micro-batch ``k``'s owner rank
  reads it from the dataset (``PPRankOwnedSampler``), runs the tower on it and
  sends the features to stage 0; the ids go to stage 0, the labels to the last
  stage. Every sample is read once in all, and the tower's work is spread
  over the ranks instead of piling up on stage 0;
- the anchor: ``Schedule1F1B`` with the tower inside stage 0, every rank
  reading the whole batch (the usual data loader in front of a pipeline).

Each is checked against one process (every rank trains the same model on the
whole batch): the loss of every step and, at the end, the largest parameter
difference, in float64 so that agreement is exact to rounding. The script
prints a line per step, then a table of the median step times, their ratio,
the dataset bytes each rank read, the point-to-point sends and the CPU time
per step, and exits non-zero when either run
disagrees with one process. It writes MPipe's order as an SVG timeline.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from example_common import Block as MLPBlock
from example_common import finish
from hp_core import init_distributed
from hp_pipeline import (
    MetaStep,
    PipelineStage,
    PPRankOwnedSampler,
    Schedule1F1B,
    ScheduleMPipe,
    render_order,
)
from llama_3d import Config
from llama_3d import Stage as LlamaStage
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler

# -- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Square one-channel images cut into square patches, and the decoder's size (the main job's
    ``Config``, smaller: one block per stage)."""

    image: int = 8
    patch: int = 4
    text: Config = field(
        default_factory=lambda: Config(vocab=32, dim=16, heads=2, kv_heads=1, hidden=32, seq=8)
    )

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


class VisionTower(nn.Module):
    """Images (batch, H, W) -> one feature per patch (batch, patches, dim), in the decoder's width."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.patch = s.patch
        self.embed = nn.Linear(s.patch * s.patch, s.text.dim)  # the patch embedding
        self.pos = nn.Parameter(0.02 * torch.randn(s.patches, s.text.dim))
        self.block = MLPBlock(s.text.dim)
        self.proj = nn.Linear(s.text.dim, s.text.dim)  # the projector into the decoder (as in LLaVA)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, h, w = images.shape
        p = self.patch
        patches = images.reshape(b, h // p, p, w // p, p).transpose(2, 3).reshape(b, -1, p * p)
        return self.proj(self.block(self.embed(patches) + self.pos))


class TextStage(LlamaStage):
    """A slice of the main job's decoder. Stage 0 is called as ``module(ids, features)`` (the image
    features go in front of the tokens); the last stage predicts on the text positions only."""

    def __init__(self, s: Sizes, layers: int, first: bool, last: bool) -> None:
        super().__init__(s.text, layers, first, last)
        self.image_positions = s.patches

    def forward(self, h: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            if features is None:
                raise ValueError("the first text stage is called as module(ids, features): no features given")
            h = torch.cat([features, self.embed(h)], dim=1)
        for block in self.blocks:
            h = block(h)
        if self.norm is not None and self.head is not None:
            h = self.head(self.norm(h[:, self.image_positions :]))
        return h


class TowerOnStage0(nn.Module):
    """The anchor's stage 0: the tower runs inside the first stage, for every micro-batch."""

    def __init__(self, tower: VisionTower, first: TextStage) -> None:
        super().__init__()
        self.tower, self.first = tower, first

    def forward(self, ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        return self.first(ids, self.tower(images))


def build(s: Sizes, num_stages: int) -> tuple[VisionTower, list[TextStage]]:
    """The tower and ``num_stages`` decoder stages, the same on every rank (seeded), in float64:
    the parallel runs and the single process then agree to rounding, through AdamW too (a
    float32 difference of 1e-7 can flip the sign of an early AdamW update)."""
    torch.manual_seed(0)
    tower = VisionTower(s).double()
    return tower, [TextStage(s, 1, k == 0, k == num_stages - 1).double() for k in range(num_stages)]


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """MPipe's loss with ``normalize_by_tokens``: summed over tokens; the schedule divides by the
    number of labelled tokens of the whole batch, so the gradient is that of the batch's mean."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1F1B's and the single process's loss: the mean over the (micro-)batch's tokens. Every
    micro-batch has as many tokens, so 1F1B's mean of the micro-batch means is the batch's mean."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


# -- the data -------------------------------------------------------------------------------


class ImageCaptions(Dataset):
    """Synthetic image-caption pairs with something to learn: each caption counts up from a random
    token by a stride of 1 to 3, and the image's brightness shows the stride. ``bytes_read`` counts
    what this process took from the dataset (``__getitem__``), the figure MPipe's loading cuts."""

    def __init__(self, n: int, s: Sizes) -> None:
        gen = torch.Generator().manual_seed(7)
        start = torch.randint(0, s.text.vocab, (n, 1), generator=gen)
        stride = torch.randint(1, 4, (n, 1), generator=gen)
        tokens = (start + stride * torch.arange(s.text.seq + 1)) % s.text.vocab
        noise = torch.rand(n, s.image, s.image, generator=gen, dtype=torch.float64)
        self.pixel_values = 0.5 * noise + stride[:, :, None] / 3
        self.input_ids, self.labels = tokens[:, :-1], tokens[:, 1:]
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        item = {"pixel_values": self.pixel_values[j], "input_ids": self.input_ids[j]}
        item["labels"] = self.labels[j]
        self.bytes_read += sum(t.numel() * t.element_size() for t in item.values())
        return item


# -- the two runs ---------------------------------------------------------------------------


@dataclass
class Args:
    """What a run takes; the defaults are the demo's (16 samples in 8 micro-batches: two per rank
    at 4 ranks, so every rank owns and reads some under MPipe)."""

    steps: int = 6
    batch: int = 16
    microbatches: int = 8
    lr: float = 1e-2
    out: str = "demo-out"


@dataclass
class Run:
    """One schedule's training: its step on this rank, the data it read, its modules to compare."""

    name: str
    step: Callable[[], float | None]  # returns the step's loss on the last stage's rank, else None
    data: ImageCaptions
    pairs: list[tuple[nn.Module, nn.Module]]  # (ours, the single process's) on this rank
    sends: int  # point-to-point sends per step over all ranks, from the schedule's order
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # each step's wall time on the slowest rank
    cpu_seconds: list[float] = field(default_factory=list)  # each step's CPU time on this rank


def mpipe_run(
    args: Args, s: Sizes, tower: VisionTower, stages: list[TextStage], ref: list[nn.Module]
) -> tuple[Run, ScheduleMPipe]:
    """ScheduleMPipe with in-schedule loading: each rank reads only the micro-batches it owns."""
    rank, p = dist.get_rank(), dist.get_world_size()
    my_tower, module = copy.deepcopy(tower), copy.deepcopy(stages[rank])
    schedule = ScheduleMPipe(
        PipelineStage(module, rank, p),
        args.microbatches,
        preprocess=my_tower,  # a replica on every rank, its gradients summed over them each step
        loss_fn=token_sum,
        in_schedule_loading=True,  # reads "pixel_values", "input_ids", "labels" from data=
        normalize_by_tokens=True,
    )
    opt = torch.optim.AdamW([*module.parameters(), *my_tower.parameters()], lr=args.lr)
    data = ImageCaptions(args.steps * args.batch, s)
    per_micro = args.batch // args.microbatches
    sampler = PPRankOwnedSampler(
        SequentialSampler(data), schedule.owned_micros, per_micro, args.microbatches, num_steps=args.steps
    )
    loader = iter(DataLoader(data, batch_size=per_micro, sampler=sampler))

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        schedule.step(data=loader, losses=losses)  # reads this step's owned micro-batches from loader
        opt.step()
        opt.zero_grad()
        return float(torch.stack(losses).sum()) if losses else None  # already divided by the tokens

    pairs: list[tuple[nn.Module, nn.Module]] = [(module, ref[rank + 1]), (my_tower, ref[0])]
    return Run("MPipe", step, data, pairs, count_sends(schedule.order)), schedule


def anchor_run(
    args: Args, s: Sizes, tower: VisionTower, stages: list[TextStage], ref: list[nn.Module]
) -> Run:
    """Schedule1F1B with the tower inside stage 0; every rank reads the whole batch."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stage = copy.deepcopy(stages[rank])
    module: nn.Module = stage
    pairs: list[tuple[nn.Module, nn.Module]] = [(stage, ref[rank + 1])]
    if rank == 0:
        module = TowerOnStage0(copy.deepcopy(tower), stage)
        pairs.append((module.tower, ref[0]))
    schedule = Schedule1F1B(PipelineStage(module, rank, p), args.microbatches, token_mean)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    data = ImageCaptions(args.steps * args.batch, s)
    loader = iter(DataLoader(data, batch_size=args.batch, sampler=SequentialSampler(data)))

    def step() -> float | None:
        batch = next(loader)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(batch["input_ids"], batch["pixel_values"])
        else:
            schedule.step(target=batch["labels"] if rank == p - 1 else None, losses=losses)
        opt.step()
        opt.zero_grad()
        return float(torch.stack(losses).mean()) if losses else None

    return Run("1F1B", step, data, pairs, count_sends(schedule.order))


def count_sends(order: Mapping[int, Sequence[MetaStep]]) -> int:
    """The point-to-point sends of one step over all ranks: activations and gradients, and under
    MPipe also the features, their gradients and the loaded data (``*_SEND`` steps)."""
    return sum(step.type.name.endswith("_SEND") for steps in order.values() for step in steps)


class Reference:
    """The same model in one process on the whole batch, on every rank (it is tiny): each rank
    then compares its own modules with it, without sending parameters around."""

    def __init__(self, args: Args, s: Sizes, tower: VisionTower, stages: list[TextStage]) -> None:
        self.modules: list[nn.Module] = [copy.deepcopy(tower), *copy.deepcopy(stages)]
        self.opt = torch.optim.AdamW([q for m in self.modules for q in m.parameters()], lr=args.lr)
        self.data, self.batch = ImageCaptions(args.steps * args.batch, s), args.batch

    def step(self, k: int) -> float:
        rows = slice(k * self.batch, (k + 1) * self.batch)  # straight from the tensors: not counted
        tower, first, *rest = self.modules
        h = first(self.data.input_ids[rows], tower(self.data.pixel_values[rows]))
        for module in rest:
            h = module(h)
        loss = token_mean(h, self.data.labels[rows])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())


def train(args: Args, s: Sizes = Sizes()) -> dict[str, Any]:  # noqa: B008 - frozen sizes
    """Train under both schedules, taking turns step by step, and one process; returns the figures.

    Every step of each schedule starts from a barrier and is timed on its slowest rank. The
    result (the same on every rank) holds, per schedule, the loss and time of every step, the
    dataset bytes each rank read, the sends and CPU time per step and the largest loss and
    parameter differences to one process.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    if p < 2:
        raise ValueError("multimodal_mpipe.py pipelines the decoder over the ranks: start 2 or more")
    if args.batch % args.microbatches or args.microbatches < p:
        raise ValueError(
            f"--batch {args.batch} must split into --microbatches {args.microbatches} equal micro-batches, "
            f"at least one per rank ({p}) so that every rank reads some; try --batch {4 * p} "
            f"--microbatches {2 * p}"
        )
    tower, stages = build(s, p)
    reference = Reference(args, s, tower, stages)
    mpipe, schedule = mpipe_run(args, s, tower, stages, reference.modules)
    runs = [mpipe, anchor_run(args, s, tower, stages, reference.modules)]
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        title = f"ScheduleMPipe, p={p}, m={args.microbatches}, in-schedule loading (PF/PB: the tower)"
        timeline = render_order(schedule.order, out / "timeline-mpipe.svg", title=title)
        legend = "F/B: a text stage, PF/PB: the tower, on the micro-batch's owner; reads and sends not drawn"
        print(f"MPipe's order, simulated ({legend}):\n{timeline}")
    owners: list[Any] = [None] * p
    dist.all_gather_object(owners, list(schedule.owned_micros))
    if rank == 0:
        shown = ", ".join(f"rank {r}: {owned}" for r, owned in enumerate(owners))
        print(f"micro-batches each rank reads and runs the tower for under MPipe: {shown}")
    ref_losses: list[float] = []
    for k in range(args.steps):
        for run in runs if k % 2 == 0 else runs[::-1]:  # turns: drift of the machine hits both alike
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = run.step()
            run.seconds.append(time.perf_counter() - start)
            run.cpu_seconds.append(time.process_time() - start_cpu)
            run.losses.append(float("nan") if loss is None else loss)
        ref_losses.append(reference.step(k))
        # the losses are known on the last rank and each rank knows its own time: one small reduce
        mine = [[run.losses[-1] if rank == p - 1 else 0.0, run.seconds[-1]] for run in runs]
        shared = torch.tensor(mine, dtype=torch.float64)  # float64: the losses are compared to 1e-9
        summed, slowest = shared[:, 0].clone(), shared[:, 1].clone()
        dist.all_reduce(summed)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        for j, run in enumerate(runs):
            run.losses[-1], run.seconds[-1] = float(summed[j]), float(slowest[j])
        if rank == 0:
            line = f"step {k + 1:>2} | one process {ref_losses[-1]:.6f}"
            for run in runs:
                line += f" | {run.name} {run.losses[-1]:.6f} ({1e3 * run.seconds[-1]:5.0f} ms)"
            print(line, flush=True)
    result: dict[str, Any] = {"ranks": p, "reference": ref_losses, "args": asdict(args), "owners": owners}
    for run in runs:
        with torch.no_grad():
            local = largest(
                float((a - b).abs().max())
                for ours, theirs in run.pairs
                for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
            )
        worst = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        result[run.name] = {
            "loss": run.losses,
            "step_s": run.seconds,
            "cpu_s_per_rank": per_rank(statistics.median(run.cpu_seconds)),
            "bytes_read": [int(b) for b in per_rank(run.data.bytes_read)],
            "sends_per_step": run.sends,
            "max_param_diff": float(worst),
            "max_loss_diff": largest(abs(a - b) for a, b in zip(run.losses, ref_losses, strict=True)),
        }
    return result


def per_rank(value: float) -> list[float]:
    """Every rank's ``value``, in rank order, on every rank (float64 holds byte counts exactly)."""
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64))
    return [float(t) for t in out]


def largest(values: Iterable[float]) -> float:
    """The maximum, NaN if any value is NaN (Python's ``max`` can drop a NaN, and a NaN must fail
    the parity check, never pass it)."""
    return float(torch.tensor(list(values), dtype=torch.float64).max())


# -- the report -----------------------------------------------------------------------------


SCHEDULES = ("MPipe", "1F1B")


def worst_difference(result: dict[str, Any]) -> float:
    """The largest loss or parameter difference to one process over both schedules."""
    return largest(result[name][key] for name in SCHEDULES for key in ("max_loss_diff", "max_param_diff"))


def row(label: str, anchor: float, mpipe: float, fmt: str = "") -> None:
    """One line of the table: the anchor's figure, MPipe's, and MPipe's over the anchor's."""
    print(f"{label:<34}{anchor:>24{fmt}}{mpipe:>12{fmt}}{mpipe / anchor:>12.3f}")


def report(result: dict[str, Any]) -> None:
    """The comparison table (rank 0): median step time and the ratio, dataset bytes per rank,
    point-to-point sends and CPU time per step, and the parity figures."""
    mpipe, anchor = (result[name] for name in SCHEDULES)
    p = result["ranks"]
    print()
    print(f"{'':<34}{'1F1B, tower on stage 0':>24}{'MPipe':>12}{'MPipe/1F1B':>12}")
    a_ms, m_ms = (1e3 * statistics.median(r["step_s"]) for r in (anchor, mpipe))
    row("step time, median (ms)", a_ms, m_ms, ".1f")
    for r in range(p):
        row(f"dataset bytes read, rank {r}", anchor["bytes_read"][r], mpipe["bytes_read"][r])
    row("dataset bytes read, all ranks", sum(anchor["bytes_read"]), sum(mpipe["bytes_read"]))
    row("point-to-point sends per step", anchor["sends_per_step"], mpipe["sends_per_step"])
    cpu_a, cpu_m = (1e3 * torch.tensor(r["cpu_s_per_rank"]) for r in (anchor, mpipe))
    row("CPU time per step, all ranks (ms)", float(cpu_a.sum()), float(cpu_m.sum()), ".1f")
    row("CPU time per step, busiest rank", float(cpu_a.max()), float(cpu_m.max()), ".1f")
    for key, what in (("max_loss_diff", "loss"), ("max_param_diff", "param.")):
        print(f"{f'max {what} diff. to one process':<34}{anchor[key]:>24.1e}{mpipe[key]:>12.1e}")
    # [Why the step times are not the point here] MPipe shortens the critical path by taking the
    # tower off stage 0; it adds messages (features and their gradients, the data, the tower's
    # gradient sum). At this size those fixed costs weigh more than the tower's compute, and ranks
    # sharing cores make wall time follow the total work, which MPipe does not cut.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    shared = f"; {p} ranks share {cores} core(s), so wall time follows the total work" if p > cores else ""
    print(
        f"note: a toy model: per-message and Python costs outweigh the tower's compute{shared}. "
        "benchmarks/mpipe_step.py measures the schedules where compute dominates"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=Args.steps)
    parser.add_argument("--batch", type=int, default=Args.batch, help="samples per step")
    parser.add_argument("--microbatches", type=int, default=Args.microbatches)
    parser.add_argument("--lr", type=float, default=Args.lr)
    parser.add_argument("--out", default=Args.out, help="where timeline-mpipe.svg and mpipe.json go")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    ns = parser.parse_args()
    args = Args(steps=ns.steps, batch=ns.batch, microbatches=ns.microbatches, lr=ns.lr, out=ns.out)
    torch.set_num_threads(1)  # one compute thread per rank: the ranks share the cores
    init_distributed()
    result = train(args)
    if dist.get_rank() == 0:
        report(result)
        path = Path(args.out) / "mpipe.json"
        path.write_text(json.dumps(result))
        print(f"wrote {path} and {Path(args.out) / 'timeline-mpipe.svg'}", flush=True)
    finish(worst_difference(result), ns.tolerance, f"MPipe and 1F1B over {result['ranks']} ranks")


if __name__ == "__main__":
    main()

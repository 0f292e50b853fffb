"""Pipeline parallelism: ``PipelineStage`` and a schedule picked by name; checked against one process.

Run on 2 local CPU ranks:   hp-run -n 2 examples/pipeline.py --schedule 1F1B
or on a cluster, unchanged: torchrun --nproc-per-node 2 examples/pipeline.py --schedule ZBVZeroBubble

``--schedule`` takes torch's names (``hp_pipeline.get_schedule_class``): 1F1B,
GPipe and ZeroBubble run one stage per rank; Interleaved1F1B, LoopedBFS and
InterleavedZeroBubble two per rank in a loop (rank r holds r and r + p);
ZBVZeroBubble and DualPipeV two per rank in a V (rank r holds r and 2p - 1 - r,
so rank 0 has both the first and the last stage). The model is cut into one
chunk per stage; each step splits the batch into micro-batches, the last stage
computes the loss of each and the schedule runs the backwards. Gradients are
scaled by 1 / micro-batches, so they equal the whole batch's mean-loss
gradients of the same model in one process. Several names separated by commas
run one after another in the same launch (each from the same initial model).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from example_common import Block, finish
from hp_core import init_distributed
from hp_pipeline import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
    stages_on_rank,
)
from torch import nn


def build(dim: int, num_stages: int) -> nn.Sequential:
    """One block per stage; the last stage also holds the head."""
    torch.manual_seed(0)  # the same initial weights on every rank
    chunks = [Block(dim) for _ in range(num_stages - 1)]
    return nn.Sequential(*chunks, nn.Sequential(Block(dim), nn.Linear(dim, 1)))


def train(name: str, args: argparse.Namespace) -> float:
    """A few steps under the schedule called ``name``; returns the largest difference to one process."""
    rank, p = dist.get_rank(), dist.get_world_size()
    schedule_class = get_schedule_class(name)
    # Multi-stage schedules hold two stages per rank, placed in a loop or (ZB-V, DualPipeV) in a V.
    multi = issubclass(schedule_class, get_schedule_class("PipelineScheduleMulti"))
    v = 2 if multi else 1
    style = "v" if schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV) else "loop"
    num_stages = p * v
    mine = stages_on_rank(rank, p, v, style=style)

    model = build(dim=16, num_stages=num_stages)
    reference = copy.deepcopy(model)  # the whole model, trained in this process
    stages = [PipelineStage(model[s], s, num_stages) for s in mine]
    schedule = schedule_class(stages if multi else stages[0], args.microbatches, loss_fn=F.mse_loss)
    params = [q for s in mine for q in model[s].parameters()]  # only this rank's stages
    opt = torch.optim.AdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    if rank == 0:
        print(f"{schedule_class.__name__}: {num_stages} stages on {p} ranks, rank 0 holds stages {mine}")

    has_first, has_last = 0 in mine, num_stages - 1 in mine
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(args.steps):
        x, y = torch.randn(args.batch, 16, generator=gen), torch.randn(args.batch, 1, generator=gen)
        losses: list[torch.Tensor] = []
        # The first stage's rank passes the batch, the last stage's rank the targets.
        schedule.step(*((x,) if has_first else ()), target=y if has_last else None, losses=losses)
        opt.step()
        opt.zero_grad()

        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        if has_last:  # the mean of equal micro-batches' mean losses is the batch's mean loss
            loss = float(torch.stack(losses).mean())
            worst = max(worst, abs(loss - float(ref_loss.detach())))
            print(f"  step {step}: loss {loss:.6f}   one process {float(ref_loss.detach()):.6f}")

    with torch.no_grad():
        for s in mine:
            for a, b in zip(model[s].parameters(), reference[s].parameters(), strict=True):
                worst = max(worst, float((a - b).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--schedule", default="1F1B", help="a torch schedule name, or several separated by commas"
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4, help="DualPipeV needs at least 2 x ranks")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # exact comparison through AdamW, see examples/fsdp.py

    init_distributed()
    names = args.schedule.split(",")
    worst = max(train(name, args) for name in names)
    finish(worst, args.tolerance, f"{args.schedule} over {dist.get_world_size()} ranks")


if __name__ == "__main__":
    main()

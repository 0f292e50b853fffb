"""Pipeline x FSDP on a (pp, dp) mesh: blocks and stage wrapped by ``fully_shard`` (nested).

Run on 4 local CPU ranks:   hp-run -n 4 examples/pp_fsdp.py
or on a cluster, unchanged: torchrun --nproc-per-node 4 examples/pp_fsdp.py

The 4 ranks form a ("pp", "dp") = (2, 2) mesh. Along "pp" the model is cut into
two stages under 1F1B; along "dp" each stage is sharded: every block is a
``fully_shard`` unit and the stage module a second, outer one (it holds what the
blocks do not, here the head). The schedule drives the units itself: one
all-gather and one reduce-scatter per unit and step, however many
micro-batches. Each dp replica runs its own pipeline on its slice of the batch.
Checked against one process.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from example_common import Block, finish
from hp_core import get_platform, init_device_mesh, init_distributed
from hp_dtensor import DTensor
from hp_fsdp import fully_shard
from hp_pipeline import PipelineStage, Schedule1F1B
from torch import nn


class Stage(nn.Module):
    """Two blocks, and on the last stage the head."""

    def __init__(self, dim: int, last: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.head = nn.Linear(dim, 1) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2, help="per dp replica and step")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages; dp is the rest of the ranks")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # exact comparison through AdamW, see examples/fsdp.py

    init_distributed()
    world = dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide the {world} ranks")
    pp, dp = args.pp, world // args.pp
    mesh = init_device_mesh(get_platform().device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
    stage_index, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(*(Stage(16, last=s == pp - 1) for s in range(pp)))
    reference = copy.deepcopy(model)
    stage = model[stage_index]  # this rank keeps only its stage
    for block in stage.blocks:
        fully_shard(block, mesh=mesh["dp"])  # inner units: one per block ...
    fully_shard(stage, mesh=mesh["dp"])  # ... outer unit: the stage (the head)
    pipe = PipelineStage(stage, stage_index, pp, group=mesh["pp"].get_group())  # p2p along pp only
    schedule = Schedule1F1B(pipe, args.microbatches, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    share = args.global_batch // dp
    first, last = stage_index == 0, stage_index == pp - 1
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(args.steps):
        x, y = (
            torch.randn(args.global_batch, 16, generator=gen),
            torch.randn(args.global_batch, 1, generator=gen),
        )
        mine = slice(replica * share, (replica + 1) * share)
        losses: list[torch.Tensor] = []
        schedule.step(*((x[mine],) if first else ()), target=y[mine] if last else None, losses=losses)
        opt.step()  # FSDP averaged the gradients over dp inside the schedule
        opt.zero_grad()

        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        # The last stage's ranks know their replica's loss: sum them over all ranks, then average.
        report = torch.tensor([float(torch.stack(losses).mean()) if last else 0.0, float(last)])
        dist.all_reduce(report)
        loss = float(report[0] / report[1])
        worst = max(worst, abs(loss - float(ref_loss.detach())))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.6f}   one process {float(ref_loss.detach()):.6f}")

    with torch.no_grad():
        for a, b in zip(stage.parameters(), reference[stage_index].parameters(), strict=True):
            whole = a.full_tensor() if isinstance(a, DTensor) else a  # gathers over dp
            worst = max(worst, float((whole - b).abs().max()))
    finish(worst, args.tolerance, f"pipeline x FSDP on (pp, dp) = ({pp}, {dp})")


if __name__ == "__main__":
    main()

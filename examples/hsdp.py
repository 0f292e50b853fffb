"""HSDP: ``fully_shard`` on a 2-D (replicate, shard) mesh; checked against one process.

Run on 4 local CPU ranks:   hp-run -n 4 examples/hsdp.py
or on a cluster, unchanged: torchrun --nproc-per-node 4 examples/hsdp.py

The 4 ranks form a 2 x 2 mesh. Within a row ("shard") each parameter is split in
two, as in FSDP; the two rows ("replicate") hold the same shards. A backward
reduce-scatters the gradients within each row, then all-reduces them across the
rows: every rank ends up with the gradient of the whole global batch, averaged.
Communication stays inside a node for the big collectives and crosses nodes only
with 1/2 of the bytes.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from example_common import build, finish
from hp_core import get_platform, init_device_mesh, init_distributed
from hp_dtensor import DTensor
from hp_fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # exact comparison through AdamW, see examples/fsdp.py

    init_distributed()
    world = dist.get_world_size()
    if world % 2:
        raise SystemExit(f"hsdp.py needs an even number of ranks (2 rows), got {world}")
    mesh = init_device_mesh(
        get_platform().device_type, (2, world // 2), mesh_dim_names=("replicate", "shard")
    )
    rank = dist.get_rank()  # every rank is its own data-parallel replica: 4 slices of the batch

    model = build(dim=16, layers=2)
    reference = copy.deepcopy(model)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)  # a 2-D mesh means HSDP: replicate on dim 0, shard on dim 1
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    share = args.global_batch // world
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(args.steps):
        x, y = (
            torch.randn(args.global_batch, 16, generator=gen),
            torch.randn(args.global_batch, 1, generator=gen),
        )
        mine = slice(rank * share, (rank + 1) * share)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()  # reduce-scatter in the row, all-reduce across rows: the mean over 4 ranks
        opt.step()
        opt.zero_grad()

        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world
        worst = max(worst, abs(float(global_loss) - float(ref_loss.detach())))
        if rank == 0:
            print(f"step {step}: loss {float(global_loss):.6f}   one process {float(ref_loss.detach()):.6f}")

    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            whole = p.full_tensor() if isinstance(p, DTensor) else p  # gathers the shards (collective)
            worst = max(worst, float((whole - q).abs().max()))
    finish(worst, args.tolerance, f"HSDP on a 2 x {world // 2} mesh")


if __name__ == "__main__":
    main()

"""FSDP x TP: tensor parallelism inside each block, then ``fully_shard`` on dp of a (dp, tp) mesh.

Run on 4 local CPU ranks:   hp-run -n 4 examples/fsdp_tp.py
or on a cluster, unchanged: torchrun --nproc-per-node 4 examples/fsdp_tp.py

The 4 ranks form a ("dp", "tp") = (2, 2) mesh. Along "tp" each block's MLP is
split Colwise / Rowwise (see examples/tensor_parallel.py); along "dp" those
pieces are sharded again by ``fully_shard``, so each rank holds a quarter of a
block's weights. The two ranks of a tp group see the same slice of the batch,
the two dp groups different slices. Checked against one process.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from example_common import build, finish
from hp_core import get_platform, init_device_mesh, init_distributed
from hp_dtensor import ColwiseParallel, DTensor, RowwiseParallel, parallelize_module
from hp_fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp is the rest")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # exact comparison through AdamW, see examples/fsdp.py

    init_distributed()
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    dp = world // args.tp
    mesh = init_device_mesh(get_platform().device_type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    replica = mesh.get_local_rank("dp")  # which slice of the batch this rank trains on

    model = build(dim=16, layers=2)
    reference = copy.deepcopy(model)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model[:-1]:
        parallelize_module(block, mesh["tp"], plan)  # first TP inside the block ...
        fully_shard(block, mesh=mesh["dp"])  # ... then FSDP over dp shards the TP pieces
    fully_shard(model, mesh=mesh["dp"])  # the root: the head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    share = args.global_batch // dp
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(args.steps):
        x, y = (
            torch.randn(args.global_batch, 16, generator=gen),
            torch.randn(args.global_batch, 1, generator=gen),
        )
        mine = slice(replica * share, (replica + 1) * share)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()

        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=mesh.get_group("dp"))  # the tp ranks already agree
        global_loss /= dp
        worst = max(worst, abs(float(global_loss) - float(ref_loss.detach())))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {float(global_loss):.6f}   one process {float(ref_loss.detach()):.6f}")

    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if dist.get_rank() == 0 and name == "0.down.weight" and isinstance(p, DTensor):
                print(f"  {name}: local {tuple(p.to_local().shape)} of {tuple(p.shape)}, {p.placements}")
            whole = p.full_tensor() if isinstance(p, DTensor) else p  # gathers over dp and tp
            worst = max(worst, float((whole - q).abs().max()))
    finish(worst, args.tolerance, f"FSDP x TP on (dp, tp) = ({dp}, {args.tp})")


if __name__ == "__main__":
    main()

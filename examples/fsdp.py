"""FSDP: ``fully_shard`` each block, then the root, on a 1-D mesh; checked against one process.

Run on 2 local CPU ranks:   hp-run -n 2 examples/fsdp.py
or on a cluster, unchanged: torchrun --nproc-per-node 2 examples/fsdp.py

Every rank holds 1/N of each parameter (a ``hp_dtensor.DTensor`` sharded on dim 0).
Each block's forward all-gathers its parameters and frees them afterwards, its
backward reduce-scatters the gradients (averaged over the ranks). Each rank trains
on its slice of the global batch; a deep copy of the model trained in this same
process on the whole batch must end with the same parameters.
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


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter: a sharded DTensor is gathered, a plain tensor returned as is."""
    return p.full_tensor() if isinstance(p, DTensor) else p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    args = parser.parse_args()
    # float64, so that AdamW (which divides by each gradient's magnitude) does not turn a
    # different but valid summation order into visible noise.
    torch.set_default_dtype(torch.float64)

    init_distributed()  # env:// from hp-run or torchrun
    world = dist.get_world_size()
    mesh = init_device_mesh(get_platform().device_type, (world,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank("dp")

    model = build(dim=16, layers=2)
    reference = copy.deepcopy(model)  # the single-process copy, trained on the whole batch
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)  # bottom-up: each block is one unit ...
    fully_shard(model, mesh=mesh)  # ... and the root takes what is left (the head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # steps on the local shards
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
        loss = F.mse_loss(model(x[mine]), y[mine])  # FSDP averages the grads: the global mean loss
        loss.backward()
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

    # full_tensor() is a collective: every rank gathers every parameter
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            worst = max(worst, float((full(p) - q).abs().max()))
    finish(worst, args.tolerance, f"FSDP over {world} ranks")


if __name__ == "__main__":
    main()

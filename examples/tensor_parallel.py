"""Tensor parallelism: ``parallelize_module`` with Colwise / Rowwise; checked against one process.

Run on 2 local CPU ranks:   hp-run -n 2 examples/tensor_parallel.py
or on a cluster, unchanged: torchrun --nproc-per-node 2 examples/tensor_parallel.py

Each MLP block's first linear is split by output features (``ColwiseParallel``:
every rank computes its part of the hidden layer, no communication) and its
second by input features (``RowwiseParallel``: every rank produces a partial sum,
one all-reduce makes the output whole). All ranks see the same batch and
compute the same loss; the split weights are ``hp_dtensor.DTensor``s and the
optimizer steps on their local pieces.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=1e-9, help="float64: the runs agree to ~1e-15")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # exact comparison through AdamW, see examples/fsdp.py

    init_distributed()
    world = dist.get_world_size()
    mesh = init_device_mesh(get_platform().device_type, (world,), mesh_dim_names=("tp",))

    model = build(dim=16, layers=2)
    reference = copy.deepcopy(model)
    # The plan names submodules of each block: up is split by columns, down by rows. The
    # block's input and output stay whole (replicated) tensors, so the residual add and
    # the head need no change.
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model[:-1]:
        parallelize_module(block, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(args.steps):
        x, y = torch.randn(args.batch, 16, generator=gen), torch.randn(args.batch, 1, generator=gen)
        loss = F.mse_loss(model(x), y)  # the same batch on every rank
        loss.backward()
        opt.step()
        opt.zero_grad()

        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        worst = max(worst, abs(float(loss.detach()) - float(ref_loss.detach())))
        if dist.get_rank() == 0:
            print(
                f"step {step}: loss {float(loss.detach()):.6f}   one process {float(ref_loss.detach()):.6f}"
            )

    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if isinstance(p, DTensor) and dist.get_rank() == 0 and name.startswith("0."):
                print(f"  {name}: local {tuple(p.to_local().shape)} of {tuple(p.shape)}, {p.placements}")
            whole = p.full_tensor() if isinstance(p, DTensor) else p  # gathers the pieces (collective)
            worst = max(worst, float((whole - q).abs().max()))
    finish(worst, args.tolerance, f"tensor parallel over {world} ranks")


if __name__ == "__main__":
    main()

"""Checkpoint a ``fully_shard`` model with torch.distributed.checkpoint, load it under other shardings.

Run on 2 local CPU ranks:   hp-run -n 2 examples/dcp_reshard.py
or on a cluster, unchanged: torchrun --nproc-per-node 2 examples/dcp_reshard.py

The model trains a few steps FSDP-sharded over the ranks (checked against one
process), then ``dcp.save`` writes each rank's shards. The same checkpoint is
loaded twice on the same ranks into other layouts: a tensor-parallel copy
(Colwise / Rowwise pieces, cut along other dims than FSDP's) and a plain
replicated copy (whole tensors on every rank). DCP reads, for each rank's
piece, whatever parts of the saved shards overlap it; the loaded values must
equal the trained ones exactly.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from example_common import Block, finish
from hp_core import get_platform, init_device_mesh, init_distributed
from hp_dtensor import ColwiseParallel, DTensor, RowwiseParallel, parallelize_module
from hp_fsdp import fully_shard
from torch import nn


def build(dim: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return nn.Sequential(*(Block(dim) for _ in range(layers)), nn.Linear(dim, 1))


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor (a collective for DTensors: call it on every rank)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=1e-9, help="training vs one process (float64)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)  # exact comparison through AdamW, see examples/fsdp.py

    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(get_platform().device_type, (world,), mesh_dim_names=("dp",))

    # 1. Train FSDP-sharded, beside a single-process copy.
    model = build(16, 2, seed=0)
    reference = copy.deepcopy(model)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    share, gen = args.global_batch // world, torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        x, y = (
            torch.randn(args.global_batch, 16, generator=gen),
            torch.randn(args.global_batch, 1, generator=gen),
        )
        F.mse_loss(
            model(x[rank * share : (rank + 1) * share]), y[rank * share : (rank + 1) * share]
        ).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    trained = whole(model)
    training_diff = max(float((trained[n] - q.detach()).abs().max()) for n, q in reference.named_parameters())

    # 2. Save: each rank writes its own shards. Rank 0 picks the directory and tells the others.
    where = [tempfile.mkdtemp(prefix="hp-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    path = where[0]
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)

    # 3. Load into a tensor-parallel model (other seed: every value must come from the checkpoint).
    tp_model = build(16, 2, seed=1)
    for block in tp_model[:-1]:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    state = {"model": tp_model.state_dict()}
    dcp.load(state, checkpoint_id=path)  # in place, into each rank's TP pieces
    tp_model.load_state_dict(state["model"])
    # 4. ... and into a plain replicated model: whole tensors on every rank.
    plain = build(16, 2, seed=2)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path)
    plain.load_state_dict(state["model"])

    load_diff = 0.0
    for loaded in (whole(tp_model), whole(plain)):
        load_diff = max(load_diff, *(float((loaded[n] - t).abs().max()) for n, t in trained.items()))
    if rank == 0:
        print(f"FSDP training vs one process: largest difference {training_diff:.2e}")
        print(f"checkpoint loaded into TP and into a replica: largest difference {load_diff:.1e} (must be 0)")
    dist.barrier()  # everyone has read the checkpoint
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    # exact: the loaded values are the saved ones, byte for byte
    finish(
        training_diff if load_diff == 0.0 else float("inf"), args.tolerance, f"DCP reshard on {world} ranks"
    )


if __name__ == "__main__":
    main()

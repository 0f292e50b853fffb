"""Checks for a machine with one CUDA GPU: NCCL at world size 1, the compiled cases on inductor, swap.

Run through ``scripts/gpu_check.sh`` (``torchrun --nproc-per-node 1``). Each
check trains a few steps against an eager single-process copy on the same GPU
and prints ``PASS`` or ``FAIL`` with the largest difference; the last line is
a one-line summary. Nothing in CI needs a GPU: this is for sessions that are
lent one. ``GPU_CHECK_DEVICE=cpu`` runs the same checks on the CPU (gloo, inductor's CPU code),
which only tests the script itself.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

STEPS = 3
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")


class Block(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _train(model: nn.Module, ref: nn.Module, run: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """SGD steps on both; the largest difference of losses and parameters (full tensors)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = 0.0
    for step in range(STEPS):
        x = torch.randn(8, 16, 64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(step))
        loss, ref_loss = run(x).float().pow(2).mean(), ref(x).float().pow(2).mean()
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst = max(worst, (loss - ref_loss).abs().item())
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            worst = max(worst, (full.detach() - q.detach()).abs().max().item())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return worst


def fsdp_blocks_inductor(mesh: object) -> float:
    from hp_fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)]).to(DEVICE)
    ref = copy.deepcopy(model)
    for block in model:
        fully_shard(block, mesh=mesh)
        block.compile(backend="inductor")
    fully_shard(model, mesh=mesh)
    return _train(model, ref, model)


def fsdp_whole_bf16_inductor(mesh: object) -> float:
    from hp_fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)]).to(DEVICE)
    ref = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    compiled = torch.compile(model, backend="inductor")
    bf16_ref = copy.deepcopy(ref).to(torch.bfloat16)

    def run_ref(x: torch.Tensor) -> torch.Tensor:
        return bf16_ref(x.to(torch.bfloat16))

    # bf16: compare with a bf16 copy (no optimizer on it: only the first loss is meaningful)
    x = torch.randn(8, 16, 64, device=DEVICE)
    return (compiled(x).float() - run_ref(x).float()).abs().max().item()


def tp_fullgraph_inductor(mesh: object) -> float:
    from hp_dtensor import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Block().to(DEVICE)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return _train(model, ref, torch.compile(model, backend="inductor", fullgraph=True))


def pipeline_swap_zbv(mesh: object) -> float:
    """ZB-V's two stages on this rank with every saved activation swapped to pinned host memory.

    The accelerator path of hp-pipeline's swap (pinned buffers, the side stream, the
    events the backward waits for) and the failure vote's side stream; gradients
    against an eager copy on the same device, and the swap must have moved every
    micro-batch of both stages out and back.
    """
    from hp_pipeline import PipelineStage, ScheduleZBVZeroBubble, SwapPolicy

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).to(DEVICE)
    ref = copy.deepcopy(model)
    m, x = 4, torch.randn(16, 8, 64, device=DEVICE)
    stages = [PipelineStage(model[s], s, 2) for s in (0, 1)]
    schedule = ScheduleZBVZeroBubble(
        stages, m, lambda out, _: out.square().mean(), swap_policy=SwapPolicy(keep_newest=0, min_bytes=0)
    )
    losses: list[torch.Tensor] = []
    schedule.step(x, target=x, losses=losses)
    sum(ref(chunk).square().mean() for chunk in x.chunk(m)).div(m).backward()
    stats = schedule.activation_memory()
    if stats is None or stats.swapped_out < m or stats.swapped_in != stats.swapped_out:
        raise AssertionError(f"expected every micro-batch swapped out and back, got {stats}")
    return max(
        float((a.grad - b.grad).abs().max())  # type: ignore[operator]
        for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    )


CHECKS: dict[str, tuple[Callable[[object], float], float]] = {
    "fsdp: blocks compiled, inductor": (fsdp_blocks_inductor, 1e-4),
    "fsdp: whole model, bf16, inductor": (fsdp_whole_bf16_inductor, 5e-2),
    "tp: fullgraph, inductor": (tp_fullgraph_inductor, 1e-4),
    "pipeline: ZB-V with activation swap to pinned memory": (pipeline_swap_zbv, 1e-5),
}


def main() -> int:
    import hp_core

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this script is for a machine with a GPU")
        return 2
    hp_core.init_distributed()
    backend = torch.distributed.get_backend()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run"
    print(f"gpu_check: {name}, torch {torch.__version__}, backend {backend}")
    mesh = hp_core.init_device_mesh(DEVICE, (1,))
    failures = 0
    for name, (check, tolerance) in CHECKS.items():
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            worst = check(mesh)
            ok = worst <= tolerance
            verdict = "PASS" if ok else "FAIL"
            print(
                f"{verdict} {name}: largest difference {worst:.3g} (limit {tolerance:g}), "
                f"{time.perf_counter() - start:.1f} s"
            )
        except Exception:
            ok = False
            print(f"FAIL {name}: raised\n{traceback.format_exc()}")
        failures += not ok
    print(f"gpu_check: {len(CHECKS) - failures} passed, {failures} failed")
    hp_core.destroy_distributed()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""torchtitan's Llama 3 training step: hp's parallelize function against torchtitan's own, side by side.

Both sides are torchtitan 0.3.0's debug model (``--flavor``) built, initialised
and trained by the same code (``hp_torchtitan.checkpoint.TrainingRun``:
torchtitan's model, loss, ``clip_grad_norm_``, fused AdamW and LR schedule,
one step as ``Trainer.train_step`` does it), from the same weights on the same
tokens. Only ``ModelSpec.parallelize_fn`` differs:

- torch: torchtitan's ``parallelize_llama`` (FSDP2, and for TP the model's
  ``sharding_config``s applied by ``model.parallelize``);
- hp: ``hp_torchtitan.parallelize_decoder`` (``hp_fsdp.fully_shard``, and for
  TP ``hp_torchtitan.apply_tp`` with ``hp_dtensor``).

The layout is torchtitan's: FSDP over the whole world, or with ``--tp 2``
FSDP x TP (sequence parallel on) over ``world / 2`` x 2. torchtitan's
``ParallelDims`` takes the whole world, so one run measures one layout:

    hp-run -n 2 benchmarks/torchtitan_step.py           # FSDP on 2 ranks
    hp-run -n 4 benchmarks/torchtitan_step.py --tp 2    # FSDP x TP on 2x2

Figures, per rank, the largest over the ranks:

- ``step_time``: wall time of a whole step (forward, backward, clipping,
  optimizer, LR step and the logged loss's all-reduce), median of
  ``--iters`` steps after ``--warmup``, sides alternating (hp, torch, torch,
  hp, ...) so drifting machine load hits both alike, ranks lined up by a
  barrier before each step.
- ``peak_memory``: the high-water mark of CPU tensor memory during a step
  above what is live when it starts, replayed from the torch profiler's
  memory events (every allocation and free of torch's CPU allocator, as
  ``benchmarks/fsdp_step.py`` measures it; not the process RSS, which also
  counts allocator caching and Python objects and never goes down). Median
  of ``--memory-steps`` profiled steps per side.

Before measuring, the first step's loss of the two sides is compared (1e-5):
a benchmark of different work would be worthless. Prints a table, then as its
last line one JSON object whose ``ratios`` are hp's figure over torch's
(below 1.0: hp is ahead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hp_core
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_step import _peak_bytes  # the profiler-replayed peak, measured alike for every benchmark

CORPUS = (
    Path(__file__).resolve().parents[1]
    / "packages"
    / "hp-torchtitan"
    / "tests"
    / "assets"
    / "tiny_corpus.txt"
)
SIDES = ("hp", "torch")


def build_runs(args: argparse.Namespace, steps: int) -> tuple[dict[str, Any], list[Any]]:
    """The two runs (torchtitan's spec and hp's) on this rank, and this rank's batches."""
    import hp_torchtitan
    from hp_torchtitan.checkpoint import TrainingRun
    from hp_torchtitan.data import text_file_batches
    from hp_torchtitan.driver import RunConfig, full_initial_weights
    from hp_torchtitan.spec import with_sdpa_attention
    from torchtitan.models.llama3 import model_registry

    rank, world = dist.get_rank(), dist.get_world_size()
    specs = {
        "torch": with_sdpa_attention(model_registry(args.flavor)),
        "hp": with_sdpa_attention(hp_torchtitan.hp_llama3_spec(args.flavor)),
    }
    batches = text_file_batches(
        CORPUS,
        steps=steps,
        local_batch_size=args.batch,
        seq_len=args.seq,
        dp_rank=rank // args.tp,
        dp_degree=world // args.tp,
    )
    weights = full_initial_weights(specs["torch"], seed=0)
    config = RunConfig(steps=steps, tp=args.tp)
    runs = {side: TrainingRun.build(specs[side], weights, config, local_batch=batches[0]) for side in SIDES}
    return runs, batches


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Median step time and peak step memory of each side on this rank, then the largest over the ranks."""
    steps = 1 + args.warmup + args.iters + args.memory_steps
    runs, batches = build_runs(args, steps)
    first = {side: runs[side].step(batches) for side in SIDES}
    if abs(first["hp"] - first["torch"]) > 1e-5:
        raise RuntimeError(f"torchtitan_step: the sides' first losses differ ({first}); not the same work.")
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for it in range(args.warmup + args.iters):
        for side in SIDES if it % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            start = time.perf_counter()
            runs[side].step(batches)
            elapsed = time.perf_counter() - start
            if it >= args.warmup:
                times[side].append(elapsed)
    peaks: dict[str, list[int]] = {side: [] for side in SIDES}
    for it in range(args.memory_steps):
        for side in SIDES if it % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            peaks[side].append(_peak_bytes(lambda side=side: runs[side].step(batches)))
    out = torch.tensor(
        [
            *(statistics.median(times[side]) for side in SIDES),
            *(float(statistics.median(peaks[side])) for side in SIDES),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    figures = dict(zip(("hp_step_s", "torch_step_s", "hp_peak", "torch_peak"), out.tolist(), strict=True))
    figures["first_loss"] = first["torch"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flavor", default="debugmodel", help="a torchtitan Llama 3 flavor")
    parser.add_argument("--tp", type=int, default=1, help="TP degree (FSDP over the rest of the world)")
    parser.add_argument("--batch", type=int, default=4, help="local batch size")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--memory-steps", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # torch FSDP2's advice, not ours
    hp_core.init_distributed()
    world = dist.get_world_size()
    if world % args.tp != 0:
        raise SystemExit(f"torchtitan_step: --tp {args.tp} does not divide the world of {world} ranks.")
    r = measure(args)
    if dist.get_rank() == 0:
        layout = f"fsdp{world // args.tp}" + (f"_x_tp{args.tp}" if args.tp > 1 else "")
        t_ratio = r["hp_step_s"] / r["torch_step_s"]
        m_ratio = r["hp_peak"] / r["torch_peak"]
        print(
            f"torchtitan_step: Llama 3 {args.flavor}, {layout} on {world} ranks, "
            f"batch {args.batch}x{args.seq} per data-parallel rank, fp32, fused AdamW + clipping, "
            f"{args.iters} alternating steps, median"
        )
        print(
            f"{'layout':>12} | {'hp ms':>8} | {'torch ms':>8} | {'time ratio':>10} | "
            f"{'hp peak MiB':>11} | {'torch peak MiB':>14} | {'mem ratio':>9}"
        )
        print(
            f"{layout:>12} | {1e3 * r['hp_step_s']:>8.2f} | {1e3 * r['torch_step_s']:>8.2f} | "
            f"{t_ratio:>10.3f} | "
            f"{r['hp_peak'] / 2**20:>11.2f} | {r['torch_peak'] / 2**20:>14.2f} | {m_ratio:>9.3f}"
        )
        ratios = {
            f"torchtitan_{layout}_step_time": round(t_ratio, 4),
            f"torchtitan_{layout}_peak_memory": round(m_ratio, 4),
        }
        raw = {layout: {k: round(v, 6) for k, v in r.items()}}
        print(
            json.dumps({"benchmark": "torchtitan_step", "ratios": ratios, "raw": raw, "config": vars(args)})
        )
    hp_core.destroy_distributed()


if __name__ == "__main__":
    main()

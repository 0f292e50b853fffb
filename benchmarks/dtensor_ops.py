"""Per-op dispatch overhead of hp_dtensor's DTensor against torch.distributed.tensor.DTensor.

Run on 4 CPU ranks over gloo:

    hp-run -n 4 benchmarks/dtensor_ops.py [--repeats 21] [--calls 200]

Both libraries hold the same tensors on the same mesh (``torch``'s mesh is
``DeviceMesh.to_torch()`` of ours, so both use the same process groups) and
run the same three calls:

- ``pointwise``: ``a + b`` with both operands ``Shard(0)`` (no communication);
- ``linear``: ``F.linear(x, w, b)`` with ``x`` replicated and ``w``, ``b``
  ``Shard(0)`` (column-wise, no communication);
- ``redistribute_S_to_R``: ``Shard(0) -> Replicate()`` (one all-gather; the
  collective itself is the same gloo call on both sides, so this measures
  planning and bookkeeping around it).

The tensors are small so the figure is the library's overhead, not the
kernel. Each repeat times ``--calls`` calls of one case for one library, the
libraries alternate (the order flips every repeat), and a barrier lines the
ranks up before every timed block. Time is the CPU time of the rank's process
(all its threads, gloo's included): with several ranks per core, and other
work on the machine, wall time mostly measures the scheduler; ``--clock
wall`` measures wall time instead. A figure is the median over repeats of
the microseconds per call, the maximum over ranks. Rank 0 prints a table and,
as the last line, one JSON object whose ``ratios`` are ours over torch's
(below 1.0: we are faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

CASES = ("pointwise", "linear", "redistribute_S_to_R")


def build_cases(mesh, world: int) -> dict[str, dict[str, Callable[[], object]]]:  # type: ignore[no-untyped-def]
    """The three calls for each library, on equal data."""
    import hp_dtensor as hp
    from torch.distributed import tensor as td

    tmesh = mesh.to_torch()
    torch.manual_seed(0)
    a = torch.randn(16 * world, 32)
    b = torch.randn(16 * world, 32)
    x = torch.randn(8, 64)
    w = torch.randn(32 * world, 64)
    bias = torch.randn(32 * world)
    ours = {
        "a": hp.distribute_tensor(a, mesh, [hp.Shard(0)]),
        "b": hp.distribute_tensor(b, mesh, [hp.Shard(0)]),
        "x": hp.distribute_tensor(x, mesh, [hp.Replicate()]),
        "w": hp.distribute_tensor(w, mesh, [hp.Shard(0)]),
        "bias": hp.distribute_tensor(bias, mesh, [hp.Shard(0)]),
    }
    theirs = {
        "a": td.distribute_tensor(a, tmesh, [td.Shard(0)]),
        "b": td.distribute_tensor(b, tmesh, [td.Shard(0)]),
        "x": td.distribute_tensor(x, tmesh, [td.Replicate()]),
        "w": td.distribute_tensor(w, tmesh, [td.Shard(0)]),
        "bias": td.distribute_tensor(bias, tmesh, [td.Shard(0)]),
    }
    rep_ours, rep_theirs = [hp.Replicate()], [td.Replicate()]

    def calls(t: dict, replicate: list) -> dict[str, Callable[[], object]]:  # type: ignore[type-arg]
        return {
            "pointwise": lambda: t["a"] + t["b"],
            "linear": lambda: F.linear(t["x"], t["w"], t["bias"]),
            "redistribute_S_to_R": lambda: t["a"].redistribute(placements=replicate),
        }

    return {"ours": calls(ours, rep_ours), "torch": calls(theirs, rep_theirs)}


def check_same(cases: dict[str, dict[str, Callable[[], object]]]) -> None:
    """Both libraries compute the same values (a benchmark of wrong answers is worthless)."""
    for name in CASES:
        mine = cases["ours"][name]()
        theirs = cases["torch"][name]()
        torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor(), msg=name)  # type: ignore[attr-defined]


def time_block(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls, ranks lined up first."""
    dist.barrier()
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    from hp_core import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cases = build_cases(mesh, world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's DTensor may warn about its own internals
        check_same(cases)
        for lib in ("ours", "torch"):
            for name in CASES:
                time_block(cases[lib][name], args.warmup, clock)
        samples: dict[str, dict[str, list[float]]] = {lib: {name: [] for name in CASES} for lib in cases}
        for repeat in range(args.repeats):
            order = ("ours", "torch") if repeat % 2 == 0 else ("torch", "ours")
            for name in CASES:
                for lib in order:
                    samples[lib][name].append(time_block(cases[lib][name], args.calls, clock))
    medians = {lib: {name: statistics.median(v) for name, v in per.items()} for lib, per in samples.items()}
    everyone: list[dict[str, dict[str, float]]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, medians)
    worst = {lib: {name: max(r[lib][name] for r in everyone) for name in CASES} for lib in medians}
    if rank == 0:
        print(f"dtensor op dispatch overhead, {world} ranks (gloo, CPU), torch {torch.__version__}")
        print(
            f"median of {args.repeats} repeats x {args.calls} calls, max over ranks, "
            f"{args.clock} microseconds per call"
        )
        print(f"{'op':<22}{'torch us':>12}{'ours us':>12}{'ours/torch':>12}")
        ratios = {}
        for name in CASES:
            ratio = worst["ours"][name] / worst["torch"][name]
            ratios[name] = round(ratio, 3)
            print(f"{name:<22}{worst['torch'][name]:>12.1f}{worst['ours'][name]:>12.1f}{ratio:>12.3f}")
        summary = {
            "benchmark": "dtensor_ops",
            "ratios": ratios,
            "us_per_call": {lib: {k: round(v, 2) for k, v in per.items()} for lib, per in worst.items()},
            "world_size": world,
            "repeats": args.repeats,
            "calls": args.calls,
            "clock": args.clock,
            "torch": torch.__version__,
        }
        print(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What hp-testing's local mode costs per test, against the process pool and torch's ``LocalTensorMode``.

One test's work, written once per harness (float64, checked against plain
tensors in every harness so that all of them do the same thing right):
``distribute_tensor`` of an uneven tensor, a redistribution Shard(0) ->
Shard(1) -> Replicate, a Partial -> Shard(0) reduction, and a TP MLP
(column-wise up, row-wise down) forward and backward.

- local mode: ``hp_testing.run_local(body, N)``, hp_dtensor, every rank a
  thread (world 8 and 64);
- the process pool: the same body under ``@pytest.mark.distributed(world_size=8)``
  in a pytest session in a subprocess (per test: the median of pytest's call
  durations, the pool warm; the session including the pool's start is
  printed too);
- ``LocalTensorMode`` by hand: torch's DTensor and ``parallelize_module`` on a
  fake process group inside ``LocalTensorMode(N)`` (world 8 and 64), the way
  torch's own tests use it.

Then the 64-rank FSDP x TP step in local mode: a 2-block MLP, TP inside each
block on ``tp`` = 8, ``fully_shard`` per block and root on ``dp`` = 8,
AdamW; and the main job (``hp-run --local -n 64 examples/llama_3d.py
--layout 4,4,4``: pipeline x FSDP x TP). Each prints its first step (cold
caches, optimizer state made) and its steady step (the median of the later
ones), wall and CPU seconds (the issue's aim: a step under 10 s on the 2-core
machine; printed, not asserted), with the load average. Wall time on a shared
machine moves with the load; CPU seconds (the process's, all rank threads)
less so.

Ratios are ours / theirs (below 1.0: local mode is faster). The last line is
one JSON object.

Usage: ``python benchmarks/local_mode_overhead.py [--repeats N] [--pool-tests N] [--steps N]``
(about 8 minutes on the loaded 2-core machine, most of it ``LocalTensorMode`` at 64 ranks).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

DIM = 8


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, dtype=torch.float64)
        self.down = nn.Linear(hidden, dim, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _inputs(world: int) -> tuple[torch.Tensor, MLP, torch.Tensor]:
    torch.manual_seed(0)
    full = torch.randn(world + 5, 6, dtype=torch.float64)
    model = MLP(DIM, 2 * world)
    x = torch.randn(3, 4, DIM, dtype=torch.float64)
    return full, model, x


# -- the test's work in hp (local mode and the pool) -----------------------------------------------

HP_BODY = """
def hp_body(rank, world):
    import copy
    import torch
    import hp_core
    from hp_dtensor import (ColwiseParallel, DTensor, Partial, Replicate, RowwiseParallel, Shard,
                            distribute_tensor, parallelize_module)

    full, model, x = _inputs(world)
    ref = copy.deepcopy(model)
    mesh = hp_core.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rows = distribute_tensor(full, mesh, [Shard(0)])
    rep = rows.redistribute(mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    assert torch.equal(rep.to_local(), full)
    partial = DTensor.from_local(full * (rank + 1), mesh, [Partial("sum")])
    summed = partial.redistribute(mesh, [Shard(0)]).full_tensor()
    torch.testing.assert_close(summed, full * (world * (world + 1) / 2))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    out = model(x)
    out.pow(2).sum().backward()
    ref_out = ref(x)
    ref_out.pow(2).sum().backward()
    torch.testing.assert_close(out.full_tensor() if isinstance(out, DTensor) else out, ref_out)
    torch.testing.assert_close(model.up.weight.grad.full_tensor(), ref.up.weight.grad)
"""
exec(HP_BODY)  # defines hp_body here; the pool's test file gets the same text


def local_mode_test(world: int) -> None:
    from hp_testing import run_local

    run_local(lambda rank: hp_body(rank, world), world)  # type: ignore[name-defined]  # noqa: F821


# -- the same work with torch's DTensor under LocalTensorMode ----------------------------------------


def local_tensor_mode_test(world: int) -> None:
    """torch's DTensor on a fake group, every rank's value carried by LocalTensors."""
    import copy

    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with LocalTensorMode(world) as mode:
            full, model, x = _inputs(world)
            ref = copy.deepcopy(model)
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            rows = distribute_tensor(full, mesh, [Shard(0)])
            rep = rows.redistribute(mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
            ranks_full = mode.rank_map(lambda r: full)
            assert torch.equal(rep.to_local(), ranks_full)
            partial = DTensor.from_local(mode.rank_map(lambda r: full * (r + 1)), mesh, [Partial("sum")])
            summed = partial.redistribute(mesh, [Shard(0)]).full_tensor()
            torch.testing.assert_close(summed, ranks_full * (world * (world + 1) / 2))
            parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            out = model(x)
            out.pow(2).sum().backward()
            with mode.disable():
                ref_out = ref(x)
                ref_out.pow(2).sum().backward()
            grad = model.up.weight.grad.full_tensor()
            torch.testing.assert_close(grad, mode.rank_map(lambda r: ref.up.weight.grad))
    finally:
        dist.destroy_process_group()


# -- the process pool -------------------------------------------------------------------------------

POOL_FILE = """
import pytest
import torch
from torch import nn

DIM = {dim}
{mlp}
{inputs}
{body}
{tests}
"""
POOL_TEST = """
@pytest.mark.distributed(world_size={world})
def test_work_{i}(rank, world_size):
    hp_body(rank, world_size)
"""


def pool_per_test(world: int, tests: int) -> tuple[float, float]:
    """(median call seconds of a test on the warm pool, session seconds including the pool's start)."""
    import inspect

    source = POOL_FILE.format(
        dim=DIM,
        mlp=inspect.getsource(MLP),
        inputs=inspect.getsource(_inputs),
        body=HP_BODY,
        tests="".join(POOL_TEST.format(world=world, i=i) for i in range(tests)),
    )
    with tempfile.TemporaryDirectory(prefix="hp-local-bench-") as tmp:
        path = Path(tmp) / "test_pool_work.py"
        path.write_text(textwrap.dedent(source))
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "--durations=0"],
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        session = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the pool session failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    calls = [float(m) for m in re.findall(r"^([\d.]+)s call ", done.stdout, flags=re.M)]
    if len(calls) != tests:
        raise RuntimeError(
            f"expected {tests} call durations from pytest, got {calls}:\n{done.stdout[-2000:]}"
        )
    return statistics.median(sorted(calls)[:-1] or calls), session  # the first test may start the pool


# -- the 64-rank FSDP x TP step ------------------------------------------------------------------------


def fsdp_tp_step(dp: int, tp: int, steps: int) -> dict[str, Any]:
    """Seconds (wall, CPU) of each step of FSDP on ``dp`` x TP on ``tp`` in local mode, rank 0's view."""
    from hp_testing import run_local

    dim, hidden, rows = 64, 256, 2

    def body(rank: int) -> dict[str, Any]:
        import copy

        import hp_core
        import torch.distributed as dist
        from hp_dtensor import ColwiseParallel, RowwiseParallel, parallelize_module
        from hp_fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(*[MLP(dim, hidden) for _ in range(2)])
        reference = copy.deepcopy(model) if rank == 0 else None
        mesh = hp_core.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        for block in model:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        walls, cpus, losses = [], [], []
        for _ in range(steps):
            x = torch.randn(dp * rows, 4, dim, dtype=torch.float64, generator=gen)
            mine = x[mesh.get_local_rank("dp") * rows :][:rows]
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            loss = model(mine).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            mean = loss.detach().reshape(1).clone()  # each dp replica's loss, tp ranks alike
            dist.all_reduce(mean)
            losses.append(float(mean) / (dp * tp))
        ref_losses = []
        if reference is not None:
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
            gen = torch.Generator().manual_seed(1)
            for _ in range(steps):
                x = torch.randn(dp * rows, 4, dim, dtype=torch.float64, generator=gen)
                ref_loss = reference(x).pow(2).mean()
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                ref_losses.append(float(ref_loss))
        return {"wall": walls, "cpu": cpus, "losses": losses, "reference": ref_losses}

    result: dict[str, Any] = run_local(body, dp * tp)[0]
    diff = max(abs(a - b) for a, b in zip(result["losses"], result["reference"], strict=True))
    if diff > 1e-9:
        raise RuntimeError(f"the FSDP x TP losses left the one-process reference's: {result}")
    result["max_loss_diff"] = diff
    return result


def first_and_steady(values: list[float]) -> tuple[float, float]:
    """(the first step's figure, the median of the later steps'; the first again when there is one)."""
    return values[0], statistics.median(values[1:] or values)


MAIN_JOB_PROBE = r"""
import sys, time
_path, _args = SCRIPT, ARGS
_source = open(_path).read()
# rank 0 also prints the CPU seconds of the step the script times (from its start to its elapsed)
_start, _end = "        start = time.perf_counter()\n", "        elapsed = time.perf_counter() - start\n"
if _source.count(_start) != 1 or _source.count(_end) != 1:
    raise SystemExit(f"{_path} no longer times its step as the benchmark expects: {(_start, _end)}")
_report = "        if rank == 0: print(f'CPU step {step}: {time.process_time() - _cpu:.3f} s', flush=True)\n"
_source = _source.replace(_start, _start + "        _cpu = time.process_time()\n")
_source = _source.replace(_end, _end + _report)
sys.argv = [_path, *_args]  # the same on every rank: the ranks share one sys.argv
exec(compile(_source, _path, "exec"), {"__name__": "__main__", "__file__": _path})
"""
MAIN_JOB_LINE = re.compile(r"^\[rank0\]: CPU step (\d+): ([\d.]+) s$", flags=re.M)
MAIN_JOB_STEP = re.compile(r"^\[rank0\]: step +(\d+) \|.*\| +(\d+) ms \|", flags=re.M)


def main_job_steps(steps: int) -> dict[str, Any]:
    """Wall and CPU seconds of each step of the main job on 64 local ranks (4 x 4 x 4), rank 0's view."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="hp-local-main-") as tmp:
        probe = Path(tmp) / "probe.py"
        args = ["--layout", "4,4,4", "--steps", str(steps), "--no-reference", "--out", tmp]
        script = str(root / "examples" / "llama_3d.py")
        probe.write_text(MAIN_JOB_PROBE.replace("SCRIPT", repr(script), 1).replace("ARGS", repr(args), 1))
        done = subprocess.run(
            [sys.executable, "-m", "hp_testing.launcher", "--local", "-n", "64", str(probe)],
            capture_output=True,
            text=True,
            cwd=root / "examples",
        )
    cpus = [float(c) for _, c in MAIN_JOB_LINE.findall(done.stdout)]
    walls = [float(ms) / 1e3 for _, ms in MAIN_JOB_STEP.findall(done.stdout)]
    if done.returncode != 0 or len(cpus) != steps or len(walls) != steps:
        raise RuntimeError(f"the main job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {"cpu": cpus, "wall": walls}


def _timed(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(first call seconds, median of the following ``repeats``)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return first, statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm repeats per in-process case")
    parser.add_argument("--pool-tests", type=int, default=4, help="tests in the pool's session")
    parser.add_argument("--steps", type=int, default=3, help="steps of the 64-rank FSDP x TP job")
    parser.add_argument("--main-job-steps", type=int, default=3, help="steps of the main job (0: none)")
    args = parser.parse_args()

    per_test: dict[str, float] = {}
    first: dict[str, float] = {}
    for world in (8, 64):
        first[f"local-{world}"], per_test[f"local-{world}"] = _timed(
            functools.partial(local_mode_test, world), args.repeats
        )
        first[f"LocalTensorMode-{world}"], per_test[f"LocalTensorMode-{world}"] = _timed(
            functools.partial(local_tensor_mode_test, world), args.repeats
        )
    per_test["process-8"], pool_session = pool_per_test(8, args.pool_tests)
    step = fsdp_tp_step(8, 8, args.steps)
    main_job = main_job_steps(args.main_job_steps) if args.main_job_steps else None
    steps_64 = {"fsdp_tp_step_64": step, **({"main_job_64": main_job} if main_job else {})}
    load = os.getloadavg()

    ratios = {
        "local-8 / process-8 (warm pool)": per_test["local-8"] / per_test["process-8"],
        "local-8 / process-8 (session incl. pool start)": per_test["local-8"]
        / (pool_session / args.pool_tests),
        "local-8 / LocalTensorMode-8": per_test["local-8"] / per_test["LocalTensorMode-8"],
        "local-64 / LocalTensorMode-64": per_test["local-64"] / per_test["LocalTensorMode-64"],
        "fsdp_tp_step_64 wall / 10 s aim": step["wall"][-1] / 10.0,
    }
    for name, figures in steps_64.items():
        ratios[f"{name} first wall / 10 s aim"] = figures["wall"][0] / 10.0
    print("one test's work (redistributions, Partial -> Shard, TP MLP forward/backward; float64, checked)")
    print(f"{'harness':<28}{'first s':>10}{'per test s':>12}")
    for name, value in per_test.items():
        print(f"{name:<28}{first.get(name, float('nan')):>10.3f}{value:>12.3f}")
    print(
        f"{'process-8 session':<28}{'':>10}{pool_session:>12.3f}"
        f"  ({args.pool_tests} tests, pool start included)"
    )
    print(f"64-rank FSDP (dp=8) x TP (tp=8) step in local mode, {args.steps} steps")
    for i, (wall, cpu) in enumerate(zip(step["wall"], step["cpu"], strict=True)):
        print(f"  step {i + 1}: wall {wall:6.2f} s   cpu {cpu:6.2f} s   loss {step['losses'][i]:.6f}")
    print(f"  largest loss difference to the one-process run: {step['max_loss_diff']:.1e}")
    print(f"64-rank steps, first and steady (median of the later steps); load average {load[0]:.2f}")
    print(f"{'job':<22}{'first wall s':>14}{'first cpu s':>13}{'steady wall s':>15}{'steady cpu s':>14}")
    for name, figures in steps_64.items():
        first_wall, steady_wall = first_and_steady(figures["wall"])
        first_cpu, steady_cpu = first_and_steady(figures["cpu"])
        print(f"{name:<22}{first_wall:>14.2f}{first_cpu:>13.2f}{steady_wall:>15.2f}{steady_cpu:>14.2f}")
    print(f"{'ours / theirs':<52}{'ratio':>9}")
    for key, value in ratios.items():
        print(f"{key:<52}{value:>9.4f}")
    print(
        json.dumps(
            {
                "benchmark": "local_mode_overhead",
                "ratios": {name: round(r, 5) for name, r in ratios.items()},
                "per_test_seconds": {name: round(v, 4) for name, v in per_test.items()},
                "first_call_seconds": {name: round(v, 4) for name, v in first.items()},
                "process_8_session_seconds": round(pool_session, 3),
                **{
                    name: {
                        "wall_seconds": [round(v, 3) for v in figures["wall"]],
                        "cpu_seconds": [round(v, 3) for v in figures["cpu"]],
                        "first_wall": round(figures["wall"][0], 3),
                        "steady_wall": round(first_and_steady(figures["wall"])[1], 3),
                    }
                    for name, figures in steps_64.items()
                },
                "load_average": [round(v, 2) for v in load],
            }
        )
    )


if __name__ == "__main__":
    main()

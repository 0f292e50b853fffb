"""The full op_db sweep of hp_dtensor against one process and torch's DTensor ([Note: the op_db sweep]).

    hp-run -n 2 scripts/op_db_sweep.py [--ops a,b] [--samples N] [--json out.json] [--resume out.json]

Prints a table (classes per side, for the forward and for the first input's
gradient; on Shard cases ok on both sides, how many communicate on each, in
the forward and in the backward; the ops whose backward takes hp's fallback)
and, last, one JSON object with those figures. ``--json`` writes every case as
it finishes. A hang stops the run (the default group may hold a half-finished
collective) with exit status 3 after saving; rerun with
``--resume FILE`` to keep the cases done and deny the op that hung. Run without
a launcher (``python scripts/op_db_sweep.py ...``) and the script drives itself:
it starts ``hp-run -n 2`` and resumes after each hang until the sweep ends.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent / "packages" / "hp-dtensor" / "tests"))

HANG_STATUS = 3


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ops", default="", help="comma-separated OpInfo names (name or name.variant); all by default"
    )
    parser.add_argument("--samples", type=int, default=3, help="first N samples of each op (default 3)")
    parser.add_argument("--json", default="", help="write every case here (JSON), updated as the sweep goes")
    parser.add_argument(
        "--resume", default="", help="a --json file of an earlier run: keep its cases, deny its hangs"
    )
    parser.add_argument("--no-grad", action="store_true", help="check the forward only (no backward)")
    parser.add_argument("--deny", default="", help="comma-separated op keys not to run (known hangs)")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds before a collective counts as hung"
    )
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be at least 1, got {args.samples}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    return args


def _load(path: str) -> dict[str, Any]:
    if not path or not os.path.exists(path):
        return {"results": [], "hangs": [], "skipped": []}
    with open(path) as f:
        return json.load(f)


def _save(path: str, state: dict[str, Any]) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def _drive(argv: list[str]) -> int:
    """Without a launcher: run under hp-run, resuming after each hang, until the sweep finishes."""
    args = _parse(argv)
    out = args.json or "op_db_sweep.json"
    rest = _strip_values(argv, {"--json", "--resume"})
    hp_run = shutil.which("hp-run") or "hp-run"
    resume: list[str] = ["--resume", args.resume] if args.resume else []
    while True:
        cmd = [hp_run, "-n", "2", str(HERE), *rest, "--json", out, *resume]
        status = subprocess.call(cmd)
        if status != HANG_STATUS:
            return status
        resume = ["--resume", out]


def _strip_values(argv: list[str], names: set[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif a.split("=", 1)[0] not in names:
            out.append(a)
    return out


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import hp_core
    import opdb_sweep as sweep
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes, per gather
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    hp_core.init_distributed(timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit(f"op_db_sweep runs on 2 ranks, got {dist.get_world_size()}; use hp-run -n 2")
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4 * args.timeout))
    mesh = hp_core.init_device_mesh("cpu", (2,))
    state = _load(args.resume)
    done = {r["op"] for r in state["results"]}
    deny = {h["op"] for h in state["hangs"]} | {d for d in args.deny.split(",") if d}
    names = [n for n in args.ops.split(",") if n] or None
    ops = [op for op in sweep.float32_cpu_ops(names) if sweep.op_key(op) not in done]

    def record(result: Any) -> None:
        state["results"].append(result.as_dict())
        if rank == 0:
            _save(args.json, state)
            print(
                f"{result.op:<44} s{result.sample} {result.placement:<5} hp={result.hp:<11} "
                f"torch={result.torch:<11} comms {result.hp_comms}/{result.torch_comms}"
                + (" fallback" if result.fallback else "")
                + (
                    f" | grad hp={result.hp_grad or '-':<11} torch={result.torch_grad or '-':<11} "
                    f"bwd comms {result.hp_bwd_comms}/{result.torch_bwd_comms}"
                    + (" bwd-fallback" if result.bwd_fallback else "")
                    if result.hp_grad or result.torch_grad
                    else ""
                ),
                flush=True,
            )

    status = 0
    try:
        _, skipped = sweep.run_sweep(
            ops, mesh, side, max_samples=args.samples, deny=deny, on_result=record, with_grad=not args.no_grad
        )
        state["skipped"] = sorted(set(state["skipped"]) | set(skipped))
    except sweep.SweepHang as hang:
        state["hangs"].append(hang.result.as_dict())
        status = HANG_STATUS
        if rank == 0:
            print(f"HANG {hang}; rerun with --resume {args.json or '<the --json file>'}", flush=True)
    if rank == 0:
        _save(args.json, state)
        results = [sweep.CaseResult(**r) for r in state["results"]] + [
            sweep.CaseResult(**h) for h in state["hangs"]
        ]
        summary = sweep.summarize(results)
        print(sweep.format_table(summary))
        print(
            json.dumps({"benchmark": "op_db_sweep", **summary, "hung_ops": [h["op"] for h in state["hangs"]]})
        )
    if status != HANG_STATUS:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit(_drive(sys.argv[1:]))
    code = main(sys.argv[1:])
    if code == HANG_STATUS:
        sys.stdout.flush()
        os._exit(code)  # a timed-out collective may still hold the group: do not wait in teardown
    sys.exit(code)

"""What a trivial multi-process test costs under hp-testing versus PyTorch's harnesses.

The same 40 tests (20 on 2 ranks, 20 on 4 ranks, each one all_reduce checked
against its expected sum, spread over four files) are written three ways and
each set runs as one pytest session in a subprocess, alternating harnesses
round by round:

- hp-testing: ``@pytest.mark.distributed(world_size=N)``, pooled ranks;
- ``MultiProcessTestCase``: torch's harness that spawns the ranks per test;
- ``MultiProcContinuousTest``: torch's harness that keeps ranks per test class;
- ``MultiProcessTestCase`` on hp-testing: the very same ``MultiProcessTestCase``
  files, unchanged, with hp-testing's plugin loaded (it runs their ranks on its
  pool: ``hp_testing._torch_cases``), which is what a downstream repository
  gets by installing hp-testing;
- collection only: the pytest process importing torch and its harness and
  collecting those files, running nothing: the floor of any in-pytest harness.

Reported: wall time of the whole session divided by the number of tests, and
the ratio ours / theirs (below 1.0 means hp-testing is faster): the marker
against both torch harnesses, and the pooled ``MultiProcessTestCase`` files
against ``MultiProcContinuousTest`` (the fastest way torch offers) and against
themselves under torch's harness. The machine's 1-minute load average is
recorded before each session (on a shared machine the ratios move with it).
The last line is one JSON object.

torch's harness module imports ``expecttest``, which torch does not declare;
the benchmark installs it into the running environment when it is missing.

Usage: ``python benchmarks/harness_overhead.py [--rounds N] [--skip HARNESS ...]``
(``--skip MultiProcessTestCase`` leaves out the slowest harness, about four minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TESTS_PER_FILE = 10
FILES = [("a", 2), ("b", 2), ("c", 4), ("d", 4)]  # 20 tests on 2 ranks, 20 on 4

HP_FILE = """
import pytest
import torch
import torch.distributed as dist

{tests}
"""
HP_TEST = """
@pytest.mark.distributed(world_size={world})
def test_all_reduce_{i}(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2
"""

MPTC_FILE = """
import os
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class AllReduce{world}Ranks{tag}(MultiProcessTestCase):
    @property
    def world_size(self):
        return {world}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass

    def _all_reduce(self):
        dist.init_process_group(
            "gloo", init_method=f"file://{{self.file_name}}", rank=self.rank, world_size=self.world_size
        )
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == self.world_size * (self.world_size + 1) / 2
        dist.destroy_process_group()
{tests}
"""
MPTC_TEST = """
    def test_all_reduce_{i}(self):
        self._all_reduce()
"""

MPCT_FILE = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest


class AllReduce{world}Ranks{tag}(MultiProcContinuousTest):
    world_size = {world}

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"

    def _all_reduce(self):
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == self.world_size * (self.world_size + 1) / 2
{tests}
"""
MPCT_TEST = MPTC_TEST

POOLED_MPTC = "MultiProcessTestCase on hp-testing"
#: What no harness can go below: the pytest process alone imports torch and its test harness and
#: collects the same files, and runs nothing. Its ratio to MultiProcContinuousTest is the floor of
#: "pooled MultiProcessTestCase / MultiProcContinuousTest".
COLLECT_ONLY = "collection only (no harness)"
HARNESSES = {
    "hp-testing": (HP_FILE, HP_TEST, []),
    "MultiProcessTestCase": (MPTC_FILE, MPTC_TEST, ["-p", "no:hp_testing"]),
    "MultiProcContinuousTest": (MPCT_FILE, MPCT_TEST, ["-p", "no:hp_testing"]),
    POOLED_MPTC: (MPTC_FILE, MPTC_TEST, []),
    COLLECT_ONLY: (MPTC_FILE, MPTC_TEST, ["-p", "no:hp_testing", "--collect-only"]),
}
#: (ours, theirs) -> the key of ours / theirs in the JSON line's ratios.
RATIOS = {
    ("hp-testing", "MultiProcessTestCase"): "MultiProcessTestCase",
    ("hp-testing", "MultiProcContinuousTest"): "MultiProcContinuousTest",
    (POOLED_MPTC, "MultiProcContinuousTest"): "pooled MultiProcessTestCase / MultiProcContinuousTest",
    (POOLED_MPTC, "MultiProcessTestCase"): "pooled MultiProcessTestCase / MultiProcessTestCase",
    (COLLECT_ONLY, "MultiProcContinuousTest"): "floor: collection only / MultiProcContinuousTest",
}


def write_suite(root: Path, name: str) -> Path:
    file_tpl, test_tpl, _ = HARNESSES[name]
    folder = root / re.sub(r"\W", "_", name)
    folder.mkdir()
    for tag, world in FILES:
        tests = "".join(test_tpl.format(i=i, world=world) for i in range(TESTS_PER_FILE))
        body = file_tpl.format(tests=tests, world=world, tag=tag.upper())
        (folder / f"test_{tag}.py").write_text(textwrap.dedent(body))
    return folder


def run_suite(folder: Path, extra: list[str]) -> tuple[float, int]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(folder),
        *extra,
        str(folder),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
    wall = time.perf_counter() - start
    passed = re.search(r"(\d+) (?:passed|tests collected)", proc.stdout)
    count = int(passed.group(1)) if passed else 0
    expected = TESTS_PER_FILE * len(FILES)
    if proc.returncode != 0 or count != expected:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(
            f"{folder.name}: expected {expected} passing tests, got {count} (exit {proc.returncode})"
        )
    return wall, count


def ensure_expecttest() -> None:
    try:
        import expecttest  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "expecttest==0.3.0"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per harness (default 1)")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=list(HARNESSES), help="harnesses to leave out"
    )
    args = parser.parse_args()
    ensure_expecttest()
    chosen = [name for name in HARNESSES if name not in args.skip]
    walls: dict[str, list[float]] = {name: [] for name in chosen}
    loads: dict[str, list[float]] = {name: [] for name in chosen}
    count = TESTS_PER_FILE * len(FILES)
    with tempfile.TemporaryDirectory(prefix="hp-bench-") as tmp:
        suites = {name: write_suite(Path(tmp), name) for name in chosen}
        for _ in range(args.rounds):
            for name in chosen:
                loads[name].append(os.getloadavg()[0])
                wall, count = run_suite(suites[name], HARNESSES[name][2])
                walls[name].append(wall)
                print(f"  {name}: {wall:.2f} s (load {loads[name][-1]:.1f})", file=sys.stderr, flush=True)
    per_test = {name: statistics.median(w) / count for name, w in walls.items()}
    ratios = {
        key: per_test[ours] / per_test[theirs]
        for (ours, theirs), key in RATIOS.items()
        if ours in per_test and theirs in per_test
    }

    print(
        f"{count} trivial all_reduce tests (20 on 2 ranks, 20 on 4), whole pytest session, "
        f"median of {args.rounds} round(s)"
    )
    print(f"{'harness':<36}{'session s':>11}{'per test ms':>13}{'load':>7}")
    for name in chosen:
        load = statistics.median(loads[name])
        print(f"{name:<36}{statistics.median(walls[name]):>11.2f}{per_test[name] * 1e3:>13.1f}{load:>7.1f}")
    print(f"{'ours / theirs':<60}{'ratio':>9}")
    for key, value in ratios.items():
        print(f"{key:<60}{value:>9.4f}")
    print(
        json.dumps(
            {
                "benchmark": "harness_overhead",
                "ratios": {name: round(r, 5) for name, r in ratios.items()},
                "tests": count,
                "rounds": args.rounds,
                "session_seconds": {name: [round(w, 3) for w in ws] for name, ws in walls.items()},
                "per_test_ms": {name: round(v * 1e3, 2) for name, v in per_test.items()},
                "load_1min": {name: [round(v, 2) for v in ls] for name, ls in loads.items()},
            }
        )
    )


if __name__ == "__main__":
    main()

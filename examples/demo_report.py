"""Summarise the main job's two runs: the parity with one process, the resume, and a loss-curve PNG.

``python examples/demo_report.py demo-out`` reads ``losses-run.json`` (the first layout)
and ``losses-resumed.json`` (the other layout, from the checkpoint) that ``llama_3d.py``
wrote, prints the comparison, writes ``loss.png`` beside them, and exits non-zero when the
runs disagree beyond bf16's precision (so the demo can never show a wrong result as fine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BF16_TOLERANCE = 2e-2  # bf16 compute on both sides; reduction orders differ


def main(out: Path) -> int:
    run = json.loads((out / "losses-run.json").read_text())
    resumed_path = out / "losses-resumed.json"
    resumed = json.loads(resumed_path.read_text()) if resumed_path.exists() else None
    steps = sorted(int(k) for k in run["loss"])
    ours = [run["loss"][str(s)] for s in steps]
    ref = [run["reference"][str(s)] for s in steps]
    worst = max(abs(a - b) for a, b in zip(ours, ref, strict=True))
    layout = "x".join(str(v) for v in run["layout"])
    print(
        f"layout pp x dp x tp = {layout}: largest loss difference to one process {worst:.1e}, "
        f"largest parameter difference {run['max_param_diff']:.1e}"
    )
    ok = worst <= BF16_TOLERANCE and run["max_param_diff"] <= BF16_TOLERANCE
    resumed_steps: list[int] = []
    if resumed is not None:
        resumed_steps = sorted(int(k) for k in resumed["loss"])
        again = max(
            abs(resumed["loss"][str(s)] - run["loss"][str(s)]) for s in resumed_steps if str(s) in run["loss"]
        )
        other = "x".join(str(v) for v in resumed["layout"])
        print(
            f"resumed from the checkpoint on {other}: steps {resumed_steps[0] + 1}-{resumed_steps[-1] + 1}, "
            f"largest loss difference to the uninterrupted run {again:.1e}"
        )
        ok = ok and again <= BF16_TOLERANCE
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png (bash scripts/demo.sh installs it)")
    else:
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([s + 1 for s in steps], ref, "o-", label="one process", color="#888888")
        ax.plot([s + 1 for s in steps], ours, "x--", label=f"hyperparallel, {layout}", color="#d62728")
        if resumed is not None:
            ax.plot(
                [s + 1 for s in resumed_steps],
                [resumed["loss"][str(s)] for s in resumed_steps],
                "s:",
                label=f"resumed on {'x'.join(str(v) for v in resumed['layout'])}",
                color="#1f77b4",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("pipeline x FSDP x TP against one process (bf16)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png")
        print(f"wrote {out / 'loss.png'}")
    print("parity: OK" if ok else f"parity: FAILED (beyond {BF16_TOLERANCE})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out")))

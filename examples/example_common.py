"""What the small examples share: a residual MLP block, the model built from it, the parity verdict.

Each example imports this from its own folder (``hp-run`` and ``torchrun`` both put the
script's folder on ``sys.path``), so the scripts themselves show only what they teach.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "build", "finish"]


class Block(nn.Module):
    """A residual MLP block: the unit ``fully_shard`` gathers and frees as one, and TP splits."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def build(dim: int, layers: int) -> nn.Module:
    """``layers`` blocks and a scalar head, with the same initial weights on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(*(Block(dim) for _ in range(layers)), nn.Linear(dim, 1))


def finish(worst: float, tolerance: float, what: str) -> None:
    """Print the parity line on rank 0; every rank exits non-zero when it fails."""
    report = torch.tensor([worst])
    dist.all_reduce(report, op=dist.ReduceOp.MAX)  # every rank decides on the same number
    worst = float(report)
    ok = worst <= tolerance  # False for NaN too
    if dist.get_rank() == 0:
        print(f"parity ({what}): largest difference to one process {worst:.2e} (tolerance {tolerance:g})")
        print("parity: OK" if ok else "parity: FAILED")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)

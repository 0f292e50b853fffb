"""A compiled graph's functional collectives are checked each time the graph runs, not only when traced.

[Note: compiled graphs under the emulation] in ``hp_testing/_funcol_ops.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from hp_testing.emulation import active_layer


@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_every_run_of_a_compiled_graph_is_checked(rank: int) -> None:
    torch._dynamo.reset()
    group = dist.group.WORLD

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x: torch.Tensor) -> torch.Tensor:
        summed = funcol.all_reduce(x * 2, "sum", group)
        gathered = funcol.all_gather_tensor(summed, 0, group)
        return gathered + 1

    layer = active_layer()
    assert layer is not None, "the nccl-emu marker installs the emulation layer"
    x = torch.full((2,), float(rank + 1))
    step(x)  # traced (the entry points are checked there), then run
    before = layer.calls
    for _ in range(3):
        out = step(x)
    # each run: one all-reduce and one all-gather, through the checked torch.distributed calls
    assert layer.calls - before == 6, layer.calls - before
    assert out.tolist() == [7.0, 7.0, 7.0, 7.0], out  # (1 + 2) * 2 + 1 on both halves

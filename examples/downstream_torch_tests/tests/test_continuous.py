"""Tests on ``MultiProcContinuousTest``: torch keeps ranks per class; hp-testing keeps them per session."""

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests


class ReduceScatterTest(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    def test_reduce_scatter_tensor(self) -> None:
        inp = torch.arange(4.0) + self.rank
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, inp)
        self.assertEqual(out, (2 * torch.arange(4.0) + 1).chunk(2)[self.rank])


if __name__ == "__main__":
    run_tests()

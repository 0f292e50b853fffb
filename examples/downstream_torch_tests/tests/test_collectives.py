"""Collectives tests written the way PyTorch's own c10d tests are (``MultiProcessTestCase``).

Each test initialises its process group on a file store and tears it down; under
hp-testing the ranks adopt the pool's group instead, so neither costs anything.
Runs unchanged under ``python -m pytest`` with or without hp-testing installed.
"""

import os

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase, skip_if_lt_x_gpu
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests


class CollectivesTest(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def tearDown(self) -> None:
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass

    def _init(self) -> None:
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

    @parametrize("dtype", [torch.float32, torch.float64])
    def test_all_reduce_sum(self, dtype: torch.dtype) -> None:
        self._init()
        t = torch.full((4,), float(self.rank + 1), dtype=dtype)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((4,), 3.0, dtype=dtype))
        dist.destroy_process_group()

    def test_all_gather_into_tensor(self) -> None:
        self._init()
        out = torch.empty(2 * self.world_size)
        dist.all_gather_into_tensor(out, torch.full((2,), float(self.rank)))
        self.assertEqual(out, torch.tensor([0.0, 0.0, 1.0, 1.0]))
        dist.destroy_process_group()

    def test_broadcast_subtests(self) -> None:
        self._init()
        for src in range(self.world_size):
            with self.subTest(src=src):
                t = torch.tensor([float(self.rank)])
                dist.broadcast(t, src=src)
                self.assertEqual(t.item(), float(src))
        dist.destroy_process_group()

    @skip_if_lt_x_gpu(2)
    def test_needs_two_gpus(self) -> None:
        torch.cuda.set_device(self.rank)


instantiate_parametrized_tests(CollectivesTest)

if __name__ == "__main__":
    run_tests()

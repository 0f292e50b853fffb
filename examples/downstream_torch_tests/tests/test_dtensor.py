"""Tensor-parallel tests written the way PyTorch's DTensor tests are (``DTensorTestBase``, ``@with_comms``).

Values and gradients are compared with the same computation on plain tensors.
"""

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, MLPModule, with_comms


class MLPParallelTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_colwise_rowwise_mlp_matches_one_process(self) -> None:
        mesh = self.build_device_mesh()
        torch.manual_seed(0)
        reference = MLPModule(self.device_type)
        model = MLPModule(self.device_type)
        model.load_state_dict(reference.state_dict())
        parallelize_module(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
        x = torch.randn(8, 10)
        out, expected = model(x), reference(x)
        self.assertEqual(out, expected)
        out.sum().backward()
        expected.sum().backward()
        self.assertEqual(model.net1.weight.grad.full_tensor(), reference.net1.weight.grad)
        self.assertEqual(model.net2.weight.grad.full_tensor(), reference.net2.weight.grad)

    @with_comms
    def test_redistribute_shard_to_replicate(self) -> None:
        mesh = self.build_device_mesh()
        full = torch.arange(12.0).reshape(4, 3)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(sharded.to_local(), full.chunk(self.world_size)[self.rank])
        self.assertEqual(sharded.redistribute(mesh, [Replicate()]).to_local(), full)


if __name__ == "__main__":
    run_tests()

"""FSDP2 tests on a 2-D mesh, written the way PyTorch's are (``DTensorTestBase``, ``@with_comms``).

Each test builds its own mesh (new process groups) and ends with
``clip_grad_norm_``, whose reduction torch caches by mesh. Run on reused
(pooled) ranks, the second test used to fail: "Could not resolve the process
group registered under the name 3". Gradients and the norm are compared with
the same step on one process.
"""

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class HSDPTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    def _step_matches_one_process(self, reshard_after_forward: bool) -> None:
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model = copy.deepcopy(reference)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        x = torch.randn(3, 8)  # the same batch on every rank: the mean gradient is one process's
        model(x).square().sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        reference(x).square().sum().backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        self.assertEqual(norm.full_tensor(), expected)
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            self.assertEqual(ours.grad.full_tensor(), theirs.grad)

    @with_comms
    def test_step_resharding_after_forward(self) -> None:
        self._step_matches_one_process(True)

    @with_comms
    def test_step_keeping_parameters_after_forward(self) -> None:
        self._step_matches_one_process(False)


if __name__ == "__main__":
    run_tests()

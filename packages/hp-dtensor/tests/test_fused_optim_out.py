"""The ``.out`` overloads of the fused optimizer kernels on DTensor parameters, against one process.

torch's optimizers never call ``_fused_adam.out`` and kin (they call the
in-place kernels; ``torch.compile`` the functional ones): only a hand-written
``torch.ops.aten._fused_adam.out(...)`` reaches them ([Note: the .out
variants] in ``ops/optim.py``). Every argument and ``out`` must end as the
plain kernel leaves them, placed like before (``out`` like its parameter),
with no fallback and no gather for a parameter-placed ``out``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

aten = torch.ops.aten
ADAM = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
SGD = dict(
    weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0, nesterov=True, maximize=False, is_first_step=False
)
KERNELS: dict[str, tuple[Any, int, dict[str, Any]]] = {
    # name: (kernel, number of parameter-shaped lists, keyword arguments)
    "adam": (aten._fused_adam.out, 4, ADAM),
    "adamw-tensor-lr": (aten._fused_adamw.tensor_lr_out, 4, dict(ADAM, lr=torch.tensor(0.1))),
    "sgd": (aten._fused_sgd.out, 3, SGD),
    "adagrad": (
        aten._fused_adagrad.out,
        3,
        dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, eps=1e-10, maximize=False),
    ),
}


def _call(name: str, lists: list[list[Any]], steps: list[Any], out: list[Any]) -> None:
    kernel, _, kwargs = KERNELS[name]
    if name == "sgd":
        args: tuple[Any, ...] = tuple(lists)
    elif name == "adagrad":
        args = (*lists, steps)
    else:
        args = (*lists, [], steps)
    kernel(*args, **kwargs, out=out)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(KERNELS))
def test_out_variants_match_one_process(rank, device_mesh_factory, name) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    shapes = [(5, 3), (3,)]  # 5 rows over 2 ranks: uneven
    count = KERNELS[name][1]
    plain = [[torch.randn(s, dtype=torch.float64).abs() for s in shapes] for _ in range(count)]
    plain_steps = [torch.tensor(3.0) for _ in shapes]
    placements = [[Shard(0)], [Replicate()]]
    lists = [
        [distribute_tensor(t.clone(), mesh, p) for t, p in zip(row, placements, strict=True)] for row in plain
    ]
    steps = [distribute_tensor(t.clone(), mesh, [Replicate()]) for t in plain_steps]
    plain_out = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    out = [
        distribute_tensor(torch.zeros(s, dtype=torch.float64), mesh, p)
        for s, p in zip(shapes, placements, strict=True)
    ]
    before = [[t.clone() for t in row] for row in plain]
    _call(name, plain, plain_steps, plain_out)
    with fallback_policy("error"), record_collectives() as log:
        _call(name, lists, steps, out)
    assert dict(log.counts()) == {}, f"{name}: {dict(log.counts())}"
    for got, want, p in zip(out, plain_out, placements, strict=True):
        assert isinstance(got, DTensor) and list(got.placements) == p
        torch.testing.assert_close(got.full_tensor(), want)
    for row, want_row in zip(lists, plain, strict=True):
        for got, want in zip(row, want_row, strict=True):
            torch.testing.assert_close(got.full_tensor(), want)
    # the parameter-shaped lists are whatever the plain kernel left: check it is a real step
    assert not torch.equal(plain_out[0], before[0][0])


@pytest.mark.distributed(world_size=2)
def test_out_variant_moves_a_misplaced_out_and_refuses_a_plain_one(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(1)
    plain = [[torch.randn(5, 3, dtype=torch.float64)] for _ in range(3)]
    lists = [[distribute_tensor(row[0].clone(), mesh, [Shard(0)])] for row in plain]
    plain_out = [torch.zeros(5, 3, dtype=torch.float64)]
    out = [distribute_tensor(torch.zeros(5, 3, dtype=torch.float64), mesh, [Replicate()])]
    _call("sgd", plain, [], plain_out)
    with fallback_policy("error"):
        _call("sgd", lists, [], out)
    assert out[0].placements == (Shard(0),)
    torch.testing.assert_close(out[0].full_tensor(), plain_out[0])
    # refused before anything moves: a replicated gradient stays replicated
    lists[1] = [distribute_tensor(plain[1][0].clone(), mesh, [Replicate()])]
    with pytest.raises(TypeError, match=r"out\[0\] is a plain Tensor for a DTensor parameter"):
        _call("sgd", lists, [], [torch.zeros(5, 3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="out has 2 tensors for 1 parameters"):
        _call("sgd", lists, [], out + out)
    assert lists[1][0].placements == (Replicate(),)

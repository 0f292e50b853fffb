"""An in-place op never changes its destination's placements or local tensor.

A ``StridedShard`` operand used to move a plain ``Shard`` destination of
``copy_`` / ``add_`` to the strided cut (``Shard(0)`` came back as
``StridedShard(0, 2)``) and replace its local tensor: values right, but a
parameter held by hp-fsdp in a flat buffer would have been cut loose from it
([Note: an in-place op keeps its destination's layout] in
``hp_dtensor/redistribute.py``). Checked against plain tensors.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hp_dtensor import DTensor, Partial, Replicate, Shard, StridedShard, distribute_tensor

A = torch.arange(48.0).reshape(6, 8) / 5 - 3


@pytest.mark.distributed(world_size=2)
def test_in_place_ops_keep_the_destination(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    sources = ([StridedShard(1, 2)], [StridedShard(0, 3)], [Shard(1)], [Replicate()])
    for source in sources:
        for dest in ([Shard(0)], [Shard(1)], [Replicate()]):
            src = distribute_tensor(A, mesh, source)
            for op, want in (
                (lambda d, s: d.copy_(s), A),
                (lambda d, s: d.add_(s), A + 1),
                (lambda d, s: d.mul_(s), A),
            ):
                # the destination's local tensor is a view into a larger buffer, as hp-fsdp's are
                piece = distribute_tensor(torch.ones(6, 8), mesh, dest).to_local()
                buffer = torch.zeros(piece.numel() + 3)
                buffer[3:].copy_(piece.reshape(-1))
                local = buffer[3:].view(piece.shape)
                d = DTensor.from_local(local, mesh, dest, shape=(6, 8))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    returned = op(d, src)
                where = f"{source} into {dest}"
                assert returned is d, where
                assert list(d.placements) == dest, where
                assert d.to_local().data_ptr() == local.data_ptr(), where
                torch.testing.assert_close(d.full_tensor(), want, msg=where)
                torch.testing.assert_close(buffer[3:].view(piece.shape), d.to_local(), msg=where)


@pytest.mark.distributed(world_size=2)
def test_foreach_and_partial_destinations_are_kept(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    for source in ([StridedShard(1, 2)], [StridedShard(0, 3)], [Replicate()]):
        for dest in ([Shard(0)], [Shard(1)]):
            d = distribute_tensor(torch.ones(6, 8), mesh, dest)
            e = distribute_tensor(torch.ones(6, 8), mesh, dest)
            local = d.to_local()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch._foreach_add_([d, e], [distribute_tensor(A, mesh, source)] * 2, alpha=2.0)
            where = f"{source} into {dest}"
            for t in (d, e):
                assert list(t.placements) == dest, where
                torch.testing.assert_close(t.full_tensor(), 1 + 2 * A, msg=where)
            assert d.to_local().data_ptr() == local.data_ptr(), where
    # a partial destination that the op must reduce first comes back partial, its value right
    p = DTensor.from_local(torch.full((6, 8), 0.5), mesh, [Partial()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p.add_(distribute_tensor(A, mesh, [Replicate()]))
    assert list(p.placements) == [Partial()]
    torch.testing.assert_close(p.full_tensor(), 1 + A)

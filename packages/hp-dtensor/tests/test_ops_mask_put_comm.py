"""``x[mask] = values`` where the values line up with the dims after the mask: a local ``where``.

``x[row_mask] = row`` writes the same row into every selected row, so each
rank writes its own piece of ``x`` with its own piece of the values (cut like
the dims after the mask), whatever dim of ``x`` is cut: no collective.
Values with one entry per selected element still need the whole mask.
Values and gradients are checked against full tensors, on uneven cuts; the
gradient of the values is ``grad[mask]``, a read whose size depends on the
data, which still takes the replicated fallback (checked for values only).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import Replicate, Shard, fallback_stats

sys.path.insert(0, str(Path(__file__).parent))
from op_compare import check

R = Replicate()
NO_COMM: dict[str, int] = {}


def _put(accumulate: bool):  # type: ignore[no-untyped-def]
    return lambda x, mask, values: x.index_put((mask,), values, accumulate=accumulate)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("accumulate", [False, True])
def test_mask_put_with_values_along_the_trailing_dims_is_local(rank, device_mesh_factory, accumulate) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    before = fallback_stats()
    cases = {
        "rows of a matrix": ((5, 5), (5,), (5,)),
        "rows, values broadcast over one dim": ((5, 4, 3), (5,), (1, 3)),
        "a 2-D mask": ((5, 4, 3), (5, 4), (3,)),
        "one value": ((5, 3), (5,), ()),
    }
    for name, (shape, mask_shape, value_shape) in cases.items():
        x = torch.randn(*shape, dtype=torch.float64)
        mask = torch.rand(*mask_shape) > 0.4
        values = torch.randn(value_shape, dtype=torch.float64)
        for d in range(len(shape)):
            check(
                _put(accumulate),
                [x, mask, values],
                [[Shard(d)], [R], [R]],
                mesh,
                constant=(2,),  # the values' gradient reads x[mask]: see the last test
                expect=[Shard(d)],
                forward_collectives=NO_COMM,
                tag=f"{name} S({d}) accumulate={accumulate}",
            )
    assert fallback_stats() == before


@pytest.mark.distributed(world_size=2)
def test_mask_put_with_one_value_per_selected_element_stays_right(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Values sized by the number of selected rows: not a ``where``; the right answer, by a gather."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64)
    mask = torch.tensor([True, False, True, True, False])
    values = torch.randn(3, 3, dtype=torch.float64)
    for cut in ([Shard(0)], [Shard(1)]):
        check(
            _put(False),
            [x, mask, values],
            [cut, [R], [R]],
            mesh,
            constant=(2,),
            tag=f"per-element values {cut}",
        )


@pytest.mark.distributed(world_size=2)
def test_mask_put_gradient_of_the_values(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The values' gradient, ``grad[mask]`` summed over the selected rows, is right (through the fallback)."""
    import warnings

    from hp_dtensor import distribute_tensor

    mesh = device_mesh_factory((2,))
    torch.manual_seed(0)
    x, mask, values = torch.randn(5, 4), torch.rand(5) > 0.4, torch.randn(4, requires_grad=True)
    x.index_put((mask,), values).sum().backward()
    leaf = distribute_tensor(values.detach(), mesh, [R]).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grad[mask] has a data-dependent size: the fallback
        out = distribute_tensor(x, mesh, [Shard(1)]).index_put((distribute_tensor(mask, mesh, [R]),), leaf)
        out.sum().backward()
    torch.testing.assert_close(leaf.grad.full_tensor(), values.grad)

"""``hp_dtensor.local_map`` with torch's semantics, against plain single-process tensors (2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from hp_dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, local_map
from hp_testing import record_collectives


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randn(
        6, 3, generator=gen, dtype=torch.float64
    )


def _mm(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    assert type(w) is torch.Tensor and type(x) is torch.Tensor  # func sees plain local tensors
    return torch.mm(w, x)


@pytest.mark.distributed(world_size=2)
def test_values_and_gradients_against_plain_tensors(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    W, X = _data()
    ref_w, ref_x = W.clone().requires_grad_(), X.clone().requires_grad_()
    (ref_w @ ref_x).sin().sum().backward()

    local_mm = local_map(
        _mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]), device_mesh=mesh
    )
    w = distribute_tensor(W, mesh, [Shard(1)]).requires_grad_()
    x = distribute_tensor(X, mesh, [Shard(0)]).requires_grad_()
    with record_collectives() as log:
        y = local_mm(w, x)
    assert log.count() == 0  # no redistribution, no checks that communicate
    assert isinstance(y, DTensor) and y.placements == (Partial(),) and y.shape == (4, 3)
    out = y.full_tensor()
    torch.testing.assert_close(out, W @ X)
    out.sin().sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), ref_w.grad)
    torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
    assert local_mm.__name__ == "_mm"  # functools.wraps


@pytest.mark.distributed(world_size=2)
def test_decorator_kwargs_and_non_tensor_values(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    W, _ = _data()

    @local_map(out_placements=([Shard(0)], None), in_placements=([Shard(0)], None))
    def scaled(t: torch.Tensor, factor: float, *, shift: float = 0.0) -> tuple[torch.Tensor, int]:
        return t * factor + shift, t.shape[0]

    w = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_()
    y, rows = scaled(w, 3.0, shift=1.0)
    assert rows == 2 and y.placements == (Shard(0),)  # the non-tensor output stays as func returned it
    torch.testing.assert_close(y.full_tensor(), W * 3 + 1)
    y.full_tensor().sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), torch.full_like(W, 3.0))

    # Without a DTensor argument func runs on plain tensors and its outputs are returned as they are.
    plain, n = scaled(W, 2.0)
    assert type(plain) is torch.Tensor and n == 4
    torch.testing.assert_close(plain, W * 2)
    # A plain tensor beside a DTensor is passed through unchecked (torch's rule), outputs wrapped.
    both = local_map(torch.add, out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]))
    added = both(distribute_tensor(W, mesh, [Shard(0)]), W[rank * 2 : rank * 2 + 2])
    torch.testing.assert_close(added.full_tensor(), W * 2)


@pytest.mark.distributed(world_size=2)
def test_in_grad_placements(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    W, _ = _data()

    def times_rank(t: torch.Tensor) -> torch.Tensor:
        return t * (rank + 1)  # the terms of 3 * W, summed over the 2 ranks

    # The local gradients (1 and 2) are partial terms of the true gradient 3: say so, and x.grad is right.
    hinted = local_map(times_rank, [Partial()], ([Replicate()],), ([Partial()],))
    x = distribute_tensor(W, mesh, [Replicate()]).requires_grad_()
    y = hinted(x)
    torch.testing.assert_close(y.full_tensor(), W * 3)
    y.full_tensor().sum().backward()
    assert x.grad.placements == (Partial(),)
    torch.testing.assert_close(x.grad.full_tensor(), torch.full_like(W, 3.0))


@pytest.mark.distributed(world_size=2)
def test_redistribute_inputs(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    W, X = _data()
    w = distribute_tensor(W, mesh, [Shard(0)])  # mm wants Shard(1)
    x = distribute_tensor(X, mesh, [Shard(0)])
    strict = local_map(_mm, [Partial()], ([Shard(1)], [Shard(0)]))
    with record_collectives() as log:
        with pytest.raises(
            ValueError, match=r"argument 0 has placements \[Shard\(dim=0\)\] but in_placements\[0\] "
        ):
            strict(w, x)
    assert log.count() == 0
    moving = local_map(_mm, [Partial()], ([Shard(-1)], [Shard(0)]), redistribute_inputs=True)
    with record_collectives() as log:
        y = moving(w, x)
    assert log.counts() == {"all_to_all_single": 1}
    torch.testing.assert_close(y.full_tensor(), W @ X)
    # An async redistribution's result reaches func finished, as a plain tensor.
    seen = []
    peek = local_map(lambda t: seen.append(type(t)) or t * 1, [Replicate()], ([Replicate()],))
    z = peek(w.redistribute(placements=[Replicate()], async_op=True))
    assert seen == [torch.Tensor]
    torch.testing.assert_close(z.to_local(), W)


@pytest.mark.distributed(world_size=2)
def test_bad_input(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    W, _ = _data()
    w = distribute_tensor(W, mesh, [Shard(0)])
    ident = lambda t, *rest: t * 1  # noqa: E731
    cases = [
        (
            local_map(ident, [Shard(0)], ([Shard(0)],)),
            (w, 2),
            r"in_placements has 1 entries but .* flatten to 2",
        ),
        (
            local_map(ident, [Shard(0)], (None,)),
            (w,),
            r"in_placements\[0\] is None but that argument is a DTensor",
        ),
        (
            local_map(ident, [Shard(0)], ([Shard(0)], [Shard(0)])),
            (w, 2),
            r"argument 1 is a int \(2\), not a tensor",
        ),
        (
            local_map(ident, ([Shard(0)], None)),
            (w,),
            r"func returned 1 value\(s\) .* out_placements has 2 entries",
        ),
        (
            local_map(ident, None),
            (w,),
            r"output 0 is a tensor of shape \(2, 6\) but its out_placements entry is None",
        ),
        (local_map(lambda t: 1, [Shard(0)]), (w,), r"output 0 is a int \(1\), not a tensor"),
    ]
    for fn, args, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(*args)
    with pytest.raises(TypeError, match="already a DTensor"):
        local_map(lambda t: w, [Shard(0)])(w)
    with pytest.raises(TypeError, match="redistribute_inputs must be True or False, got str 'no'"):
        local_map(ident, [Shard(0)], redistribute_inputs="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="in_placements must be a tuple"):
        local_map(ident, [Shard(0)], in_placements=Shard(0))  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(rank, device_mesh_factory, backend) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    W, X = _data()
    local_mm = local_map(_mm_traceable, [Partial()], ([Shard(1)], [Shard(0)]), redistribute_inputs=True)

    def step(w: DTensor, x: DTensor) -> torch.Tensor:
        return local_mm(w, x).redistribute(placements=[Replicate()]).to_local().sin()

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for scale in (1.0, 2.0):  # the second call reuses the graph
        ref_w, ref_x = (W * scale).requires_grad_(), X.clone().requires_grad_()
        (ref_w @ ref_x).sin().sum().backward()
        w = distribute_tensor(W * scale, mesh, [Shard(0)]).requires_grad_()  # moved to Shard(1) inside
        x = distribute_tensor(X, mesh, [Shard(0)]).requires_grad_()
        out = compiled(w, x)
        torch.testing.assert_close(out, (ref_w @ ref_x).sin())
        out.sum().backward()
        torch.testing.assert_close(w.grad.full_tensor(), ref_w.grad)
        torch.testing.assert_close(x.grad.full_tensor(), ref_x.grad)
    assert counter.frame_count == 1


def _mm_traceable(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x)

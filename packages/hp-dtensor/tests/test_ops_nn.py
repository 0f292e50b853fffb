"""Dedicated rules for attention, losses, embeddings, softmax and max: values, gradients, communication."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from hp_testing import record_collectives


def check(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    placements: Sequence[Sequence[Placement]],
    mesh,  # type: ignore[no-untyped-def]
    *,
    expect: Sequence[Placement] | None = None,
    forward_collectives: dict[str, int] | None = None,
    constant: Sequence[int] = (),
) -> DTensor:
    """``fn`` on DTensors against ``fn`` on full tensors: output, every input gradient, placements, comms.

    Floating inputs get gradients, except those whose index is in ``constant``.
    """
    grads = [t.is_floating_point() and i not in constant for i, t in enumerate(inputs)]
    full = [t.clone().requires_grad_(g) for t, g in zip(inputs, grads, strict=True)]
    ref = fn(*full)
    (ref * torch.linspace(0.5, 1.5, ref.numel(), dtype=ref.dtype).view(ref.shape)).sum().backward()
    dts = [
        distribute_tensor(t.clone().requires_grad_(g), mesh, list(p))
        for t, p, g in zip(inputs, placements, grads, strict=True)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dedicated rule, never the replicated fallback
        with record_collectives() as log:
            out = fn(*dts)
        counts = log.counts()
        assert isinstance(out, DTensor), type(out)
        if forward_collectives is not None:
            assert dict(counts) == forward_collectives, f"forward issued {dict(counts)}"
        if expect is not None:
            assert out.placements == tuple(expect), out.placements
        got = out.full_tensor()
        torch.testing.assert_close(got, ref)
        (got * torch.linspace(0.5, 1.5, got.numel(), dtype=got.dtype).view(got.shape)).sum().backward()
    for d, f in zip(dts, full, strict=True):
        if f.grad is not None:
            assert d.grad is not None
            torch.testing.assert_close(d.grad.full_tensor(), f.grad)
    return out


S0, S1, S2, R = [Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]
NO_COMM: dict[str, int] = {}


@pytest.mark.distributed(world_size=4)
def test_sdpa_with_heads_or_batch_sharded(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(5, 5, dtype=torch.float64)

    def causal(a, b, c):  # type: ignore[no-untyped-def]
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    heads = [Shard(1)]
    check(causal, [q, k, v], [heads] * 3, line, expect=heads, forward_collectives=NO_COMM)
    check(causal, [q, k, v], [[Shard(0), Shard(1)]] * 3, grid, expect=[Shard(0), Shard(1)])
    # an additive mask (a constant: a mask that needs a gradient takes the math path) that
    # broadcasts over batch and heads stays replicated
    check(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask),
        [q, k, v],
        [heads, heads, heads],
        line,
        expect=heads,
        forward_collectives=NO_COMM,
    )
    # a boolean mask with a heads dim is cut with the heads
    keep = torch.rand(1, 4, 5, 5) > 0.3
    keep[..., 0] = True  # every query sees at least one key
    check(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=keep),
        [q, k, v],
        [heads, heads, heads],
        line,
        expect=heads,
        forward_collectives=NO_COMM,
    )
    # grouped-query attention: 4 query heads over 2 key/value heads, heads cut in 2
    kv = torch.randn(2, 2, 5, 8, dtype=torch.float64)
    check(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True),
        [q, kv, kv.flip(-1).contiguous()],
        [[Replicate(), Shard(1)]] * 3,
        grid,
        expect=[Replicate(), Shard(1)],
        forward_collectives=NO_COMM,
    )


@pytest.mark.distributed(world_size=4)
def test_sdpa_with_a_trainable_mask(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A mask that needs a gradient takes the math path ([Note: why dropout and a trainable mask
    take the math path]); its pieces' rules give the right values and gradients, the mask's included."""
    line = device_mesh_factory((4,))
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(5, 5, dtype=torch.float64)
    heads = [Shard(1)]
    # Values and every gradient only: the math path's matmuls fold (batch, heads) into one dim and
    # gather the heads on the way, so the output comes back replicated (slower, still right).
    out = check(
        lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m),
        [q, k, v, mask],
        [heads, heads, heads, R],
        line,
    )
    assert out.shape == (2, 4, 5, 8)


def test_cpu_has_no_fused_sdpa_for_dropout_or_mask_gradients() -> None:
    """The facts [Note: why dropout and a trainable mask take the math path] rests on; when this
    fails, torch gained a fused CPU path and the note (and the rules) should be revisited."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with pytest.raises(RuntimeError, match="dropout"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.5)
    schema = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default._schema
    assert [r.name for r in schema.returns] == ["grad_query", "grad_key", "grad_value"], str(schema)


@pytest.mark.distributed(world_size=4)
def test_vocab_parallel_cross_entropy(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    line = device_mesh_factory((4,))
    torch.manual_seed(1)
    logits = torch.randn(6, 10, dtype=torch.float64)  # 10 classes over 4 ranks: 3, 3, 3, 1
    target = torch.tensor([0, 9, 3, -100, 5, 2])
    target_nd = target.clamp(min=0)
    weight = torch.rand(10, dtype=torch.float64) + 0.5
    psum = [Partial("sum")]
    # mean: one all-gather of each row's max and sum of exponentials (the log-softmax), no logits moved
    check(
        lambda x, t: F.cross_entropy(x, t),
        [logits, target],
        [S1, R],
        line,
        expect=psum,
        forward_collectives={"all_gather_into_tensor": 1},
    )
    check(lambda x, t: F.cross_entropy(x, t, reduction="sum"), [logits, target], [S1, R], line, expect=psum)
    check(lambda x, t: F.cross_entropy(x, t, reduction="none"), [logits, target], [S1, R], line, expect=psum)
    # class weights cut with the classes: one more all-reduce, of the scalar total weight
    check(
        lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=2),
        [logits, target_nd, weight],
        [S1, R, S0],
        line,
        expect=psum,
        forward_collectives={"all_gather_into_tensor": 1, "all_reduce": 1},
        constant=[2],
    )
    check(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), [logits, target], [S1, R], line)
    # nll_loss on log-probabilities of a single sample
    check(lambda x, t: F.nll_loss(x.log_softmax(0), t), [logits[0], target[1]], [S0, R], line, expect=psum)


@pytest.mark.distributed(world_size=4)
def test_batch_and_2d_cross_entropy(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(2)
    logits = torch.randn(7, 6, dtype=torch.float64)  # 7 samples over 4 ranks: 2, 2, 2, 1
    target = torch.tensor([1, 5, -100, 0, 4, 4, 2])
    check(lambda x, t: F.cross_entropy(x, t), [logits, target], [S0, S0], line, expect=[Partial("sum")])
    check(lambda x, t: F.cross_entropy(x, t, reduction="none"), [logits, target], [S0, S0], line, expect=S0)
    # batch on dp, classes on tp
    check(
        lambda x, t: F.cross_entropy(x, t),
        [logits, target],
        [[Shard(0), Shard(1)], [Shard(0), Replicate()]],
        grid,
        expect=[Partial("sum"), Partial("sum")],
    )
    check(
        lambda x, t: F.cross_entropy(x, t, reduction="none"),
        [logits, target],
        [[Shard(0), Shard(1)], [Shard(0), Replicate()]],
        grid,
        expect=[Shard(0), Partial("sum")],
    )


@pytest.mark.distributed(world_size=4)
def test_embeddings_row_and_column_wise(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(3)
    table = torch.randn(10, 6, dtype=torch.float64)  # rows over 4 ranks: 3, 3, 3, 1
    ids = torch.tensor([[1, 2, 9], [0, 4, 3], [8, 8, 6]])
    out = check(
        lambda t: F.embedding(ids, t),
        [table],
        [S0],
        line,
        expect=[Partial("sum")],
        forward_collectives=NO_COMM,
    )
    assert out.to_local().shape == (3, 3, 6)
    check(lambda t: F.embedding(ids, t), [table], [S1], line, expect=[Shard(2)], forward_collectives=NO_COMM)
    check(lambda t: F.embedding(ids, t, padding_idx=4), [table], [S0], line, expect=[Partial("sum")])
    check(
        lambda t: F.embedding(ids, t),
        [table],
        [[Shard(0), Shard(1)]],
        grid,
        expect=[Partial("sum"), Shard(2)],
    )
    # batch-sharded ids, replicated table: local lookups, a partial table gradient
    check(lambda t, i: F.embedding(i, t), [table, ids], [R, S0], line, expect=S0, forward_collectives=NO_COMM)


@pytest.mark.distributed(world_size=4)
def test_rowwise_embedding_backward_is_local(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A row-sharded table's gradient is computed as this rank's rows only, never the full table."""
    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(5)
    table = torch.randn(10, 6, dtype=torch.float64)  # rows over 4 ranks: 3, 3, 3, 1
    ids = torch.tensor([[1, 2, 9], [0, 4, 3], [8, 8, 6]])
    cases = [
        (line, S0, {}, (Shard(0),)),
        (line, S0, {"padding_idx": 4}, (Shard(0),)),
        (grid, [Shard(0), Shard(1)], {}, (Shard(0), Shard(1))),
        # scale_grad_by_freq counts ids over the whole vocabulary: the full (replicated) gradient
        (line, S0, {"scale_grad_by_freq": True}, (Replicate(),)),
    ]
    for mesh, placements, options, grad_placements in cases:
        full = table.clone().requires_grad_(True)
        weights = torch.linspace(0.5, 1.5, 3 * 3 * 6, dtype=torch.float64).view(3, 3, 6)
        (F.embedding(ids, full, **options) * weights).sum().backward()
        dt = distribute_tensor(table.clone().requires_grad_(True), mesh, list(placements))
        out = F.embedding(ids, dt, **options)
        with record_collectives() as log:
            (out.full_tensor() * weights).sum().backward()
        counts = log.counts()
        grad = dt.grad
        assert isinstance(grad, DTensor)
        assert grad.placements == grad_placements, (options, grad.placements)
        if grad_placements == tuple(placements):
            # only this rank's shard was built: the local gradient has the local table's shape
            assert grad.to_local().shape == dt.to_local().shape, (grad.to_local().shape, dt.to_local().shape)
        assert full.grad is not None
        torch.testing.assert_close(grad.full_tensor(), full.grad)
        assert "all_gather_into_tensor" not in counts or mesh is grid, dict(counts)


@pytest.mark.distributed(world_size=4)
def test_softmax_over_a_sharded_dim(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    line = device_mesh_factory((4,))
    torch.manual_seed(4)
    x = torch.randn(3, 6, dtype=torch.float64)  # 6 columns over 4 ranks: 2, 2, 2, 0
    one = {"all_gather_into_tensor": 1}  # each row's max and sum of exponentials, per rank
    check(lambda a: torch.softmax(a, -1), [x], [S1], line, expect=S1, forward_collectives=one)
    check(lambda a: torch.log_softmax(a, 1), [x], [S1], line, expect=S1, forward_collectives=one)
    check(lambda a: torch.softmax(a, 0), [x], [S1], line, expect=S1, forward_collectives=NO_COMM)
    x32 = x.float()
    check(lambda a: torch.log_softmax(a, -1, dtype=torch.float64), [x32], [S1], line, expect=S1)
    masked = x.masked_fill(torch.tensor([True, False, False]).view(3, 1), float("-inf"))  # a row all -inf
    check(lambda a: torch._safe_softmax(a, -1), [masked], [S1], line, expect=S1, forward_collectives=one)


@pytest.mark.distributed(world_size=4)
def test_max_min_and_rms_norm(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    line = device_mesh_factory((4,))
    grid = device_mesh_factory((2, 2), ("dp", "tp"))
    torch.manual_seed(5)
    # small integers: ties across ranks, where the first occurrence must win
    x = torch.randint(0, 4, (5, 8)).to(torch.float64)
    for reduce in (torch.max, torch.min):
        for dim in (0, 1):
            full_values, full_indices = reduce(x, dim)
            for placements, mesh in (
                ([Shard(dim)], line),
                ([Shard(1 - dim)], line),
                ([Shard(0), Shard(1)], grid),
            ):
                dt = distribute_tensor(x, mesh, placements)
                with warnings.catch_warnings(), record_collectives() as log:
                    warnings.simplefilter("error")
                    values, indices = reduce(dt, dim)
                counts = log.counts()
                if placements == [Shard(dim)]:  # one all-reduce for the values, one for the indices
                    assert dict(counts) == {"all_reduce": 2}, dict(counts)
                    assert values.placements == indices.placements == (Replicate(),)
                torch.testing.assert_close(values.full_tensor(), full_values)
                torch.testing.assert_close(indices.full_tensor(), full_indices)
        check(lambda a: reduce(a, 1, keepdim=True).values * 2, [x + torch.rand(5, 8)], [S1], line)  # noqa: B023
        check(lambda a: reduce(a), [x + torch.rand(5, 8)], [S0], line)  # noqa: B023
    y = x + torch.rand(5, 8)
    check(lambda a: torch.amin(a, 1), [y], [S1], line, expect=[Partial("min")])
    index = torch.randint(0, 8, (5, 3))
    check(
        lambda a, i: torch.gather(a, 1, i) * 3, [y, index], [S0, S0], line, expect=S0
    )  # backward: scatter_add
    x3 = torch.randn(4, 3, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    check(lambda a, g: F.rms_norm(a, (8,), g, eps=1e-6), [x3, w], [S2, R], line, expect=S2)
    check(lambda a, g: F.rms_norm(a, (8,), g), [x3, w], [S0, R], line, expect=S0)
    uneven = torch.randn(4, 3, 6, dtype=torch.float64)
    check(lambda a: F.rms_norm(a, (6,)), [uneven], [S2], line)


@pytest.mark.distributed(world_size=2)
def test_adamw_foreach_with_partial_gradients(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """A partial gradient appears twice in AdamW's ``addcmul_(v, g, g)``: both places are reduced."""
    mesh = device_mesh_factory((2,))
    torch.manual_seed(6)
    full_grad = torch.randn(4, 3, dtype=torch.float64)
    start = [torch.randn(4, 3, dtype=torch.float64) for _ in range(2)]
    ref = [p.clone().requires_grad_() for p in start]
    params = [distribute_tensor(p, mesh, pl).requires_grad_() for p, pl in zip(start, (R, S0), strict=True)]
    opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, foreach=True)
    for step in range(3):
        grad = full_grad * (step + 1)
        for p, r in zip(params, ref, strict=True):
            term = grad * (0.25 if rank == 0 else 0.75)  # the ranks' terms sum to the gradient
            p.grad = DTensor.from_local(term, mesh, [Partial("sum")])
            r.grad = grad.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        ref_opt.step()
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.full_tensor(), r.detach())
            assert p.placements in ((Replicate(),), (Shard(0),))

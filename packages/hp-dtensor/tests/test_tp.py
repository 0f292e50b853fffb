"""Tensor parallelism: an MLP, an attention block and a sequence-parallel block trained 5 AdamW steps.

Every model is checked against a single-process copy: the loss each step,
every gradient, and every parameter after each optimizer step.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hp_core import DeviceMesh
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    chunk_sizes,
    parallelize_module,
)
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from tp_models import MLP, Attention, ColwiseEmbeddingLM, SequenceParallelBlock, TinyLM


def _train(
    model: nn.Module,
    ref: nn.Module,
    dim: int,
    foreach: bool,
    *,
    seq: int = 4,
    shard_input: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gather_output: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=foreach)
    for step in range(5):
        torch.manual_seed(100 + step)
        x = torch.randn(2, seq, dim)
        out = model(shard_input(x) if shard_input else x)
        loss = (gather_output(out) if gather_output else out).pow(2).mean()
        ref_loss = ref(x).pow(2).mean()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert isinstance(p, DTensor), name
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(
                p.full_tensor(), r, rtol=1e-5, atol=1e-6, msg=f"step {step}: {p.placements}"
            )


@pytest.mark.distributed(world_size=4)
def test_mlp_and_attention_tp2_tp4(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    meshes = {4: device_mesh_factory((4,), ("tp",)), 2: device_mesh_factory((2, 2), ("dp", "tp"))["tp"]}
    for tp, mesh in meshes.items():
        torch.manual_seed(0)
        ref = MLP()
        model = parallelize_module(
            copy.deepcopy(ref), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        assert model.up.weight.placements[0].is_shard(0)
        _train(model, ref, 8, foreach=tp == 4)
        torch.manual_seed(0)
        ref_attn = Attention()
        plan = {
            "q": ColwiseParallel(use_local_output=False),
            "k": ColwiseParallel(use_local_output=False),
            "v": ColwiseParallel(use_local_output=False),
            "o": RowwiseParallel(),
        }
        attn = parallelize_module(copy.deepcopy(ref_attn), mesh, plan)
        _train(attn, ref_attn, 16, foreach=tp == 2)
        # attention ran on DTensors with one or two of the four heads per rank
        assert attn.seen == [(Shard(1),), (Shard(1),)], attn.seen
        assert ref_attn.seen == [None, None]


@pytest.mark.distributed(world_size=4)
def test_sequence_parallel_block_tp2_tp4(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    meshes = {4: device_mesh_factory((4,), ("tp",)), 2: device_mesh_factory((2, 2), ("dp", "tp"))["tp"]}
    for tp, mesh in meshes.items():
        torch.manual_seed(0)
        ref = SequenceParallelBlock()
        plan = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
            "out_norm": SequenceParallel(use_local_output=True),  # local, to add to the local h
        }
        model = parallelize_module(copy.deepcopy(ref), mesh, plan)
        assert model.norm.weight.placements == (Replicate(),)
        me = mesh.get_local_rank()
        seen: list[tuple[object, ...]] = []
        model.down.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))  # noqa: B023

        def shard_input(x: torch.Tensor) -> torch.Tensor:
            return x.chunk(tp, dim=1)[me].contiguous()  # noqa: B023

        def gather_output(out: torch.Tensor) -> torch.Tensor:
            assert not isinstance(out, DTensor) and out.shape == (2, 8 // tp, 8), out.shape  # noqa: B023
            return DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()  # noqa: B023

        _train(model, ref, 8, foreach=tp == 4, seq=8, shard_input=shard_input, gather_output=gather_output)
        # the MLP's output left the block reduce-scattered: this rank's sequence piece only
        assert seen[0] == (2, 8 // tp, 8), seen
        gather_output(model(shard_input(torch.randn(2, 8, 8)))).sum().backward()
        for name, param in model.named_parameters():  # the norms' partial gradients were reduced
            assert param.grad is not None and param.grad.placements == param.placements, name


@pytest.mark.distributed(world_size=4)
def test_vocab_parallel_embedding_and_loss_tp4(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Row-wise embedding, column-wise head, vocab-parallel cross-entropy: no logits are gathered."""
    mesh = device_mesh_factory((4,), ("tp",))
    torch.manual_seed(0)
    ref = TinyLM()
    plan = {"embed": RowwiseParallel(), "head": ColwiseParallel(use_local_output=False)}
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    logits = model(torch.randint(0, 12, (2, 5)))
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    _train_lm(model, ref, 12)


# -- uneven TP dims: torch.chunk cuts, some with an empty rank ([Note: uneven TP boundaries]) --------


def _tp_meshes(device_mesh_factory: Callable[..., DeviceMesh]) -> dict[int, DeviceMesh]:
    return {4: device_mesh_factory((4,), ("tp",)), 2: device_mesh_factory((2, 2), ("dp", "tp"))["tp"]}


def _train_lm(model: nn.Module, ref: nn.Module, vocab: int) -> None:
    """5 AdamW steps of next-token cross-entropy; logits may be vocab-sharded (vocab-parallel loss)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(5):
        torch.manual_seed(300 + step)
        ids = torch.randint(0, vocab, (2, 5))
        targets = ids.roll(1, 1).flatten()
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets)
        ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), targets)
        torch.testing.assert_close(
            loss.full_tensor() if isinstance(loss, DTensor) else loss, ref_loss, rtol=1e-5, atol=1e-6
        )
        loss.backward()
        ref_loss.backward()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad.placements == p.placements, name
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed(world_size=4)
def test_uneven_mlp(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Hidden 18 over 4 (5, 5, 5, 3), 3 over 4 (1, 1, 1, 0: a rank with no columns), 7 over 2 (4, 3)."""
    for tp, mesh in _tp_meshes(device_mesh_factory).items():
        for hidden in (18, 3) if tp == 4 else (7,):
            torch.manual_seed(0)
            ref = MLP(8, hidden)
            model = parallelize_module(
                copy.deepcopy(ref), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
            )
            me = mesh.get_local_rank()
            assert model.up.weight.to_local().shape[0] == chunk_sizes(hidden, tp)[me]
            _train(model, ref, 8, foreach=hidden != 7)


@pytest.mark.distributed(world_size=4)
def test_uneven_sequence_parallel_block(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Sequence 7 over 4 (2, 2, 2, 1), 5 over 4 (2, 2, 1, 0), 7 over 2 (4, 3); hidden 18, uneven too."""
    for tp, mesh in _tp_meshes(device_mesh_factory).items():
        for seq in (7, 5) if tp == 4 else (7,):
            torch.manual_seed(0)
            ref = SequenceParallelBlock(8, hidden=18)
            plan = {
                "norm": SequenceParallel(gather_input_sizes=True),
                "up": ColwiseParallel(input_layouts=Shard(1), gather_input_sizes=True),
                "down": RowwiseParallel(output_layouts=Shard(1)),
                "out_norm": SequenceParallel(use_local_output=True, gather_input_sizes=True),
            }
            model = parallelize_module(copy.deepcopy(ref), mesh, plan)
            me = mesh.get_local_rank()
            sizes = chunk_sizes(seq, tp)
            start, mine = sum(sizes[:me]), sizes[me]

            def shard_input(x: torch.Tensor) -> torch.Tensor:
                return x[:, start : start + mine].contiguous()  # noqa: B023

            def gather_output(out: torch.Tensor) -> torch.Tensor:
                assert not isinstance(out, DTensor) and out.shape == (2, mine, 8), out.shape  # noqa: B023
                return DTensor.from_local(out, mesh, [Shard(1)], shape=(2, seq, 8)).full_tensor()  # noqa: B023

            _train(
                model, ref, 8, foreach=tp == 4, seq=seq, shard_input=shard_input, gather_output=gather_output
            )


@pytest.mark.distributed(world_size=4)
def test_uneven_vocab_parallel_embedding_and_loss(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Row-wise embedding, column-wise head: vocab 7 (4 ranks: 2, 2, 2, 1; 2 ranks: 4, 3), 3 (1, 1, 1, 0)."""
    for tp, mesh in _tp_meshes(device_mesh_factory).items():
        for vocab in (7, 3) if tp == 4 else (7,):
            torch.manual_seed(0)
            ref = TinyLM(vocab=vocab, dim=6)
            plan = {"embed": RowwiseParallel(), "head": ColwiseParallel(use_local_output=False)}
            model = parallelize_module(copy.deepcopy(ref), mesh, plan)
            _train_lm(model, ref, vocab)


@pytest.mark.distributed(world_size=4)
def test_uneven_colwise_embedding(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """Column-wise embedding of 7 features (4 ranks: 2, 2, 2, 1; 2 ranks: 4, 3) or 3 into a row-wise head."""
    for tp, mesh in _tp_meshes(device_mesh_factory).items():
        for dim in (7, 3) if tp == 4 else (7,):
            torch.manual_seed(0)
            ref = ColwiseEmbeddingLM(vocab=10, dim=dim)
            plan = {"embed": ColwiseParallel(), "head": RowwiseParallel()}
            model = parallelize_module(copy.deepcopy(ref), mesh, plan)
            _train_lm(model, ref, 10)

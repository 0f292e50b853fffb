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
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    parallelize_module,
)
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from tp_models import MLP, Attention, SequenceParallelBlock, TinyLM


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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(5):
        torch.manual_seed(200 + step)
        ids = torch.randint(0, 12, (2, 5))
        logits = model(ids)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(1, 1).flatten())
        ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        torch.testing.assert_close(loss.full_tensor(), ref_loss, rtol=1e-5, atol=1e-6)
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

"""Shared pieces of the hp-fsdp tests: a tiny transformer, a parity loop, a collective counter.

Test files put this folder on ``sys.path`` and import it; it is plain Python
so each rank process imports it the same way.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hp_core.collectives as hc
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor
from hp_testing import CollectiveLog, record_collectives
from torch import nn

VOCAB = 13  # uneven over 2 and 4 ranks on purpose
DIM = 6
HIDDEN = 2 * DIM + 1
SEQ = 4


class Block(nn.Module):
    """Pre-norm attention (one head) + MLP, with odd sizes so shards are uneven."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(DIM)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj(att @ v)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    """Embedding, ``n_blocks`` blocks, final norm and head."""

    def __init__(self, n_blocks: int = 2, block: Callable[[], nn.Module] = Block) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([block() for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(seed: int = 0, n_blocks: int = 2, dtype: torch.dtype = torch.float64) -> Transformer:
    """The same model on every rank (seeded), in ``dtype``."""
    torch.manual_seed(seed)
    return _spread_norms(Transformer(n_blocks).to(dtype))


def _spread_norms(model: nn.Module) -> Any:
    """Non-trivial norm params, so their gradients matter."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


# Even over tp=2 (hp_dtensor's TP hooks rebuild activations with from_local, which assumes even
# chunks), uneven again over dp=2: each TP-local 5 rows split 3 / 2.
TP_HIDDEN = 10


class TPBlock(nn.Module):
    """Pre-norm MLP with a residual: ``up`` column-wise and ``down`` row-wise under TP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, TP_HIDDEN)
        self.down = nn.Linear(TP_HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TPModel(Transformer):
    """Embedding, two TP-able MLP blocks, final norm and head."""

    def __init__(self) -> None:
        super().__init__(2, block=TPBlock)


def build_tp() -> TPModel:
    """The FSDP x TP test model, float64, seeded (the same on every rank)."""
    torch.manual_seed(0)
    return _spread_norms(TPModel().double())


def global_batch(step: int, dp_world: int, per_rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets of the whole step, identical on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (dp_world * per_rank, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (dp_world * per_rank, SEQ), generator=g)
    return tokens, targets


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (fp32 or better, whatever the model computes in)."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten())


def full(t: Any) -> torch.Tensor:
    """A DTensor (hp's, or torch's for the oracle runs) gathered, or the tensor itself."""
    if isinstance(t, DTensor) or hasattr(t, "full_tensor"):
        return t.full_tensor()
    return t


def shard_blocks(model: Transformer, **kwargs: Any) -> Transformer:
    """Per-block ``fully_shard`` plus the root."""
    from hp_fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@dataclass
class Tol:
    """Tolerances of a parity run."""

    rtol: float = 1e-5
    atol: float = 1e-6
    loss_rtol: float = 1e-7
    loss_atol: float = 1e-9
    param_atol: float | None = None  # after Adam steps (defaults to atol)


def parity(
    model: nn.Module,
    ref: nn.Module,
    *,
    dp_rank: int,
    dp_world: int,
    steps: int = 10,
    tol: Tol | None = None,
    micro: int = 1,
    before_micro: Callable[[nn.Module, int], None] | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
    skip: frozenset[str] = frozenset(),
) -> list[float]:
    """Train ``model`` (sharded) and ``ref`` (one process, whole batch) side by side and compare.

    Losses each step (the all-reduced mean of the local losses against the
    reference loss), every gradient after backward, every parameter after
    the AdamW step. ``micro`` micro-batches accumulate per step, each loss
    scaled by ``1 / micro``; ``before_micro(model, i)`` may toggle sync flags.
    """
    tol = tol or Tol()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        tokens, targets = global_batch(step, dp_world, per_rank=2 * micro)
        ref_total = torch.zeros((), dtype=torch.float64)
        total = torch.zeros((), dtype=torch.float64)
        for i in range(micro):
            t_mb = tokens.view(dp_world * micro, 2, SEQ)
            y_mb = targets.view(dp_world * micro, 2, SEQ)
            ref_tokens = torch.cat([t_mb[r * micro + i] for r in range(dp_world)])
            ref_targets = torch.cat([y_mb[r * micro + i] for r in range(dp_world)])
            ref_loss = loss_fn(ref, ref_tokens, ref_targets) / micro
            ref_loss.backward()
            ref_total += ref_loss.detach()
            if before_micro is not None:
                before_micro(model, i)
            loss = loss_fn(model, t_mb[dp_rank * micro + i], y_mb[dp_rank * micro + i]) / micro
            loss.backward()
            total += loss.detach()
        if after_backward is not None:
            after_backward(model)
        mean = hc.all_reduce(total.clone(), "avg")
        torch.testing.assert_close(
            mean, ref_total, rtol=tol.loss_rtol, atol=tol.loss_atol, msg=f"loss step {step}"
        )
        losses.append(float(mean))
        ref_named = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if name in skip:
                continue
            assert p.grad is not None, f"step {step}: no grad for {name}"
            torch.testing.assert_close(
                full(p.grad).to(ref_named[name].grad.dtype),
                ref_named[name].grad,
                rtol=tol.rtol,
                atol=tol.atol,
                msg=lambda m, name=name, step=step: f"grad {name} step {step}: {m}",
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in model.named_parameters():
            if name in skip:
                continue
            torch.testing.assert_close(
                full(p).to(ref_named[name].dtype),
                ref_named[name],
                rtol=tol.rtol,
                atol=tol.atol if tol.param_atol is None else tol.param_atol,
                msg=lambda m, name=name, step=step: f"param {name} step {step}: {m}",
            )
    return losses


def ref_copy(model: nn.Module) -> nn.Module:
    """The single-process reference: a deep copy taken before sharding."""
    return copy.deepcopy(model)


# FSDP's collectives under the short names the tests compare.
KINDS = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
}


class FSDPCalls:
    """A view of a :func:`hp_testing.record_collectives` log: calls per kind, bytes per all-gather."""

    def __init__(self, log: CollectiveLog) -> None:
        self.log = log

    @property
    def calls(self) -> dict[str, int]:
        return {kind: self.log.count(name) for kind, name in KINDS.items()}

    @property
    def gather_bytes(self) -> list[int]:
        """The output (all ranks' pieces) of each all-gather, in bytes."""
        return [r.nbytes for r in self.log.of("all_gather_into_tensor")]

    def reset(self) -> None:
        """Start counting from zero."""
        self.log.clear()


@contextlib.contextmanager
def count_collectives() -> Iterator[FSDPCalls]:
    """Record the collectives hp_fsdp issues through hp_core inside the block."""
    with record_collectives() as log:
        yield FSDPCalls(log)

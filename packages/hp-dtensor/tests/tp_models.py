"""Small models for the tensor-parallel tests: eager in ``test_tp.py``, compiled in ``test_compile.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, dim: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(dim, dim)
        # No key bias: softmax ignores it, so its gradient is rounding noise that Adam would amplify.
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Under TP, q, k and v are DTensors cut on the feature dim; the view makes that the head
        # dim, so sdpa runs on DTensors with heads sharded (no communication inside attention).
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        self.seen = [getattr(t, "placements", None) for t in (q, out)]
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class SequenceParallelBlock(nn.Module):
    """Norm -> MLP -> residual -> normed residual, the norms sequence-parallel around a TP MLP.

    (A block that ends in a norm would make ``out.pow(2).mean()`` nearly constant:
    gradients of rounding-noise size, which Adam's first step turns into lr-sized steps.)
    """

    def __init__(self, dim: int = 8, hidden: int | None = None) -> None:
        super().__init__()
        hidden = 4 * dim if hidden is None else hidden
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.out_norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        return h + self.out_norm(h)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 12, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.embed(ids)))


class ColwiseEmbeddingLM(nn.Module):
    """A column-wise embedding (features cut) feeding a row-wise head: the features are the TP dim."""

    def __init__(self, vocab: int = 12, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.embed(ids)))

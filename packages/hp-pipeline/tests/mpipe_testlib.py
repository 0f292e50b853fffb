"""Shared pieces of the MPipe tests: a multimodal sample set, the two token losses, the schedule.

Test files put this folder on ``sys.path`` and import it (plain Python, so each
rank process imports it the same way). The models differ per test file on
purpose (a transformer VLM for plain MPipe, a small MLP one under FSDP); the
data and the losses do not.
"""

from __future__ import annotations

from typing import Any

import torch
from hp_pipeline import PipelineStage, ScheduleMPipe
from torch import nn
from torch.utils.data import Dataset


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the valid tokens (labels != -100)."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum")


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the valid tokens of one micro-batch."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))


class Samples(Dataset):
    """``n`` seeded samples: images of ``nimg`` x ``pix``, ``seq`` token ids, labels with ~30% masked.

    The first label of every sample stays valid, so per-micro-batch means are defined.
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int,
        nimg: int,
        pix: int,
        seq: int,
        vocab: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.pixels = torch.randn(n, nimg, pix, generator=gen, dtype=dtype)
        self.ids = torch.randint(0, vocab, (n, seq), generator=gen)
        labels = torch.randint(0, vocab, (n, seq), generator=gen)
        drop = torch.rand(n, seq, generator=gen) < 0.3
        drop[:, 0] = False
        self.labels = labels.masked_fill(drop, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixels[j], "input_ids": self.ids[j], "labels": self.labels[j]}


def schedule_for(
    case: Any, stages: list[PipelineStage], tower: nn.Module, m: int, **extra: Any
) -> ScheduleMPipe:
    """The ``ScheduleMPipe`` a test case describes (its loss, bases, modes), tower sync checked each step.

    ``case`` has ``tokens``, ``owner_backward``, ``mode``, ``loading`` and
    ``base``; ``extra`` adds what only one test file sets (``batched_recv``,
    ``dp_group``).
    """
    return ScheduleMPipe(
        stages if len(stages) > 1 else stages[0],
        m,
        preprocess=tower,
        loss_fn=token_sum if case.tokens else token_mean,
        owner_backward=case.owner_backward,
        overflow_mode=case.mode,
        in_schedule_loading=case.loading,
        normalize_by_tokens=case.tokens,
        check_tower_sync=True,
        base=case.base,
        **extra,
    )

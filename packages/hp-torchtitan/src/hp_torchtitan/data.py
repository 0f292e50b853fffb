"""Offline data for the CPU driver: a tokenizer trained on a local text file, and packed batches.

torchtitan's own text loader goes through HuggingFace ``datasets`` (a large
dependency tree, and its test corpus and tokenizer are not in the wheel). For a
parity check all that matters is that both runs see the same tokens, so the
text is tokenized once with torchtitan's ``HuggingFaceTokenizer`` (over a
``tokenizer.json`` trained here with the ``tokenizers`` library, no download)
and cut into fixed windows the way torchtitan packs documents: inputs are
``seq_len`` tokens, labels the same window shifted by one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def build_tokenizer(text_file: str | Path, out_dir: str | Path, *, vocab_size: int = 1024) -> Path:
    """Train a byte-level BPE tokenizer on ``text_file``; write torchtitan's tokenizer folder.

    Returns ``out_dir``, which then holds ``tokenizer.json`` and
    ``tokenizer_config.json`` (the BOS/EOS names torchtitan reads). Pass it as
    ``tokenizer_path`` to ``torchtitan.components.tokenizer.HuggingFaceTokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise ValueError(f"build_tokenizer: vocab_size={vocab_size} leaves no room for merges; use >= 300.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(text_file)], trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@dataclass(frozen=True)
class Batch:
    """One rank's share of one step: ``inputs``/``labels``/``positions`` of shape (batch, seq_len)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor


def packed_batches(
    tokens: list[int], *, steps: int, local_batch_size: int, seq_len: int, dp_rank: int, dp_degree: int
) -> list[Batch]:
    """Cut ``tokens`` (repeated as needed) into ``steps`` global batches; keep ``dp_rank``'s rows.

    Global batch ``s`` holds ``local_batch_size * dp_degree`` consecutive windows
    of ``seq_len + 1`` tokens; rank ``r`` takes rows ``r * local_batch_size``
    onward, as torchtitan's data-parallel loader splits a global batch.
    Positions restart at 0 in every row (one document per row), which gives
    flex attention a plain causal mask.
    """
    if not tokens:
        raise ValueError("packed_batches: no tokens; the text file tokenized to nothing.")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"packed_batches: dp_rank={dp_rank} is outside 0..{dp_degree - 1}.")
    window = seq_len + 1
    rows_per_step = local_batch_size * dp_degree
    needed = steps * rows_per_step * window
    stream = torch.tensor(tokens * (needed // len(tokens) + 1), dtype=torch.long)[:needed]
    rows = stream.view(steps, rows_per_step, window)
    mine = rows[:, dp_rank * local_batch_size : (dp_rank + 1) * local_batch_size]
    positions = torch.arange(seq_len).expand(local_batch_size, seq_len)
    return [
        Batch(inputs=step[:, :-1].clone(), labels=step[:, 1:].clone(), positions=positions.clone())
        for step in mine
    ]


def text_file_batches(
    text_file: str | Path, *, steps: int, local_batch_size: int, seq_len: int, dp_rank: int, dp_degree: int
) -> list[Batch]:
    """``dp_rank``'s batches of ``text_file``, tokenized by a tokenizer trained on that same file.

    The whole offline path in one call (:func:`build_tokenizer`, torchtitan's
    ``HuggingFaceTokenizer`` with BOS/EOS, :func:`packed_batches`): every rank
    of every parity run builds identical tokens without a download. Ranks that
    differ only in a model-parallel coordinate (TP) pass the same ``dp_rank``.
    """
    import tempfile

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    text = Path(text_file).read_text()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = HuggingFaceTokenizer(tokenizer_path=str(build_tokenizer(text_file, folder)))
        tokens = tokenizer.encode(text, add_bos=True, add_eos=True)
    return packed_batches(
        tokens,
        steps=steps,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
    )

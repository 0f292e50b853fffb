"""Loggers whose every line says which rank wrote it.

With N processes writing to one terminal, an unlabelled line is useless. The
adapter below prefixes ``[rank R/W]``, resolved when the line is logged (not
when the logger is created), so a logger made at import time labels lines
correctly once the process group exists.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

__all__ = ["RankLoggerAdapter", "get_logger", "rank_prefix"]


def rank_prefix() -> str:
    """``"[rank R/W]"`` for this process (process group, else ``RANK``/``WORLD_SIZE``, else ``?``)."""
    if dist.is_available() and dist.is_initialized():
        return f"[rank {dist.get_rank()}/{dist.get_world_size()}]"
    rank = os.environ.get("RANK")
    world = os.environ.get("WORLD_SIZE")
    if rank is None:
        return "[rank ?]"
    return f"[rank {rank}/{world}]" if world else f"[rank {rank}]"


if TYPE_CHECKING:
    _AdapterBase = logging.LoggerAdapter[logging.Logger]
else:  # subscripting LoggerAdapter at run time needs Python 3.11
    _AdapterBase = logging.LoggerAdapter


class RankLoggerAdapter(_AdapterBase):
    """Prefixes every message with :func:`rank_prefix`; ``ranks`` restricts which ranks emit."""

    def __init__(self, logger: logging.Logger, ranks: frozenset[int] | None = None) -> None:
        super().__init__(logger, {})
        self.ranks = ranks

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{rank_prefix()} {msg}", kwargs

    def isEnabledFor(self, level: int) -> bool:
        if self.ranks is not None:
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
            else:
                rank = int(os.environ.get("RANK") or 0)
            if rank not in self.ranks:
                return False
        return super().isEnabledFor(level)


def get_logger(name: str = "hp_core", *, ranks: int | list[int] | None = None) -> RankLoggerAdapter:
    """A logger for ``name`` whose lines start with the rank; ``ranks=0`` logs on rank 0 only."""
    allowed: frozenset[int] | None
    if ranks is None:
        allowed = None
    elif isinstance(ranks, int):
        allowed = frozenset({ranks})
    else:
        allowed = frozenset(ranks)
    return RankLoggerAdapter(logging.getLogger(name), allowed)

"""The debug switch ``HP_DISTRIBUTED_DEBUG=OFF|INFO|DETAIL``, modelled on ``TORCH_DISTRIBUTED_DEBUG``.

See [Note: debug levels]. :func:`get_debug_level` reads the environment
once and :func:`set_debug_level` overrides it, as torch's functions of the
same names do.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "DebugLevel",
    "collect_log_lines",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
]

ENV = "HP_DISTRIBUTED_DEBUG"

# [Note: debug levels]
# Every hp library logs its decisions at ``logging.DEBUG`` through loggers made
# by ``hp_core.get_logger``; a user who enables those loggers (``logging`` as
# usual) sees them at any level. The switch chooses what is *produced*:
#
# * ``OFF`` (the default, as torch's): decision lines only where a logger is
#   enabled by the user; nothing configured.
# * ``INFO``: the hp loggers are set to DEBUG with a stderr handler of their
#   own, so ``HP_DISTRIBUTED_DEBUG=INFO torchrun ...`` shows each decision
#   (a redistribution plan, a fallback, an op's rule, a schedule's order and
#   comms, a cross-rank agreement) without touching the script.
# * ``DETAIL``: INFO plus the lines that are too many or too long for INFO:
#   every pipeline step's action as it runs, the values each rank agreed on.
#
# No check is switched off at OFF. The cross-rank agreements
# ([Note: cross-rank agreement] in hp_core.agreement) are the only checks
# that need communication, and they exchange a 64-byte digest once per mesh,
# root, schedule or communicating call; that is cheap enough to always run,
# and a mismatch they miss is a hang or silently wrong data. Level checks
# cost one comparison, so a hot path pays nothing when a line is not made.


class DebugLevel(enum.IntEnum):
    """How much the hp libraries report; ordered, so ``level >= DebugLevel.INFO`` reads naturally."""

    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self) -> str:
        return self.name


_level: DebugLevel | None = None
# The loggers the hp libraries log through (``hp_core.get_logger(<package>)``); their
# children (``hp_dtensor.ops``) follow them through logging's hierarchy.
LOGGER_NAMES = ("hp_core", "hp_dtensor", "hp_fsdp", "hp_pipeline", "hp_testing")
_configured: set[str] = set()  # logger names set up by us (so OFF undoes only what we did)
_HANDLER = logging.StreamHandler(sys.stderr)
_HANDLER.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


def _parse(value: object, source: str) -> DebugLevel:
    if isinstance(value, DebugLevel):
        return value
    if isinstance(value, str) and value.strip().upper() in DebugLevel.__members__:
        return DebugLevel[value.strip().upper()]
    raise ValueError(
        f"{source} is {value!r}; pass one of OFF, INFO or DETAIL (case-insensitive), e.g. "
        f"{ENV}=INFO, or unset it for OFF."
    )


def get_debug_level() -> DebugLevel:
    """The current level: set by :func:`set_debug_level`, else ``HP_DISTRIBUTED_DEBUG`` (read once)."""
    if _level is None:
        return set_debug_level_from_env()
    return _level


def set_debug_level(level: DebugLevel | str) -> DebugLevel:
    """Set the level (a :class:`DebugLevel` or its name); returns the previous one.

    The hp loggers follow at once ([Note: debug levels]).
    """
    global _level
    previous = _level if _level is not None else DebugLevel.OFF
    _level = _parse(level, "set_debug_level(level)")
    for name in LOGGER_NAMES:
        _configure(logging.getLogger(name), _level)
    return previous


def set_debug_level_from_env() -> DebugLevel:
    """Read ``HP_DISTRIBUTED_DEBUG`` again (unset or empty is OFF); returns the new level."""
    raw = os.environ.get(ENV, "")
    level = _parse(raw or "OFF", f"the environment variable {ENV}")
    set_debug_level(level)
    return level


def _configure(logger: logging.Logger, level: DebugLevel) -> None:
    """DEBUG and our stderr handler at INFO and above; undone at OFF.

    A logger the user gave a level of their own keeps it: the switch only
    fills in what nobody chose.
    """
    if level >= DebugLevel.INFO:
        if logger.name not in _configured and logger.level != logging.NOTSET:
            return
        logger.setLevel(logging.DEBUG)
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)
        _configured.add(logger.name)
    elif logger.name in _configured:
        logger.setLevel(logging.NOTSET)
        logger.removeHandler(_HANDLER)
        _configured.discard(logger.name)


class _Lines(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def collect_log_lines(name: str, level: int = logging.DEBUG) -> Iterator[list[str]]:
    """The messages logger ``name`` (and its children) emits inside the block, at ``level`` and up.

    pytest's ``caplog`` lives in the pytest process and cannot reach the ranks
    of a multi-process test; this works on every rank, under any launcher.
    The logger's own level is set to ``level`` for the block and restored.
    """
    logger, handler = logging.getLogger(name), _Lines(level)
    before = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)

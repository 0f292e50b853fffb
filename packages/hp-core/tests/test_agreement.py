"""verify_across_ranks: one digest exchange when the ranks agree, every rank's value when they do not.

The tests count calls into torch.distributed or read process-wide loggers, so their ranks
run as processes (``mode="process"``), not as threads of one process.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import hp_core
import pytest
import torch.distributed as dist
from hp_core import DebugLevel, verify_across_ranks

_COUNTED = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "all_reduce")


@contextlib.contextmanager
def torch_collectives() -> Iterator[Counter[str]]:
    """Count the torch.distributed collectives called inside the block (an object one counts once)."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in _COUNTED:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@pytest.mark.distributed(world_size=2, mode="process")
def test_agreeing_ranks_cost_one_tensor_all_gather(rank: int) -> None:
    with torch_collectives() as counts:
        assert verify_across_ranks({"a": 1, "b": (2, 3)}, what="t", fix="f") is None
    assert counts == Counter({"all_gather": 1})  # no object collective


@pytest.mark.distributed(world_size=2, mode="process")
def test_extra_ints_ride_along_and_come_back_per_rank(rank: int) -> None:
    with torch_collectives() as counts:
        got = verify_across_ranks("same", what="t", fix="f", extra=[rank, 10 + rank, -5])
    assert got == [(0, 10, -5), (1, 11, -5)]
    assert counts == Counter({"all_gather": 1})
    # more than the inline slots: a second exchange, still no object collective
    with torch_collectives() as counts:
        got = verify_across_ranks("same", what="t", fix="f", extra=list(range(rank, rank + 9)))
    assert got == [tuple(range(9)), tuple(range(1, 10))]
    assert counts == Counter({"all_gather": 2})


@pytest.mark.distributed(world_size=2, mode="process")
def test_a_mismatch_raises_on_every_rank_naming_each_value(rank: int) -> None:
    with torch_collectives() as counts, pytest.raises(ValueError) as info:
        verify_across_ranks(
            {"shape": (4 + rank,), "dtype": "float32"}, what="make_thing", fix="pass the same shape."
        )
    assert str(info.value) == (
        "make_thing: the ranks passed different shape (rank 0: shape=(4,); rank 1: shape=(5,)); "
        "pass the same shape."
    )
    assert counts["all_gather"] == 1 and counts["all_gather_object"] == 1
    # a different count of extra ints is caught by the digest, before their exchange
    with pytest.raises(ValueError, match=r"rank 0: 'x'; rank 1: 'y'"):
        verify_across_ranks("x" if rank == 0 else "y", what="w", fix="f", extra=[0] * (3 + 5 * rank))


@pytest.mark.distributed(world_size=2, mode="process")
def test_custom_explanation_gets_values_and_global_ranks(rank: int) -> None:
    def explain(values: list[Any], ranks: list[int]) -> str:
        return "|".join(f"{r}={v}" for r, v in zip(ranks, values, strict=True))

    with pytest.raises(ValueError, match=r"^w: 0=a\|1=b; fix$"):
        verify_across_ranks("ab"[rank], what="w", fix="fix", explain=explain)


@pytest.mark.distributed(world_size=2, mode="process")
def test_addresses_in_reprs_do_not_make_equal_calls_disagree(rank: int) -> None:
    verify_across_ranks({"fn": repr(object())}, what="w", fix="f")


@pytest.mark.distributed(world_size=4, mode="process")
def test_over_a_two_dim_mesh_one_exchange_per_dim_in_row_major_order(rank: int) -> None:
    mesh = hp_core.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    with torch_collectives() as counts:
        got = verify_across_ranks("same", mesh, what="w", fix="f", extra=[rank])
    assert got == [(0,), (1,), (2,), (3,)]
    assert counts == Counter({"all_gather": 2})
    with pytest.raises(ValueError, match=r"rank 0: 0; rank 1: 0; rank 2: 0; rank 3: 1"):
        verify_across_ranks(int(rank == 3), mesh, what="w", fix="f")
    # a slice: only its ranks take part
    row = mesh["b"]
    with pytest.raises(ValueError, match=rf"rank {rank - rank % 2}: 0; rank {rank - rank % 2 + 1}: 1"):
        verify_across_ranks(rank % 2, row, what="w", fix="f")


@pytest.mark.distributed(world_size=1, mode="process")
def test_one_rank_communicates_nothing(rank: int) -> None:
    with torch_collectives() as counts:
        assert verify_across_ranks("x", what="w", fix="f", extra=[3]) == [(3,)]
    assert not counts


@pytest.mark.distributed(world_size=2, mode="process")
def test_detail_logs_the_agreement_and_the_values(rank: int) -> None:
    previous = hp_core.set_debug_level("DETAIL")
    try:
        with hp_core.collect_log_lines("hp_core") as lines:
            verify_across_ranks({"k": 1}, what="thing", fix="f")
        hp_core.set_debug_level("OFF")
        with hp_core.collect_log_lines("hp_core") as off:
            verify_across_ranks({"k": 1}, what="quiet", fix="f")
        with hp_core.collect_log_lines("hp_core", logging.INFO) as above:
            verify_across_ranks({"k": 1}, what="above debug", fix="f")
    finally:
        hp_core.set_debug_level(previous)
    assert lines == [
        f"[rank {rank}/2] agreed across 2 ranks: thing",
        f"[rank {rank}/2] agreed across 2 ranks: thing: {{'k': 1}}",
    ]
    assert off == [f"[rank {rank}/2] agreed across 2 ranks: quiet"]  # the values are DETAIL's
    assert above == []


def test_debug_level_reads_the_environment_and_configures_the_loggers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logger = logging.getLogger("hp_pipeline")
    before = hp_core.get_debug_level()
    try:
        monkeypatch.setenv("HP_DISTRIBUTED_DEBUG", "info")
        assert hp_core.set_debug_level_from_env() is DebugLevel.INFO
        assert hp_core.get_debug_level() is DebugLevel.INFO
        assert logger.level == logging.DEBUG and logger.handlers
        assert hp_core.set_debug_level("OFF") is DebugLevel.INFO
        assert logger.level == logging.NOTSET and not logger.handlers
        monkeypatch.setenv("HP_DISTRIBUTED_DEBUG", "LOUD")
        with pytest.raises(
            ValueError, match=r"HP_DISTRIBUTED_DEBUG is 'LOUD'; pass one of OFF, INFO or DETAIL"
        ):
            hp_core.set_debug_level_from_env()
        with pytest.raises(ValueError, match=r"set_debug_level\(level\) is 3; pass one of OFF"):
            hp_core.set_debug_level(3)  # type: ignore[arg-type]
        # a level the user chose is theirs
        logger.setLevel(logging.WARNING)
        hp_core.set_debug_level(DebugLevel.DETAIL)
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(logging.NOTSET)
        hp_core.set_debug_level(before)
    assert DebugLevel.OFF < DebugLevel.INFO < DebugLevel.DETAIL


@pytest.mark.distributed(world_size=2, backend="nccl-emu", mode="process")
def test_under_nccl_rules(rank: int) -> None:
    """The digest exchange uses what NCCL takes (int64, the list all_gather), so it runs on a cluster."""
    assert verify_across_ranks("x", what="w", fix="f", extra=[rank]) == [(0,), (1,)]
    with pytest.raises(ValueError, match=r"rank 0: 0; rank 1: 1"):
        verify_across_ranks(rank, what="w", fix="f")


@pytest.mark.distributed(world_size=2, backend="hccl-emu", mode="process")
def test_under_hccl_rules(rank: int) -> None:
    assert verify_across_ranks("x", what="w", fix="f", extra=[rank]) == [(0,), (1,)]

"""Profiler labels and debug logs name the unit: ``FSDP::all_gather (layers.3)``, as FSDP2's do.

A trace of a many-layer model is readable only if each unit's collectives
carry its FQN ([Note: profiler labels] in ``hp_fsdp._profiling``); the
labels are formatted only while a profiler records, and the debug log of
every hook is formatted only when debug logging is on.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

BLOCKS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def _sharded(mesh: Any) -> tuple[nn.Module, nn.Module]:
    """A 4-block model under fully_shard (each block, then the root) and its unsharded reference."""
    from hp_fsdp import fully_shard

    torch.manual_seed(0)
    model = Model().double()
    reference = copy.deepcopy(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, reference


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().sum()
    loss.backward()
    return loss.detach()


def _check_grads(model: nn.Module, reference: nn.Module, x: torch.Tensor, steps: int) -> None:
    """The labelled / logged steps compute what one process computes (every gradient)."""
    for _ in range(steps):
        _step(reference, x)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.distributed(world_size=2)
def test_trace_names_each_blocks_collectives(rank: int, device_mesh_factory: Any, tmp_path: Path) -> None:
    model, reference = _sharded(device_mesh_factory((2,), ("dp",)))
    x = torch.randn(3, 4, dtype=torch.float64)
    _step(model, x)  # warm-up: lazy init outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, x)
    trace = tmp_path / f"trace{rank}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    counts = Counter(e["name"] for e in events if str(e.get("name", "")).startswith("FSDP::"))
    for i in range(BLOCKS):
        unit = f"layers.{i}"
        # each block gathers in forward and again in backward (resharded after forward), reduces once
        assert counts[f"FSDP::all_gather ({unit})"] == 2, counts
        assert counts[f"FSDP::all_gather_copy_out ({unit})"] == 2, counts
        assert counts[f"FSDP::post_backward_reduce ({unit})"] == 1, counts
        assert counts[f"FSDP::post_backward_rs_wait ({unit})"] == 1, counts
        for hook in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            assert counts[f"FSDP::{hook} ({unit})"] >= 1, (hook, unit, counts)
    # the root's FQN is "" (as FSDP2's): its labels carry no suffix; it keeps its params after forward
    assert counts["FSDP::all_gather"] == 1, counts
    assert counts["FSDP::post_backward_reduce"] == 1, counts
    assert counts["FSDP::root_pre_forward"] == 1, counts
    assert not [name for name in counts if name.endswith("()")], counts
    _check_grads(model, reference, x, steps=2)


@pytest.mark.distributed(world_size=2)
def test_labels_are_formatted_only_while_profiling(
    rank: int, device_mesh_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hp_fsdp._profiling as profiling

    built: list[str] = []
    original = profiling.with_fqn

    def counting(name: str, fqn: str) -> str:
        built.append(name)
        return original(name, fqn)

    monkeypatch.setattr(profiling, "with_fqn", counting)
    model, _ = _sharded(device_mesh_factory((2,), ("dp",)))
    x = torch.randn(3, 4, dtype=torch.float64)
    _step(model, x)
    _step(model, x)
    assert built == []  # no profiler: no label text built, no record_function entered
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _step(model, x)
    assert "FSDP::all_gather" in built


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.distributed(world_size=2)
def test_debug_log_names_each_units_hooks(rank: int, device_mesh_factory: Any) -> None:
    model, reference = _sharded(device_mesh_factory((2,), ("dp",)))
    x = torch.randn(3, 4, dtype=torch.float64)
    logger = logging.getLogger("hp_fsdp")
    records = _Records()
    logger.addHandler(records)
    level = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        _step(model, x)
    finally:
        logger.setLevel(level)
        logger.removeHandler(records)
    lines = records.messages
    assert all(line.startswith(f"[rank {rank}/2] FSDP::") for line in lines), lines[:5]
    text = "\n".join(lines)
    for unit in [f"layers.{i}" for i in range(BLOCKS)] + ["<root>"]:
        for event in (
            "pre_forward",
            "post_forward",
            "pre_backward",
            "post_backward",
            "all_gather",
            "reduce_scatter",
        ):
            assert f"FSDP::{event} ({unit})" in text, (event, unit, text)
        assert f"FSDP::all_gather ({unit}): issued" in text, (unit, text)
        assert f"FSDP::all_gather ({unit}): waited" in text, (unit, text)
        assert f"FSDP::reduce_scatter ({unit}): issued" in text, (unit, text)
    for i in range(BLOCKS):  # blocks reshard after forward and after backward; the root after backward
        assert text.count(f"FSDP::reshard (layers.{i})") == 2, text
    assert text.count("FSDP::reshard (<root>)") == 1, text
    # in hook order: block 0's forward hooks run before block 1's, its backward ones after
    at = {line.split("] ", 1)[1]: index for index, line in reversed(list(enumerate(lines)))}
    assert at["FSDP::pre_forward (layers.0)"] < at["FSDP::pre_forward (layers.1)"]
    assert at["FSDP::post_backward (layers.1)"] < at["FSDP::post_backward (layers.0)"]
    _check_grads(model, reference, x, steps=1)


@pytest.mark.distributed(world_size=2)
def test_debug_log_formats_nothing_when_off(
    rank: int, device_mesh_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hp_core.logging

    prefixed: list[int] = []
    original = hp_core.logging.rank_prefix

    def counting() -> str:
        prefixed.append(1)
        return original()

    monkeypatch.setattr(hp_core.logging, "rank_prefix", counting)
    model, _ = _sharded(device_mesh_factory((2,), ("dp",)))
    logging.getLogger("hp_fsdp").setLevel(logging.INFO)
    _step(model, torch.randn(3, 4, dtype=torch.float64))
    assert prefixed == []  # every hook called logger.debug, none built a line
    logging.getLogger("hp_fsdp").setLevel(logging.NOTSET)

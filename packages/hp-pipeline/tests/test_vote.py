"""The failure vote on NCCL/HCCL-like backends: off the compute stream, and still right.

[Note: vote off the compute stream] in :mod:`hp_pipeline.vote` says the
all-reduce vote runs on a side stream so that reading its result syncs only
that stream. A CPU cannot show a stream wait, so the first tests fake an
accelerator handle that records which stream is current whenever the vote
touches a tensor, issues or waits the collective, or records and waits an
event. The distributed tests check the verdict itself under NCCL and HCCL
emulation, where streams are no-ops and the collective is real.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_pipeline import vote as vote_module
from hp_pipeline.errors import StageFailure
from hp_pipeline.vote import FailureVote
from hp_testing import record_collectives
from torch.overrides import TorchFunctionMode


class FakeStream:
    """A stream that only remembers what was asked of it."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self._log = log

    def wait_stream(self, stream: Any) -> None:
        self._log.append(("wait_stream", self.name))

    def wait_event(self, event: Any) -> None:
        self._log.append(("wait_event", self.name))

    def record_event(self, event: Any = None) -> Any:
        self._log.append(("record_event", self.name))
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._log.append(("stream.synchronize", self.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, handle: FakeHandle) -> None:
        self._handle = handle
        self.recorded_on: str | None = None

    def record(self, stream: Any = None) -> None:
        self.recorded_on = (stream or self._handle.current_stream()).name
        self._handle.log.append(("event.record", self.recorded_on))

    def wait(self, stream: Any = None) -> None:
        self._handle.log.append(("event.wait", (stream or self._handle.current_stream()).name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        assert self.recorded_on is not None, "synchronize() on an event never recorded"
        self._handle.log.append(("event.synchronize", self.recorded_on))

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class FakeHandle:
    """An accelerator handle with a stack of current streams; tensors stay on the CPU."""

    is_accelerator = True
    device_type = "cuda"
    tensor_device_type = "cpu"

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.compute = FakeStream("compute", self.log)
        self._current = [self.compute]
        self.made: list[FakeStream] = []

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: Any = None) -> torch.device:
        raise AssertionError("the vote's device is current: no device switch expected")

    def current_stream(self) -> FakeStream:
        return self._current[-1]

    def default_stream(self) -> FakeStream:
        return self.compute

    def new_stream(self, priority: int = 0, *, device: Any = None) -> FakeStream:
        assert torch.device(device) == self.current_device(), device  # made on the flag's device
        stream = FakeStream(f"side{len(self.made)}", self.log)
        self.made.append(stream)
        return stream

    @contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[FakeStream | None]:
        if stream is None:
            yield stream
            return
        self._current.append(stream)
        try:
            yield stream
        finally:
            self._current.pop()

    def new_event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self)

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("device.synchronize", "all"))


class StreamOfEveryOp(TorchFunctionMode):
    """Log each torch call (tensor ops, creation, ``item``) with the stream current at the call."""

    def __init__(self, handle: FakeHandle) -> None:
        super().__init__()
        self._handle = handle

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", repr(func))
        if func is not torch.device and name not in ("__get__", "__set__"):  # naming, not work
            self._handle.log.append((f"op:{name}", self._handle.current_stream().name))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A 3-rank "nccl" pipeline group seen from rank 0, with a fake accelerator and all-reduce.

    ``others`` is what the other ranks add to the flag; ``gathered`` what
    ``all_gather_object`` returns.
    """
    handle = FakeHandle()
    state = types.SimpleNamespace(handle=handle, others=0, gathered=[], reduces=0)
    group = object()

    class Work:
        def wait(self, timeout: Any = None) -> torch.Tensor:
            handle.log.append(("collective.wait", handle.current_stream().name))
            return torch.empty(0)

    def all_reduce(tensor: torch.Tensor, op: Any = "sum", grp: Any = None, async_op: bool = False) -> Any:
        assert op == "sum" and grp is group
        handle.log.append(("collective.issue", handle.current_stream().name))
        state.reduces += 1
        tensor.add_(state.others)
        return Work() if async_op else tensor

    def all_gather_object(obj: Any, grp: Any = None) -> list[Any]:
        assert grp is group
        return [obj, *state.gathered]

    monkeypatch.setattr(vote_module, "get_platform", lambda: types.SimpleNamespace(handle=handle))
    monkeypatch.setattr(vote_module, "capabilities_for", lambda pg: types.SimpleNamespace(backend="nccl"))
    monkeypatch.setattr(vote_module.dist, "get_process_group_ranks", lambda pg: [0, 1, 2])
    monkeypatch.setattr(vote_module.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(hp_core, "all_reduce", all_reduce)
    monkeypatch.setattr(hp_core, "all_gather_object", all_gather_object)
    state.vote = FailureVote(group, lambda: torch.device("cpu"))  # type: ignore[arg-type]
    return state


def _failure(rank: int) -> StageFailure:
    return StageFailure(rank=rank, stage=rank, step=f"{rank}F0", error="ValueError: boom", traceback="")


def test_vote_runs_and_reads_on_its_side_stream_never_on_compute(fake_nccl: types.SimpleNamespace) -> None:
    handle, vote = fake_nccl.handle, fake_nccl.vote
    assert not vote.p2p  # the all-reduce vote, as on NCCL and HCCL
    for _ in range(3):
        handle.log.clear()
        with StreamOfEveryOp(handle):
            assert vote.close(None) == []
        assert handle.current_stream() is handle.compute  # the context was left
        (side,) = handle.made  # one side stream per vote, made at the first close
        log = handle.log
        # Everything the vote does on the device happens while the side stream is current.
        assert [e for e in log if e[1] != side.name] == [], log
        kinds = [kind for kind, _ in log if not kind.startswith("op:")]
        assert kinds == ["collective.issue", "collective.wait", "event.record", "event.synchronize"], log
        ops = [kind for kind, _ in log if kind.startswith("op:")]
        assert "op:fill_" in ops and "op:copy_" in ops, ops  # no host-to-device copy of a new flag
        # The read comes after the collective was waited, through the event.
        assert log.index(("collective.wait", side.name)) < log.index(("op:copy_", side.name))
        assert log.index(("event.synchronize", side.name)) < log.index(("op:item", side.name))
        # Nothing was synchronised device-wide or on the compute stream, nor made to wait.
        assert not any(kind in ("device.synchronize", "stream.synchronize") for kind in kinds)
    assert fake_nccl.reduces == 3


def test_vote_verdicts_on_the_side_stream(fake_nccl: types.SimpleNamespace) -> None:
    vote = fake_nccl.vote
    assert vote.close(None) == []
    # Another rank failed: this rank learns it and gathers the records.
    fake_nccl.others, fake_nccl.gathered = 1, [None, _failure(2)]
    assert vote.close(None) == [_failure(2)]
    # This rank failed alone: the flag it sets is its own, and the buffer is reset each step.
    fake_nccl.others, fake_nccl.gathered = 0, [None, None]
    own = _failure(0)
    assert vote.close(own) == [own.portable()]
    assert vote.close(None) == []
    assert len(fake_nccl.handle.made) == 1


# -- the verdict under NCCL and HCCL emulation ---------------------------------------------


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("nccl-emu", marks=pytest.mark.distributed(world_size=3, backend="nccl-emu", timeout=60)),
        pytest.param("hccl-emu", marks=pytest.mark.distributed(world_size=3, backend="hccl-emu", timeout=60)),
    ],
)
def test_a_failing_rank_is_reported_on_every_rank(rank: int, world_size: int, backend: str) -> None:
    vote = FailureVote(None, torch.device("cpu"))
    assert not vote.p2p, "NCCL/HCCL emulation must take the all-reduce vote"
    failing = [None, 2, None, 0, None]  # the failing rank of each step
    for step, bad in enumerate(failing):
        own = _failure(rank) if rank == bad else None
        vote.open()
        with record_collectives() as log:
            got = vote.close(own)
        # One 4-byte all-reduce per step on the whole group, whatever the verdict.
        assert [(r.name, r.nbytes) for r in log] == [("all_reduce", 4)], (step, list(log))
        want = [] if bad is None else [_failure(bad)]
        assert got == want, (step, got)
    dist.barrier()

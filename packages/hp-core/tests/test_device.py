"""The device handle on CPU: no-op streams and events with the CUDA interface, zeros for memory."""

from __future__ import annotations

import time

import pytest
import torch
from hp_core.device import CpuEvent, CpuStream, DeviceHandle, EventLike, StreamLike, local_rank_from_env

CPU = DeviceHandle("cpu", "cpu")


def test_cpu_handle_devices(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert not CPU.is_accelerator
    assert CPU.device_count() == 1
    assert CPU.current_device() == torch.device("cpu")
    assert CPU.local_device() == torch.device("cpu")  # LOCAL_RANK does not index CPUs
    assert CPU.set_device() == torch.device("cpu")
    CPU.synchronize()


def test_emulated_handle_acts_on_the_tensor_device():
    handle = DeviceHandle("cuda", "cpu")
    assert not handle.is_accelerator
    assert handle.current_device() == torch.device("cpu")
    assert isinstance(handle.new_stream(), CpuStream)
    assert isinstance(handle.new_stream(device=torch.device("cuda", 1)), CpuStream)  # no device to switch


def test_streams_and_events_satisfy_the_protocols():
    stream, event = CPU.new_stream(priority=-1), CPU.new_event()
    assert isinstance(stream, StreamLike) and isinstance(event, EventLike)
    assert isinstance(stream, CpuStream) and stream.priority == -1
    assert stream.device == torch.device("cpu")


def test_stream_methods_are_no_ops_that_report_completion():
    a, b = CPU.new_stream(), CPU.new_stream()
    a.wait_stream(b)
    event = b.record_event()
    assert isinstance(event, CpuEvent) and event.query()
    a.wait_event(event)
    assert a.query()
    a.synchronize()
    given = CpuEvent()
    assert a.record_event(given) is given


def test_stream_context_managers_run_the_body():
    stream = CPU.new_stream()
    ran = []
    with CPU.stream(stream) as active:
        ran.append(active)
    with stream as same:
        ran.append(same)
    with CPU.stream(None) as nothing:
        ran.append(nothing)
    assert ran == [stream, stream, None]


def test_default_and_current_stream_are_the_same_object():
    assert CPU.current_stream() is CPU.default_stream()
    assert CPU.new_stream() is not CPU.default_stream()


def test_event_elapsed_time_measures_wall_time_between_records():
    start, end = CPU.new_event(enable_timing=True), CPU.new_event(enable_timing=True)
    start.record()
    time.sleep(0.01)
    end.record()
    elapsed = start.elapsed_time(end)
    assert elapsed > 0.0  # milliseconds; the exact value depends on the machine
    end.wait()
    end.synchronize()


def test_elapsed_time_needs_timing_enabled():
    start, end = CpuEvent(enable_timing=True), CpuEvent()
    start.record()
    end.record()
    with pytest.raises(ValueError, match=r"enable_timing=True \(start: True, end: False\)"):
        start.elapsed_time(end)


def test_elapsed_time_needs_both_recorded():
    start, end = CpuEvent(enable_timing=True), CpuEvent(enable_timing=True)
    start.record()
    with pytest.raises(ValueError, match=r"start recorded: True, end recorded: False"):
        start.elapsed_time(end)


def test_elapsed_time_rejects_foreign_events():
    with pytest.raises(TypeError, match="expects another CpuEvent, got str"):
        CpuEvent(enable_timing=True).elapsed_time("end")


def test_cpu_memory_statistics_are_zero():
    torch.ones(1024)  # allocating on the CPU does not move these counters
    assert CPU.memory_allocated() == 0
    assert CPU.max_memory_allocated() == 0
    assert CPU.memory_reserved() == 0
    CPU.reset_peak_memory_stats()
    CPU.empty_cache()


@pytest.mark.parametrize(("raw", "expected"), [(None, 0), ("", 0), ("5", 5)])
def test_local_rank_from_env(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", raw)
    assert local_rank_from_env() == expected


@pytest.mark.parametrize(("raw", "message"), [("x", "LOCAL_RANK='x' is not an integer"), ("-1", "negative")])
def test_local_rank_from_env_errors(monkeypatch, raw, message):
    monkeypatch.setenv("LOCAL_RANK", raw)
    with pytest.raises(ValueError, match=message):
        local_rank_from_env()


class _FakeModule:
    """Stands in for torch.cuda so the accelerator branch can run on a CPU machine."""

    def __init__(self) -> None:
        self.current = None

    def device_count(self) -> int:
        return 2

    def set_device(self, device: torch.device) -> None:
        self.current = device

    def memory_allocated(self, device=None) -> int:
        return 123


def test_accelerator_handle_maps_local_rank_to_device(monkeypatch):
    fake = _FakeModule()
    handle = DeviceHandle("cuda", "cuda")
    monkeypatch.setattr(DeviceHandle, "_module", lambda self: fake)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert handle.set_device() == torch.device("cuda", 1)
    assert fake.current == torch.device("cuda", 1)
    assert handle.memory_allocated() == 123
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"local rank 2 has no cuda device: this process sees 2 device\(s\)"):
        handle.set_device()
    with pytest.raises(ValueError, match=r"set_device got cpu, but this handle drives 'cuda'"):
        handle.set_device("cpu")

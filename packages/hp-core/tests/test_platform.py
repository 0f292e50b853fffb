"""Platform resolution: defaults, environment overrides, injection, and the errors in between."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hp_core import platform as platform_mod
from hp_core.platform import Platform, PlatformError, backend_for, get_platform, set_platform, use_platform


@pytest.fixture(autouse=True)
def _clean_platform(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HP_DEVICE_TYPE", raising=False)
    monkeypatch.delenv("HP_BACKEND", raising=False)
    previous = set_platform(None)
    yield
    set_platform(previous)


def _no_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_mod, "is_device_available", lambda device_type: device_type == "cpu")


def test_default_backends_per_device_type():
    assert [backend_for(d) for d in ("cuda", "npu", "xpu", "cpu")] == ["nccl", "hccl", "xccl", "gloo"]


def test_backend_for_unknown_device_names_it_and_the_known_ones():
    with pytest.raises(PlatformError, match=r"unknown device type 'tpu'.*\['cpu', 'cuda', 'npu', 'xpu'\]"):
        backend_for("tpu")


def test_cpu_only_machine_resolves_to_cpu_and_gloo(monkeypatch):
    _no_accelerators(monkeypatch)
    plat = get_platform()
    assert (plat.device_type, plat.backend, plat.tensor_device_type) == ("cpu", "gloo", "cpu")
    assert not plat.emulated
    assert plat.handle.device_type == "cpu"
    assert plat.device() == torch.device("cpu")


def test_auto_detection_prefers_cuda_then_npu_then_xpu(monkeypatch):
    available = {"cpu", "npu", "xpu"}
    monkeypatch.setattr(platform_mod, "is_device_available", lambda d: d in available)
    assert platform_mod.detect_device_type() == "npu"
    available.discard("npu")
    assert platform_mod.detect_device_type() == "xpu"
    available.add("cuda")
    assert platform_mod.detect_device_type() == "cuda"


def test_env_device_type_overrides_detection(monkeypatch):
    monkeypatch.setattr(platform_mod, "detect_device_type", lambda: "cuda")
    monkeypatch.setenv("HP_DEVICE_TYPE", "cpu")
    assert get_platform().device_type == "cpu"


def test_env_backend_overrides_the_default(monkeypatch):
    monkeypatch.setenv("HP_DEVICE_TYPE", "cpu")
    monkeypatch.setenv("HP_BACKEND", "mpi")
    assert get_platform().backend == "mpi"


def test_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("HP_DEVICE_TYPE", "cuda")
    assert get_platform("cpu").device_type == "cpu"
    assert get_platform("cpu", backend="fake").backend == "fake"


def test_unavailable_device_is_a_clear_error(monkeypatch):
    _no_accelerators(monkeypatch)
    with pytest.raises(PlatformError, match=r"'cuda' \(from argument\) is not available.*HP_DEVICE_TYPE=cpu"):
        get_platform("cuda")
    monkeypatch.setenv("HP_DEVICE_TYPE", "npu")
    with pytest.raises(PlatformError, match=r"'npu' \(from \$HP_DEVICE_TYPE\).*torch_npu is not importable"):
        get_platform()


def test_device_index_is_rejected_with_the_bare_type():
    with pytest.raises(PlatformError, match=r"'cuda:1'.*pass the bare type \('cuda'\)"):
        get_platform("cuda:1")


def test_unknown_device_type_from_env(monkeypatch):
    monkeypatch.setenv("HP_DEVICE_TYPE", "tpu")
    with pytest.raises(PlatformError, match="unknown device type 'tpu'"):
        get_platform()


def test_non_string_device_type():
    with pytest.raises(TypeError, match="device_type must be a str"):
        get_platform(0)  # type: ignore[arg-type]


def test_injected_emulated_platform_keeps_two_device_types(monkeypatch):
    _no_accelerators(monkeypatch)
    emulated = Platform("cuda", "gloo", "cpu")
    with use_platform(emulated):
        plat = get_platform()
        assert plat is emulated
        assert get_platform("cuda") is emulated  # same device type: the injected one
        assert plat.emulated
        assert plat.handle.device_type == "cuda"
        assert not plat.handle.is_accelerator  # streams and memory act on the CPU
        assert plat.device() == torch.device("cpu")
        assert get_platform("cpu").device_type == "cpu"  # another type resolves normally
        assert get_platform(backend="fake").backend == "fake"
    assert get_platform().device_type == "cpu"  # restored


def test_set_platform_returns_previous_and_none_restores(monkeypatch):
    _no_accelerators(monkeypatch)
    first = Platform("npu", "hccl", "cpu")
    assert set_platform(first) is None
    assert get_platform() is first
    assert set_platform(None) is first
    assert get_platform().device_type == "cpu"


def test_set_platform_rejects_other_types():
    with pytest.raises(TypeError, match="expects a Platform or None, got str"):
        set_platform("cuda")  # type: ignore[arg-type]


def test_platform_fields_are_validated():
    with pytest.raises(PlatformError, match="bare device type"):
        Platform("cuda:0", "nccl")
    with pytest.raises(PlatformError, match="backend is empty"):
        Platform("cpu", "")
    with pytest.raises(TypeError, match=r"Platform.backend must be a str, got int"):
        Platform("cpu", 3)  # type: ignore[arg-type]


def test_platform_is_frozen_and_compares_by_value():
    a, b = Platform("cpu", "gloo"), Platform("cpu", "gloo")
    assert a == b and hash(a) == hash(b)
    assert a.tensor_device_type == "cpu"
    assert a != Platform("cpu", "mpi")
    with pytest.raises(AttributeError):
        a.backend = "nccl"  # type: ignore[misc]


def test_import_resolves_nothing():
    # Importing must not probe devices: a probe that raises proves nobody called it.
    code = (
        "import torch\n"
        "def boom(*a, **k): raise SystemExit('probed at import')\n"
        "torch.cuda.is_available = boom\n"
        "import hp_core, sys\n"
        "assert 'torch_npu' not in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_torch_npu_is_looked_up_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto-detection runs on every get_platform(); the torch_npu lookup (a sys.path walk) runs once."""
    import importlib.util

    real = importlib.util.find_spec
    asked: list[str] = []

    def counting(name: str, *args: object, **kwargs: object) -> object:
        if name == "torch_npu":
            asked.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec", counting)
    platform_mod._torch_npu_imports.cache_clear()
    try:
        expected = "npu" if platform_mod._npu_available() else "cpu"
        for _ in range(3):
            assert get_platform().device_type in (expected, "xpu")
        assert asked == ["torch_npu"]
    finally:
        platform_mod._torch_npu_imports.cache_clear()

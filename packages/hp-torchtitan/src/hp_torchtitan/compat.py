"""The two stand-ins torchtitan 0.3.0 needs to import and build meshes on a CPU-only torch 2.13.

A ``triton`` kernels module ([Note: why stand-ins], above
:func:`install_triton_stand_in`) and the device type
([Note: CPU device type], above :func:`use_cpu_device`). Nothing of torch is patched.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


def _missing_kernel(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{KERNELS_MODULE}.{name} is a triton kernel and triton is not installed; "
            "hp_torchtitan registered a stand-in so dense models import on CPU. "
            "MinimalAsyncEP (expert parallelism) needs a GPU build with triton: install triton "
            "and import torchtitan before hp_torchtitan."
        )

    kernel.__name__ = name
    return kernel


def _kernels_stand_in() -> types.ModuleType:
    module = types.ModuleType(KERNELS_MODULE, "CPU stand-in for torchtitan's triton kernels.")
    module.__file__ = __file__

    def __getattr__(name: str) -> Any:  # module-level __getattr__ (PEP 562)
        if name.endswith("_kernel"):
            return _missing_kernel(name)
        raise AttributeError(name)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


# [Note: why stand-ins]
# torchtitan 0.3.0 imports ``triton`` at import time of any model package:
# ``torchtitan.models.common`` -> ``moe`` -> ``token_dispatcher`` ->
# ``torchtitan.distributed.minimal_async_ep.kernels`` (``import triton``), even for
# dense models that never dispatch tokens. Installing the triton wheel into a CPU
# environment would make ``torch._inductor`` believe a GPU toolchain exists, so
# instead, when triton is absent, we register a module object under that one
# module name whose kernels raise a clear error if ever called. Nothing of torch
# is patched.
def install_triton_stand_in() -> bool:
    """Register the kernels stand-in when triton is missing; return whether it was needed.

    Must run before the first ``import torchtitan.models...``; importing
    :mod:`hp_torchtitan` runs it. Idempotent, and a no-op when triton is
    importable or torchtitan's real kernels module is already loaded.
    """
    if KERNELS_MODULE in sys.modules:
        return False
    if importlib.util.find_spec("triton") is not None:
        return False
    sys.modules[KERNELS_MODULE] = _kernels_stand_in()
    return True


# [Note: CPU device type]
# torchtitan also picks its device type once, at import, from
# torch's available accelerator, which is none on a CPU-only build, and then
# falls back to ``"cuda"``; ``ParallelDims.build_mesh`` then asks
# for a CUDA mesh. :func:`use_cpu_device` points that one module attribute at
# ``"cpu"`` when no accelerator is present.
def use_cpu_device() -> str:
    """Make torchtitan's mesh building use ``"cpu"`` when torch sees no accelerator.

    Returns the device type torchtitan's ``ParallelDims`` will use afterwards.
    On a machine with an accelerator nothing changes.
    """
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils

    if torch.accelerator.current_accelerator() is None:
        for module in (tt_utils, parallel_dims):
            module.device_type = "cpu"
        tt_utils.device_module = torch.cpu
    return str(parallel_dims.device_type)

"""Policies: frozen dataclasses that say *how* a unit stores and computes, never *what* it holds.

They are frozen so a policy object can be shared by many ``fully_shard``
calls (and hashed into caches) without one unit's change leaking into another.
Their fields are checked when the policy is built (``__post_init__``), so a
wrong type or an unusable dtype is reported at the line that wrote it rather
than by torch inside the first forward; the checks live in the leaf
:mod:`hp_fsdp.arg_checks`, the only module of hp_fsdp this one imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hp_fsdp.arg_checks import check_flag, check_mixed_precision

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute, gradient reduction and outputs of a unit.

    * ``param_dtype``: dtype of the gathered (unsharded) parameters, i.e. the
      compute dtype. The sharded parameters (the optimizer's master copy) keep
      their own dtype; the cast happens while copying into the all-gather
      buffer, so it costs no extra pass.
    * ``reduce_dtype``: dtype of the gradient reduce-scatter / all-reduce.
      Defaults to ``param_dtype`` when that is set; reducing bf16 gradients in
      fp32 avoids losing low bits when many ranks are summed.
    * ``output_dtype``: dtype floating-point forward outputs are cast to.
    * ``cast_forward_inputs``: cast floating-point forward inputs to
      ``param_dtype`` so the first op does not promote back to fp32.
    * ``apply_grad_on_fp32_main_grad``: accumulate the reduced gradient into an
      fp32 ``main_grad`` attribute of the sharded parameter instead of
      ``.grad`` (for optimizers that read ``main_grad``, as Megatron-style
      trainers do).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False

    def __post_init__(self) -> None:
        """Refuse a dtype that is not a floating-point ``torch.dtype`` (or None) and a non-bool flag."""
        check_mixed_precision(self)


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: the base class, so ``offload_policy=OffloadPolicy()`` means "keep on device"."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and their gradients on CPU; gather onto the device only for compute.

    The optimizer then steps on CPU. ``pin_memory`` pins the CPU shards so
    host-to-device copies can overlap; on a machine whose compute device is
    the CPU there is nothing to overlap with and pinning is skipped (pinning
    needs an accelerator runtime and would fail).
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        """Refuse a non-bool ``pin_memory`` (a string such as ``"no"`` would be truthy and pin)."""
        check_flag(
            "CPUOffloadPolicy", "pin_memory", self.pin_memory, "True pins the CPU shards, False does not"
        )

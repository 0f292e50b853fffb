"""Checks of single argument values: flags, dtypes, policy instances, reduce settings.

A leaf: it imports nothing of hp_fsdp, so the policies can check their own
fields with it (``__post_init__``) and every entry point can check its plain
arguments before it changes anything. Each error names the value it saw and
the fix. Checks that need the model live in :mod:`hp_fsdp.plan`, those that
need other ranks in :mod:`hp_fsdp.agreement`.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import torch

__all__ = [
    "check_divide_factor",
    "check_flag",
    "check_instance",
    "check_mixed_precision",
    "check_reduce_op_type",
    "from_torch",
    "torch_name",
]


def check_flag(what: str, name: str, value: Any, meaning: str) -> None:
    """``value`` must be a real bool: a string like ``"no"`` or an int would be truthy and mean yes.

    ``meaning`` says what True and False do, so the message carries the fix.
    """
    if not isinstance(value, bool):
        raise TypeError(
            f"{what}: {name}={value!r} is a {type(value).__name__}, not a bool; "
            f"pass True or False ({meaning})."
        )


def _check_dtype(what: str, name: str, value: Any, meaning: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{what}: {name}={value!r} is a {type(value).__name__}, not a torch.dtype; pass a floating-point "
            f"torch.dtype such as torch.bfloat16 or torch.float32, or None ({meaning})."
        )
    if not value.is_floating_point:
        raise ValueError(
            f"{what}: {name}={value} is not a floating-point dtype, and parameters and gradients cast to it "
            "could not take gradients or be averaged; pass torch.bfloat16, torch.float16 or torch.float32, "
            f"or None ({meaning})."
        )


def check_mixed_precision(policy: Any) -> None:
    """The fields of a :class:`~hp_fsdp.policies.MixedPrecisionPolicy` (run by its ``__post_init__``)."""
    what = "MixedPrecisionPolicy"
    _check_dtype(what, "param_dtype", policy.param_dtype, "None: compute in each parameter's own dtype")
    _check_dtype(what, "reduce_dtype", policy.reduce_dtype, "None: reduce in param_dtype")
    _check_dtype(what, "output_dtype", policy.output_dtype, "None: leave forward outputs as computed")
    check_flag(
        what, "cast_forward_inputs", policy.cast_forward_inputs, "True casts floating inputs to param_dtype"
    )
    check_flag(
        what,
        "apply_grad_on_fp32_main_grad",
        policy.apply_grad_on_fp32_main_grad,
        "True accumulates into an fp32 main_grad instead of .grad",
    )


def from_torch(value: Any) -> bool:
    """Whether ``value`` is an instance of one of torch.distributed's classes (FSDP2's, DTensor's)."""
    return type(value).__module__.startswith("torch.distributed")


def torch_name(value: Any) -> str:
    """The public name of a torch.distributed class (``torch.distributed.fsdp.MixedPrecisionPolicy``)."""
    module = type(value).__module__
    for public in ("torch.distributed.fsdp", "torch.distributed.tensor"):
        if module.startswith(public):
            module = public
            break
    return f"{module}.{type(value).__name__}"


def _hp_equivalent(value: Any) -> str:
    """``value`` (a torch.distributed.fsdp policy, a dataclass) as the hp_fsdp call with its fields."""
    values = ", ".join(f"{f.name}={getattr(value, f.name)!r}" for f in fields(value))
    return f"hp_fsdp.{type(value).__name__}({values})"


def check_instance(what: str, name: str, value: Any, cls: type, example: str) -> None:
    """``value`` must be an instance of ``cls``; passing the class itself is the usual slip.

    The other usual one is FSDP2's policy of the same name
    (``torch.distributed.fsdp.MixedPrecisionPolicy``), which hp_fsdp's
    ``fully_shard`` does not read: the message spells out the hp_fsdp
    policy with the same field values.
    """
    if isinstance(value, cls):
        return
    if isinstance(value, type) and issubclass(value, cls):
        raise TypeError(
            f"{what}: {name}={value.__name__} is the class, not a policy; instantiate it: {example}."
        )
    if from_torch(value):
        try:
            fix = _hp_equivalent(value)
        except TypeError:  # not a dataclass in this torch version: name the class only
            fix = f"hp_fsdp.{type(value).__name__}(...)"
        raise TypeError(
            f"{what}: {name}={value!r} is {torch_name(value)}, torch's FSDP2 "
            f"policy, not hp_fsdp's; import the policy from hp_fsdp instead: pass {fix} (the same fields)."
        )
    raise TypeError(
        f"{what}: {name}={value!r} is a {type(value).__name__}, not an instance of {cls.__name__}; "
        f"pass {example}."
    )


def check_divide_factor(factor: Any) -> None:
    """A finite positive real: 0, a negative, NaN or inf would make every gradient 0, NaN or flip it."""
    bad_type = not isinstance(factor, (int, float)) or isinstance(factor, bool)
    if bad_type or not math.isfinite(factor) or factor <= 0:
        raise ValueError(
            f"set_gradient_divide_factor: factor={factor!r} is not a finite positive number; pass the number "
            "the summed gradients are divided by (e.g. the data-parallel world size, or 1.0 for a plain sum)."
        )


def check_reduce_op_type(reduce_op_type: Any) -> None:
    """Only the two ops FSDP2 offers; anything else would silently fall back to one of them."""
    if reduce_op_type not in ("avg", "sum") or not isinstance(reduce_op_type, str):
        raise ValueError(
            f"set_reduce_op_type: reduce_op_type={reduce_op_type!r}; pass 'avg' (the mean over the "
            "data-parallel ranks) or 'sum'. For another divisor use set_gradient_divide_factor."
        )

"""Autograd-free access to a DTensor's local piece, for libraries built on DTensor.

:func:`local_tensor` returns the local tensor itself, at the cost of an
attribute read ([Note: reading the local tensor without autograd]). To build
a DTensor around a local tensor and a known :class:`Layout` without
communication or autograd, use :func:`hp_dtensor.new_dtensor`; for sizes of
uneven shards, :func:`hp_dtensor.chunk_sizes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hp_dtensor.dtensor import DTensor

__all__ = ["local_tensor"]


# [Note: reading the local tensor without autograd]
# ``DTensor.to_local()`` is differentiable: every call runs an autograd
# Function and returns a fresh view, which is what model code wants.
# A library that manages DTensor storage itself, such as hp_fsdp copying every
# parameter's shard into an all-gather buffer on every step under no_grad, needs
# the local tensor *itself*: the same tensor object each time (so it can copy
# into it in place, keeping an optimizer's state valid) at the cost of an
# attribute read. ``.data`` would give it too, but dispatches a ``detach``
# through DTensor's op rules per call (measured at about 3% of a small model's
# step in ``benchmarks/fsdp_step.py``). :func:`local_tensor` is that read,
# behind a public name, so that such libraries do not depend on how
# :class:`~hp_dtensor.DTensor` stores its piece.
def local_tensor(dt: DTensor) -> torch.Tensor:
    """This rank's piece of ``dt`` itself: not a view, nothing recorded for autograd, no dispatch.

    Writes to it change ``dt`` (use it under ``torch.no_grad()``, or on
    tensors autograd does not track, such as a Parameter's data). For a
    differentiable read use :meth:`DTensor.to_local`. See [Note: reading the
    local tensor without autograd].
    """
    local: torch.Tensor = dt._local
    return local

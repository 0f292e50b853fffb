"""In-place view ops (``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``): the tensor itself changes shape.

``torch.matmul`` of a 1-D and a 2-D tensor runs ``a.unsqueeze(0).mm(b).squeeze_(0)``,
so ``v @ M`` meets an in-place view on the product. Such an op changes the
shape and strides of its argument in place; it is neither "the same op on
every piece" (the generic in-place path keeps the layout) nor a value to
write back (the fallback's copy into the old layout fails on the new shape).
How they run: [Note: in-place views] (above :func:`_inplace_view`).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor.dtensor import DTensor
from hp_dtensor.ops.dispatch import SPECIAL

__all__: list[str] = []

aten = torch.ops.aten

_TWINS: dict[Any, Any] = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


def _set_wrapper_metadata(func: Any, dt: DTensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run the in-place view ``func`` on the wrapper's own sizes and strides (no data: meta kernels)."""
    with torch.utils._mode_utils.no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(dt, *args[1:], **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)


# [Note: in-place views]
# The out-of-place twin (``squeeze`` for ``squeeze_``, ...) runs on the
# DTensor through its own view rule, which decides where the shards go and
# may move data; the DTensor then adopts the twin's local tensor and layout,
# and its wrapper's sizes and strides are set by running the op on the
# wrapper itself with dispatch off and meta kernels on (what torch does for
# its own wrapper subclasses in ``return_and_correct_aliasing``), so
# ``x.shape`` and ``x.stride()`` agree with the new layout. Autograd records
# the view above this level, as for a plain tensor.
def _inplace_view(func: Any) -> Any:
    twin = _TWINS[func]

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> DTensor:
        dt = args[0]
        result = twin(dt, *args[1:], **kwargs)  # see [Note: in-place views]
        assert isinstance(result, DTensor), f"{twin} on a DTensor returned {type(result)}"
        dt._local, dt._layout = result._local, result._layout
        _set_wrapper_metadata(func, dt, args, kwargs)
        return dt

    return run


for _func in _TWINS:
    SPECIAL[_func] = _inplace_view(_func)


def _resize(args: tuple[Any, ...], kwargs: dict[str, Any]) -> DTensor:
    """``resize_`` to the DTensor's own shape is a no-op (what ``out=`` factories call first); others refused.

    A DTensor's global shape is fixed when it is made: growing or shrinking
    it would leave every rank's piece to be re-cut under a layout nobody chose.
    """
    dt, size = args[0], tuple(args[1])
    if size == tuple(dt.shape) and kwargs.get("memory_format") in (None, torch.contiguous_format):
        return dt
    raise NotImplementedError(
        f"aten.resize_: a DTensor of shape {tuple(dt.shape)} cannot be resized to {size} (its layout fixes "
        "its shape); make a new DTensor of that shape (e.g. distribute_tensor(torch.empty(...)))."
    )


SPECIAL[aten.resize_.default] = _resize

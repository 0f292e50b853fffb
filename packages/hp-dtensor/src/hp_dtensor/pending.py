"""PendingTensor: the local tensor of an asynchronous redistribution, which waits on first use.

``DTensor.redistribute(..., async_op=True)`` leaves its last collective in
flight and returns a DTensor whose local tensor waits on first read; views
stay pending, as torch's ``AsyncCollectiveTensor`` does ([Note: asynchronous
redistribution]). Nothing here synchronises the host with a device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hp_core.work import Work
from torch.utils import _pytree as pytree

__all__ = ["PendingTensor", "pending", "then", "wait_local"]

Finish = Callable[[], torch.Tensor]


# [Note: asynchronous redistribution]
# ``DTensor.redistribute(..., async_op=True)`` issues its last collective with
# an hp_core async handle (:class:`hp_core.work.Work`) and returns at once. The
# result's local tensor is a :class:`PendingTensor`: a wrapper subclass with the
# final local shape, stride and dtype but no data of its own. The first op that
# reads it (any aten op reaching :meth:`PendingTensor.__torch_dispatch__`: the
# DTensor op rules' local ops, ``to_local()`` followed by arithmetic, a
# collective, ``.item()``) waits for the handle, runs the step's
# post-processing (the cut-back of a padded gather, a ``movedim``) exactly once,
# and from then on every op runs on the finished tensor. Ops return plain
# tensors: only the pending value itself is wrapped.
#
# View ops (``view``, ``alias``, ``t``, ...) do not wait: they return another
# PendingTensor whose value is that view of the finished tensor, so
# ``dt.to_local()`` keeps the work in flight as torch's ``AsyncCollectiveTensor``
# does; the view and its base share storage once finished. Earlier steps of a
# multi-step plan are waited for before the last one is issued (each step needs
# the previous one's data); only the last step is left in flight.
#
# Nothing here synchronises the host with a device: ``wait()`` on an NCCL or
# HCCL handle orders the current stream after the collective, as c10d does.
# Under ``torch.compile`` collectives are functional and ordered by the
# compiler, so redistribution never creates a PendingTensor while tracing.
class PendingTensor(torch.Tensor):
    """A local tensor whose value arrives when ``work`` completes; waits on first use.

    ``finish()`` returns the final value once ``work`` has been waited for (it
    may post-process the collective's buffer). See [Note: asynchronous
    redistribution].
    """

    _work: Work[Any] | None
    _finish: Finish | None
    _value: torch.Tensor | None

    @staticmethod
    def __new__(
        cls,
        work: Work[Any] | None,
        finish: Finish,
        shape: torch.Size | tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> PendingTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, dtype=dtype, device=device, requires_grad=False
        )
        out._work = work
        out._finish = finish
        out._value = None
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # all work happens in __new__
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def work(self) -> Work[Any] | None:
        """The handle this value waits for (None for a view: its base holds the handle)."""
        return self._work

    @property
    def completed(self) -> bool:
        """Whether the value has been waited for (torch's ``AsyncCollectiveTensor.completed``)."""
        return self._value is not None

    def wait(self) -> torch.Tensor:
        """Wait for the communication and return the finished local tensor (a plain tensor)."""
        value = self._value
        if value is None:
            if self._work is not None:
                self._work.wait()
            assert self._finish is not None
            value = self._value = self._finish()
            self._work = None
            self._finish = None
        return value

    # [Note: a pending tensor entering a compiled region]
    # A PendingTensor handed to a ``torch.compile``d function (``y.to_local()``
    # of an async redistribution) is a traceable wrapper subclass: its one inner
    # tensor is the finished value, so flattening it, which the compiled code's
    # entry does with every input at run time, waits. The graph itself sees a
    # completed PendingTensor around a fake value and traces the ops on it;
    # the result is what eager ops on the finished value give.
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["finished"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], context: None, outer_size: Any, outer_stride: Any
    ) -> PendingTensor:
        value = inner["finished"]
        size = value.shape if outer_size is None else outer_size
        stride = value.stride() if outer_stride is None else outer_stride
        out = PendingTensor(None, lambda: value, size, stride, value.dtype, value.device)
        out._value = value
        out._finish = None
        return out

    @property
    def finished(self) -> torch.Tensor:
        """The finished value (waits): the inner tensor ``torch.compile`` sees."""
        return self.wait()

    def __repr__(self) -> str:  # type: ignore[override]
        return f"PendingTensor({self.wait()!r})"

    def tolist(self) -> Any:
        return self.wait().tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        return self.wait().numpy(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if getattr(func, "is_view", False) and isinstance(first, PendingTensor) and not first.completed:
            others = pytree.tree_leaves((args[1:], kwargs))
            if not any(isinstance(a, PendingTensor) for a in others):
                return _pending_view(func, args, kwargs)
        args, kwargs = pytree.tree_map_only(PendingTensor, PendingTensor.wait, (args, kwargs))
        return func(*args, **kwargs)


def _pending_view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` (a view op) of a pending value, itself pending: it waits when first used."""
    base: PendingTensor = args[0]
    rest = args[1:]
    meta = func(_meta_like(base), *rest, **kwargs)
    if not isinstance(meta, torch.Tensor):  # multi-output views (split, unbind): wait instead
        return func(base.wait(), *rest, **kwargs)
    return then(base, lambda value: func(value, *rest, **kwargs))


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def pending(
    work: Work[Any] | None, buffer: torch.Tensor, post: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> PendingTensor:
    """The value ``post(buffer)`` (or ``buffer``) once ``work`` completed, as a PendingTensor.

    ``post`` must be made of tensor ops that also run on meta tensors: it is
    run once on a meta stand-in to learn the final shape, stride and dtype.
    """
    if post is None:
        return PendingTensor(work, lambda: buffer, buffer.shape, buffer.stride(), buffer.dtype, buffer.device)
    meta = post(_meta_like(buffer))
    return PendingTensor(work, lambda: post(buffer), meta.shape, meta.stride(), meta.dtype, buffer.device)


def then(value: PendingTensor, post: Callable[[torch.Tensor], torch.Tensor]) -> PendingTensor:
    """``post`` of a pending value, still pending (``post`` as for :func:`pending`)."""
    meta = post(_meta_like(value))
    return PendingTensor(
        None, lambda: post(value.wait()), meta.shape, meta.stride(), meta.dtype, value.device
    )


def wait_local(local: torch.Tensor) -> torch.Tensor:
    """``local`` finished: a PendingTensor is waited for, anything else is returned as is."""
    if local.__class__ is PendingTensor:
        return local.wait()  # type: ignore[attr-defined]
    return local

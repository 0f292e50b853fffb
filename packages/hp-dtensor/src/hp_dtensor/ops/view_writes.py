"""Writes into a view whose pieces had to be moved reach the tensor it was taken from.

See [Note: writes through moved views].
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hp_dtensor.dtensor import DTensor, new_dtensor
from hp_dtensor.layout import Layout

__all__ = ["after_view", "is_view_op", "refresh_views", "view_aliases", "write_back", "writes_first"]

aten = torch.ops.aten


# [Note: writes through moved views]
# A view op on a plain tensor returns an alias: ``x[2:4].add_(1)`` or
# ``x[1:5] = v`` changes ``x``. A view rule that must move pieces first (a
# slice across a cut dim, a select of a row another rank holds, a view that
# merges dims no placement can keep) returns a new tensor holding the view's
# values, not an alias of ``x``'s pieces, and a write into it would be lost:
# the result silently differs from one process (torch's DTensor has the same
# gap). So every view op's output is checked once, right after the op: if its
# local tensor does not share storage with the input's, the output is marked
# with where it came from (the input, the view op and its arguments). Views of
# a marked output that do alias it carry the same mark. After any in-place op
# on a marked DTensor, the copy is written back: the view's scatter op
# (``slice_scatter`` for ``slice``, ``select_scatter``, ``diagonal_scatter``,
# ``as_strided_scatter``, a reshape back for the reshaping views, the inverse
# permutation) puts the copy's values into a new value of the input, which is
# then ``copy_``'d into the input, itself a marked view perhaps, and so on up.
# Writing back is idempotent, so a view that did alias after all costs a
# redundant copy, never a wrong value. A view op without a known inverse
# (``unfold``, ``expand``) raises ``NotImplementedError`` on the write, on
# every rank alike, naming the op. The other direction: a write into the input
# after a moved view was taken must reach the view, so the input keeps weak
# references to its moved views, and after an in-place op on it each live
# one is recomputed and its local values replaced in place (views aliasing it
# see them). Autograd already counts a view op's output as a view of its input
# (one version counter), so a saved moved view changed this way is refused at
# backward, as for a plain tensor.
@dataclasses.dataclass(frozen=True)
class Mark:
    """Where a moved view's values came from: ``func(*args)`` of ``base`` (output ``index``)."""

    base: DTensor
    copy_local: torch.Tensor
    copy_layout: Layout
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    index: int


def is_view_op(func: Any) -> bool:
    """Whether ``func`` returns an alias of its first argument (aten's schema says so); cached per op."""
    known = _VIEW_OPS.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = bool(
            schema is not None
            and schema.arguments
            and schema.returns
            and schema.arguments[0].alias_info is not None
            and not schema.arguments[0].alias_info.is_write
            and schema.returns[0].alias_info is not None
        )
        _VIEW_OPS[func] = known
    return known


_VIEW_OPS: dict[Any, bool] = {}


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # storage-less locals (never expected): treat as a copy
        return False


def after_view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """Mark the outputs of view op ``func`` that do not alias its input.

    See [Note: writes through moved views].
    """
    base = args[0] if args else None
    if not isinstance(base, DTensor):
        return
    inherited = base._copy_of
    outputs = out if isinstance(out, (list, tuple)) else (out,)
    for index, value in enumerate(outputs):
        if not isinstance(value, DTensor):
            continue
        if _shares_storage(value._local, base._local):
            if inherited is not None:
                value._copy_of = inherited
        elif value.numel() > 0:
            value._copy_of = Mark(base, value._local, value._layout, func, args, dict(kwargs), index)
            views = base._moved_views
            if views is None:
                views = base._moved_views = []
            else:
                views[:] = [ref for ref in views if ref() is not None]
            views.append(weakref.ref(value))


def write_back(mark: Mark) -> None:
    """Put a moved view's (changed) values back into the tensor it was taken from."""
    copy = new_dtensor(mark.copy_local, mark.copy_layout)
    inverse = _INVERSES.get(mark.func)
    if inverse is None:
        raise NotImplementedError(
            f"{mark.func}: this view's pieces had to be moved, so it is a copy, and hp_dtensor cannot "
            "write an in-place change of it back into the tensor it came from (the op has no scatter "
            "inverse here). Write out of place instead (e.g. y = x.clone(); ... ) or redistribute x to "
            "Replicate() before taking the view."
        )
    with torch.no_grad():
        updated = inverse(mark, copy)
        _WRITING.source = mark.copy_local  # its values are already the base's: no refresh of it
        try:
            aten.copy_.default(mark.base, updated)
        finally:
            _WRITING.source = None


_WRITING = threading.local()


def refresh_views(base: DTensor) -> None:
    """After an in-place op on ``base``: recompute its live moved views in place (see the note)."""
    views = base._moved_views
    if not views:
        return
    skip = getattr(_WRITING, "source", None)
    live = [view for view in (ref() for ref in views) if view is not None]
    base._moved_views = [weakref.ref(view) for view in live]
    for view in live:
        mark = view._copy_of
        if mark is None or mark.base is not base or mark.copy_local is skip:
            continue
        with torch.no_grad():
            fresh = mark.func(base, *mark.args[1:], **mark.kwargs)
        if isinstance(fresh, (list, tuple)):
            fresh = fresh[mark.index]
        if fresh._layout != mark.copy_layout:
            raise NotImplementedError(
                f"{mark.func}: a write into a tensor changed the layout of a moved view of it "
                f"({mark.copy_layout} then {fresh._layout}); take the view again after writing."
            )
        mark.copy_local.copy_(fresh._local)
        refresh_views(view)


def _arg(mark: Mark, position: int, name: str, default: Any) -> Any:
    if len(mark.args) > position:
        return mark.args[position]
    return mark.kwargs.get(name, default)


def _slice(mark: Mark, copy: DTensor) -> Any:
    return aten.slice_scatter.default(
        mark.base,
        copy,
        _arg(mark, 1, "dim", 0),
        _arg(mark, 2, "start", None),
        _arg(mark, 3, "end", None),
        _arg(mark, 4, "step", 1),
    )


def _select(mark: Mark, copy: DTensor) -> Any:
    return aten.select_scatter.default(mark.base, copy, _arg(mark, 1, "dim", 0), _arg(mark, 2, "index", 0))


def _diagonal(mark: Mark, copy: DTensor) -> Any:
    return aten.diagonal_scatter.default(
        mark.base,
        copy,
        _arg(mark, 1, "offset", 0),
        _arg(mark, 2, "dim1", 0),
        _arg(mark, 3, "dim2", 1),
    )


def _as_strided(mark: Mark, copy: DTensor) -> Any:
    return aten.as_strided_scatter.default(
        mark.base,
        copy,
        _arg(mark, 1, "size", None),
        _arg(mark, 2, "stride", None),
        _arg(mark, 3, "storage_offset", None),
    )


def _reshape_back(mark: Mark, copy: DTensor) -> Any:
    return copy.reshape(mark.base.shape)


def _transpose_back(mark: Mark, copy: DTensor) -> Any:
    return aten.transpose.int(copy, _arg(mark, 1, "dim0", 0), _arg(mark, 2, "dim1", 1))


def _t_back(mark: Mark, copy: DTensor) -> Any:
    return aten.t.default(copy)


def _permute_back(mark: Mark, copy: DTensor) -> Any:
    dims = [d % copy.dim() for d in _arg(mark, 1, "dims", ())]
    inverse = [0] * len(dims)
    for position, d in enumerate(dims):
        inverse[d] = position
    return aten.permute.default(copy, inverse)


def _unbind(mark: Mark, copy: DTensor) -> Any:
    return aten.select_scatter.default(mark.base, copy, _arg(mark, 1, "dim", 0), mark.index)


def _split_offsets(mark: Mark) -> tuple[int, int, int]:
    dim = _arg(mark, 2, "dim", 0) % mark.base.dim()
    length = mark.base.shape[dim]
    if mark.func is aten.split_with_sizes.default:
        sizes = list(_arg(mark, 1, "split_sizes", ()))
    else:
        if mark.func is aten.chunk.default:
            chunks = int(_arg(mark, 1, "chunks", 1))
            size = -(-length // chunks)
        else:
            size = int(_arg(mark, 1, "split_size", 1))
        sizes = [min(size, length - start) for start in range(0, length, size)] if size > 0 else [length]
    start = sum(sizes[: mark.index])
    return dim, start, start + sizes[mark.index]


def _split(mark: Mark, copy: DTensor) -> Any:
    dim, start, end = _split_offsets(mark)
    return aten.slice_scatter.default(mark.base, copy, dim, start, end, 1)


def _view_as_real_back(mark: Mark, copy: DTensor) -> Any:
    return aten.view_as_complex.default(copy.contiguous())


def _view_as_complex_back(mark: Mark, copy: DTensor) -> Any:
    return aten.view_as_real.default(copy)


def _same(mark: Mark, copy: DTensor) -> Any:
    return copy


_INVERSES: dict[Any, Callable[[Mark, DTensor], Any]] = {
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.diagonal.default: _diagonal,
    aten.as_strided.default: _as_strided,
    aten.view.default: _reshape_back,
    aten._unsafe_view.default: _reshape_back,
    aten._reshape_alias.default: _reshape_back,
    aten.squeeze.default: _reshape_back,
    aten.squeeze.dim: _reshape_back,
    aten.squeeze.dims: _reshape_back,
    aten.unsqueeze.default: _reshape_back,
    aten.transpose.int: _transpose_back,
    aten.t.default: _t_back,
    aten.permute.default: _permute_back,
    aten.unbind.int: _unbind,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.chunk.default: _split,
    aten.view_as_real.default: _view_as_real_back,
    aten.view_as_complex.default: _view_as_complex_back,
    aten.alias.default: _same,
    aten.detach.default: _same,
}


def view_aliases(result: Any, local: torch.Tensor) -> bool:
    """Whether every tensor output of a view op shares storage with the input's local tensor."""
    outputs = result if isinstance(result, (list, tuple)) else (result,)
    return all(not isinstance(v, torch.Tensor) or _shares_storage(v, local) for v in outputs)


def writes_first(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (an in-place op); cached per op."""
    known = _WRITES_FIRST.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        alias = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
        known = bool(alias is not None and alias.is_write)
        _WRITES_FIRST[func] = known
    return known


_WRITES_FIRST: dict[Any, bool] = {}

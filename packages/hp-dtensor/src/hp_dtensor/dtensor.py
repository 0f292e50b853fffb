"""DTensor: a torch.Tensor subclass that is one rank's piece of a global tensor.

A DTensor is a *wrapper* subclass: the wrapper has the global shape, stride,
dtype and device but no storage; the data lives in ``_local`` (this rank's
piece) and ``_layout`` says which piece it is. Every aten op on a DTensor
reaches :meth:`DTensor.__torch_dispatch__`, which finds the op's sharding rule,
redistributes the inputs it must, runs the op on the local tensors and wraps
the results (see :mod:`hp_dtensor.ops`).

Autograd sits above dispatch: backward formulas run aten ops on DTensors, so
the same rules shard the backward pass. The entry and exit points
(``from_local``, ``to_local``, ``redistribute``) are autograd Functions whose
backward move the gradient to the right placements ([Note: gradient
placements] in :mod:`hp_dtensor.redistribute`).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core import DeviceMesh
from hp_core.distributed import mesh_group
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

from hp_dtensor import checkpoint as _dcp
from hp_dtensor._agree import agree_over_mesh, describe
from hp_dtensor.layout import Layout, global_stride_like, normalize_placements
from hp_dtensor.pending import PendingTensor, then
from hp_dtensor.placements import Partial, Placement, Replicate, Shard, StridedShard, torch_equivalent
from hp_dtensor.redistribute import redistribute_local, slice_for_layout

__all__ = ["DTensor", "distribute_module", "distribute_tensor", "new_dtensor"]


def _dispatch_not_ready(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError(
        "hp_dtensor: import hp_dtensor (not only hp_dtensor.dtensor) to register the op rules."
    )


# Set by hp_dtensor.ops.dispatch at import: one global lookup per op instead of an import statement.
_DISPATCH: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] = _dispatch_not_ready


def _check_mesh(mesh: Any, what: str) -> DeviceMesh:
    """``mesh`` as an hp_core mesh: ours as it is, torch's through ``DeviceMesh.from_torch``.

    from_torch is memoised per torch mesh and runs on torch's own groups, so
    every entry may take a torch mesh at no cost after the first call, and
    layouts on it keep one mesh object (and their cache tokens).
    """
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, TorchDeviceMesh):
        return DeviceMesh.from_torch(mesh)
    raise TypeError(
        f"{what}: device_mesh must be an hp_core.DeviceMesh or a torch DeviceMesh, got "
        f"{type(mesh).__module__}.{type(mesh).__name__}; "
        "build one with hp_core.init_device_mesh(...) or torch's init_device_mesh(...)."
    )


_make_wrapper = torch.Tensor._make_wrapper_subclass


def new_dtensor(local: torch.Tensor, layout: Layout) -> DTensor:
    """A DTensor around ``local`` (no grad, no checks): the dispatcher's hot path skips ``__init__``."""
    out = _make_wrapper(DTensor, layout.shape, strides=layout.stride, dtype=local.dtype, device=local.device)
    out._local = local
    out._layout = layout
    if local.is_conj() or local.is_neg():
        carry_lazy_bits(out, local)
    return out


def carry_lazy_bits(wrapper: torch.Tensor, local: torch.Tensor) -> None:
    """Give ``wrapper`` the lazy conjugate / negative bits of its local tensor.

    [Note: lazy conjugate and negative bits]
    ``torch.conj`` (and ``_neg_view``) return views flagged "read me
    conjugated / negated" instead of computing. Those flags are honoured by
    the Conjugate and Negative dispatch keys, which run *before* the Python
    key and whose fallback then leaves them switched off for the rest of the
    call: inside ``__torch_dispatch__`` a flagged local tensor is read as if
    unflagged. So a flag that only the local tensor carried was lost as soon
    as the DTensor met another op (``g * torch.conj(x)`` computed ``g * x``).
    The wrapper carries the flags too, as torch's composite-compliance test
    tensor does: the fallbacks at the wrapper's level then materialise the
    value before our dispatch sees the op, and view ops pass the flag on.
    """
    torch._C._set_conj(wrapper, local.is_conj())
    torch._C._set_neg(wrapper, local.is_neg())


class DTensor(torch.Tensor):
    """One rank's piece (``_local``) of a global tensor described by ``_layout``.

    [Note: DTensor under torch.compile]
    DTensor is a traceable wrapper subclass: ``__tensor_flatten__`` hands
    dynamo and AOTAutograd the local tensor and the (hashable, comparable)
    ``Layout``, so a compiled graph runs the op rules at trace time and holds
    only local ops and functional collectives ([Note: collectives under
    torch.compile] in ``hp_core._issue``). Construction is never traced
    (``__new__`` is excluded from dynamo), and the two coercion hooks tell
    AOTAutograd which layout a gradient has at run time.
    """

    _local: torch.Tensor
    _layout: Layout
    # Set on a view whose pieces had to be moved (a copy, not an alias): where to write an
    # in-place change back to ([Note: writes through moved views] in ops/view_writes.py).
    _copy_of: Any = None
    _moved_views: Any = None  # weak references to this tensor's moved views (same note)

    @staticmethod
    @torch._disable_dynamo
    def __new__(cls, local: torch.Tensor, layout: Layout, *, requires_grad: bool = False) -> DTensor:
        # Never traced: dynamo cannot trace _make_wrapper_subclass, and a resume frame would see a
        # half-built wrapper without ``_layout`` ([Note: DTensor under torch.compile]).
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            layout.shape,
            strides=layout.stride,
            dtype=local.dtype,
            device=local.device,
            layout=local.layout,
            requires_grad=requires_grad,
        )
        out._local = local
        out._layout = layout
        if local.is_conj() or local.is_neg():
            carry_lazy_bits(out, local)
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # all work happens in __new__
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return _DISPATCH(func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        placements = "(" + ", ".join(repr(p) for p in self._layout.placements) + ")"
        return (
            f"DTensor(local_tensor={self._local!r}, device_mesh={self._layout.mesh!r}, "
            f"placements={placements}, shape={tuple(self._layout.shape)})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], Layout]:
        return ["_local"], self._layout

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], layout: Layout, outer_size: Any, outer_stride: Any
    ) -> DTensor:
        local = inner["_local"]
        if outer_size is not None and tuple(outer_size) != layout.shape:
            # AOTAutograd rebuilds tensors with the shapes it traced (symbolic under dynamic shapes)
            layout = Layout(layout.mesh, layout.placements, tuple(outer_size), tuple(outer_stride))
        return DTensor(local, layout, requires_grad=local.requires_grad)

    # -- AOTAutograd ([Note: DTensor under torch.compile]) ---------------------------

    def __coerce_tangent_metadata__(self) -> DTensor:
        """The layout AOTAutograd assumes for this output's gradient: Partial becomes Replicate.

        A loss built from a Partial output receives a replicated gradient at
        run time; guessing that at trace time avoids a redistribution in the
        backward prologue.
        """
        if not self._layout.has_partial():
            return self
        placements = [Replicate() if isinstance(p, Partial) else p for p in self._layout.placements]
        return self.redistribute(placements=placements)

    def __coerce_same_metadata_as_tangent__(
        self, expected: Layout, expected_type: Any = None
    ) -> DTensor | None:
        """A run-time gradient moved to the layout the compiled backward was traced with."""
        if expected_type is not None:
            return None
        if self._layout == expected:
            return self
        return self.redistribute(device_mesh=expected.mesh, placements=expected.placements)

    # -- metadata ---------------------------------------------------------------------

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim."""
        return self._layout.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the tensor is spread over."""
        return self._layout.mesh

    @property
    def layout_spec(self) -> Layout:
        """The full :class:`Layout` (mesh, placements, global shape and stride, per-rank sizes)."""
        return self._layout

    # -- torch.distributed.checkpoint -------------------------------------------------
    # DCP asks any state-dict value for these three methods before it falls back to saving a
    # plain tensor whole; see [Note: DCP protocol] in hp_dtensor.checkpoint.

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        """DCP save: this rank's piece as a write item (none for an empty piece); Partial is refused."""
        return _dcp.write_items(self._layout, self._local, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        """DCP load: this rank's box of the global tensor; only saved parts overlapping it are read."""
        return _dcp.chunk_list(self._layout, self._local)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """DCP save and load: the local tensor to write from or load into in place."""
        return _dcp.tensor_shard(self._layout, self._local, index)

    # -- entry and exit ---------------------------------------------------------------

    @staticmethod
    def from_local(
        local: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        shape: Sequence[int] | None = None,
        run_check: bool = False,
    ) -> DTensor:
        """Wrap this rank's ``local`` piece as a DTensor; differentiable.

        Without ``shape`` the shards are assumed even (global size = local
        size x mesh size on each sharded dim), which needs no communication.
        With ``shape`` (or ``run_check=True``) every rank's local shape is
        gathered once, so arbitrary per-rank sizes ("ragged") are supported
        and inconsistent shapes raise an error naming the ranks and sizes; the
        same gather checks that the ranks agree on dtype, placements and
        ``shape``, and every rank raises if they do not.
        """
        what = "DTensor.from_local"
        mesh = _check_mesh(device_mesh, what)
        if run_check is not True and run_check is not False:
            raise TypeError(
                f"{what}: run_check must be True or False, got {type(run_check).__name__} {run_check!r}."
            )
        table: list[Any] | None = None
        if run_check or (shape is not None and _has_shard(placements)):
            # This call gathers the local shapes anyway: agree on everything else in the same
            # exchange, before any local check ([Note: cross-rank agreement] in hp_core.agreement).
            is_tensor = isinstance(local, torch.Tensor)
            with torch.profiler.record_function("hp_dtensor::from_local_gather_shapes"):  # not a hot path
                table = _agree_on_local(local, is_tensor, mesh, placements, shape, what)
        if not isinstance(local, torch.Tensor) or isinstance(local, DTensor):
            raise TypeError(
                f"{what}: local must be a plain torch.Tensor, got {type(local).__name__}; "
                + (
                    "a DTensor is already distributed, use .redistribute(placements=...)."
                    if isinstance(local, DTensor)
                    else "pass this rank's piece as a tensor, e.g. torch.as_tensor(value)."
                )
            )
        global_shape = None if shape is None else _check_global_shape(shape, local, what)
        normalized = normalize_placements(placements, mesh, local.dim(), what)
        layout = _layout_for_local(local, mesh, normalized, global_shape, table, what)
        return _FromLocal.apply(local, layout)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece as a plain tensor (a view); differentiable.

        The gradient of the local tensor becomes a DTensor with this tensor's
        layout, or with ``grad_placements`` when given.
        """
        return _ToLocal.apply(self, grad_placements)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """The same global tensor under ``placements`` (see :func:`hp_dtensor.explain_redistribute`).

        torch's signature and meaning. ``async_op=True`` returns at once with
        the last collective in flight: the result's local tensor waits on its
        first use ([Note: asynchronous redistribution] in ``hp_dtensor.pending``),
        so independent work can overlap the communication. ``forward_dtype``
        casts the local tensor before the collective (the result has that
        dtype: a bf16 all-gather of an fp32 tensor moves half the bytes);
        ``backward_dtype`` does the same for the gradient's collective, which
        otherwise runs at this tensor's dtype; the gradient always comes back
        in this tensor's dtype.
        """
        what = "DTensor.redistribute"
        if device_mesh is not None and _check_mesh(device_mesh, what) != self._layout.mesh:
            raise ValueError(
                f"{what}: device_mesh {device_mesh!r} differs from the tensor's mesh {self._layout.mesh!r}; "
                "redistribution moves data within one mesh. Use full_tensor() and distribute_tensor() to "
                "change meshes."
            )
        if placements is None:
            raise ValueError(f"{what}: pass placements=, e.g. [Replicate()] * {self._layout.mesh.ndim}.")
        if async_op is not True and async_op is not False:
            raise TypeError(
                f"{what}: async_op must be True or False, got {type(async_op).__name__} {async_op!r}."
            )
        for name, value in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"{what}: {name} must be a torch.dtype or None, got {type(value).__name__} {value!r}; "
                    f"e.g. {name}=torch.bfloat16."
                )
        layout = self._layout
        target = normalize_placements(placements, layout.mesh, layout.ndim, what)
        input_dtype = self.dtype
        forward = forward_dtype or input_dtype
        if target == layout.placements and layout.ragged is None and forward == input_dtype:
            return self
        if self.requires_grad and torch.is_grad_enabled():
            return _Redistribute.apply(self, target, async_op, forward, backward_dtype or input_dtype)
        # Nothing to record for autograd: skip the Function machinery (a large share of the cost
        # of a small redistribution); the result is the same tensor _Redistribute.forward builds.
        local = self._local if forward == input_dtype else self._local.to(forward)
        local, out = redistribute_local(local, layout, target, async_op=async_op)
        return new_dtensor(local, out)

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank, as a plain tensor; differentiable.

        Right for uneven and ragged shards: gathers use the per-rank sizes of
        the layout.
        """
        replicated = self.redistribute(placements=[Replicate()] * self._layout.mesh.ndim)
        return replicated.to_local()


# -- layouts for from_local ---------------------------------------------------------------


def _agree_on_local(
    local: Any, is_tensor: bool, mesh: DeviceMesh, placements: Any, shape: Any, what: str
) -> list[Any] | None:
    """Every mesh coordinate's local shape, once the ranks agree on everything else (one exchange)."""
    return agree_over_mesh(
        what,
        mesh,
        "pass local tensors of one dtype, device type and number of dims, the same placements and "
        "the same shape= on every rank of the mesh (local sizes may differ only along sharded dims).",
        {
            "local": (
                (type(local).__name__, local.dim(), str(local.dtype), local.device.type)
                if is_tensor
                else type(local).__name__
            ),
            "placements": describe(placements),
            "shape": describe(shape),
        },
        extra=tuple(local.shape) if is_tensor else (),
    )


# Placements that cut a tensor dim into pieces adding up to it: a piece's size
# counts towards the global size the same way for both.
_CUTS = (Shard, StridedShard)


def _torch_shard(p: Any) -> bool:
    """Whether ``p`` is a torch placement whose hp equivalent cuts a dim."""
    ours = torch_equivalent(p)
    return ours is not None and ours.is_shard()


def _has_shard(placements: Any) -> bool:
    """Whether ``placements`` (not yet checked: any object) holds a ``Shard``."""
    return isinstance(placements, (list, tuple)) and any(
        (isinstance(p, Placement) and p.is_shard()) or _torch_shard(p) for p in placements
    )


def _check_global_shape(shape: Any, local: torch.Tensor, what: str) -> tuple[int, ...]:
    """``shape=`` as a tuple of non-negative ints with one entry per dim of ``local``."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(
            f"{what}: shape must be a sequence of ints (the global shape), got {type(shape).__name__} "
            f"{shape!r}; e.g. shape={tuple(local.shape)}."
        )
    values: list[Any] = []
    for size in shape:
        try:  # ints and anything that is one (numpy integers); never a bool or a float
            values.append(size if isinstance(size, bool) else operator.index(size))
        except TypeError:
            values.append(size)
    bad = [s for s in values if not isinstance(s, int) or isinstance(s, bool) or s < 0]
    if bad:
        raise ValueError(
            f"{what}: shape={tuple(values)} must hold non-negative ints, but {bad[0]!r} is not one; "
            "pass the global shape, e.g. torch.Size or a tuple of ints."
        )
    if len(values) != local.dim():
        raise ValueError(
            f"{what}: shape={tuple(values)} has {len(values)} dims but the local tensor has {local.dim()} "
            f"(shape {tuple(local.shape)}); give the global shape with the same number of dims."
        )
    return tuple(values)


def _layout_for_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: tuple[int, ...] | None,
    table: list[Any] | None,
    what: str,
) -> Layout:
    """The layout of ``local``: the even cut, ``shape`` as given, or from every rank's local shape.

    ``table`` holds every mesh coordinate's local shape when the call gathered
    them; every check on it is computed from that shared table, so all ranks
    reach the same verdict.
    """
    sharded = {p.dim for p in placements if isinstance(p, _CUTS)}
    if table is None:
        if shape is None:  # the even cut: no communication
            sizes = list(local.shape)
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, _CUTS):
                    sizes[placement.dim] *= mesh.size(mesh_dim)
            return Layout(mesh, placements, sizes, global_stride_like(local, sizes))
        for dim in range(local.dim()):  # shape= with nothing sharded: every dim is local
            if dim not in sharded and local.shape[dim] != shape[dim]:
                raise ValueError(
                    f"{what}: dim {dim} is not sharded, so the local size {local.shape[dim]} must equal "
                    f"shape[{dim}]={shape[dim]}; fix shape= or the placements {list(placements)}."
                )
        return Layout(mesh, placements, shape, global_stride_like(local, shape))
    coords = list(itertools.product(*(range(n) for n in mesh.shape)))
    per_coord = dict(zip(coords, table, strict=True))
    global_shape: list[int] = []
    for dim in range(local.dim()):
        sharding = [m for m, p in enumerate(placements) if p.is_shard(dim)]
        if not sharding:
            seen = {row[dim] for row in table}
            if len(seen) > 1:
                raise ValueError(
                    f"{what}: dim {dim} is not sharded, so every rank must have the same size there, but "
                    f"the local shapes per mesh coordinate are {per_coord}. Fix the local tensors or the "
                    f"placements {list(placements)}."
                )
            global_shape.append(table[0][dim])
            continue
        # The shards of ``dim`` along each line of the sharding mesh dims must add up to one total.
        totals = {
            c: sum(
                table[j][dim]
                for j, o in enumerate(coords)
                if all(o[m] == c[m] for m in range(mesh.ndim) if m not in sharding)
            )
            for c in coords
        }
        if len(set(totals.values())) > 1:
            raise ValueError(
                f"{what}: the shards of dim {dim} add up to different totals {sorted(set(totals.values()))} "
                f"on different lines of the mesh; local shapes per mesh coordinate: {per_coord}. Give every "
                "line of the mesh the same global size."
            )
        global_shape.append(totals[coords[0]])
    if shape is not None and tuple(global_shape) != shape:
        raise ValueError(
            f"{what}: the ranks' local shapes {per_coord} add up to "
            f"{tuple(global_shape)}, not shape={shape}; pass the true global shape."
        )
    return Layout(mesh, placements, global_shape, global_stride_like(local, global_shape), ragged=table)


# -- autograd functions ---------------------------------------------------------------------


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, layout: Layout) -> DTensor:
        ctx.layout = layout
        return DTensor(local.view_as(local), layout)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        layout: Layout = ctx.layout
        if not isinstance(grad, DTensor):
            return grad, None
        target = Layout(
            layout.mesh,
            [Replicate() if isinstance(p, Partial) else p for p in layout.placements],
            layout.shape,
            layout.stride,
            ragged=layout.ragged,
        )
        local, _ = redistribute_local(
            grad._local, grad._layout, target if layout.ragged else target.placements
        )
        return local, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor, grad_placements: Sequence[Placement] | None) -> torch.Tensor:
        layout = dt._layout
        if grad_placements is not None:
            placements = normalize_placements(grad_placements, layout.mesh, layout.ndim, "DTensor.to_local")
            layout = Layout(layout.mesh, placements, layout.shape, layout.stride)
        ctx.layout = layout
        return dt._local.view_as(dt._local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        layout: Layout = ctx.layout
        if isinstance(grad, DTensor):
            return grad, None
        stride = global_stride_like(grad, layout.shape)
        out = Layout(layout.mesh, layout.placements, layout.shape, stride, ragged=layout.ragged)
        return DTensor(grad, out), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        dt: DTensor,
        placements: tuple[Placement, ...],
        async_op: bool,
        forward_dtype: torch.dtype,
        backward_dtype: torch.dtype,
    ) -> DTensor:
        ctx.layout = dt._layout
        ctx.async_op = async_op
        ctx.input_dtype = dt.dtype
        ctx.backward_dtype = backward_dtype
        local = dt._local if forward_dtype == dt.dtype else dt._local.to(forward_dtype)
        local, layout = redistribute_local(local, dt._layout, placements, async_op=async_op)
        return DTensor(local, layout)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None, None]:
        src: Layout = ctx.layout
        if not isinstance(grad, DTensor):
            return grad, None, None, None, None
        placements = [Replicate() if isinstance(p, Partial) else p for p in src.placements]
        if src.ragged is not None:
            target: Layout | list[Placement] = Layout(
                src.mesh, placements, src.shape, src.stride, ragged=src.ragged
            )
        else:
            target = placements
        # [Note: gradient placements] in hp_dtensor.redistribute; the collective runs at
        # backward_dtype and the gradient returns in the input's dtype, as in torch.
        local = grad._local
        if local.dtype != ctx.backward_dtype:
            local = local.to(ctx.backward_dtype)
        local, layout = redistribute_local(local, grad._layout, target, async_op=ctx.async_op)
        if local.dtype != ctx.input_dtype:
            dtype = ctx.input_dtype
            cast = functools.partial(torch.Tensor.to, dtype=dtype)
            local = then(local, cast) if isinstance(local, PendingTensor) else cast(local)
        return DTensor(local, layout), None, None, None, None


# -- distribute_tensor / distribute_module ----------------------------------------------------


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    src_data_rank: int | None = 0,
) -> DTensor:
    """Spread a full tensor over ``device_mesh`` as ``placements``; returns a leaf DTensor.

    With ``src_data_rank=k`` the values of the rank at mesh coordinate
    ``(k, k, ...)`` are used (broadcast along each mesh dim from group rank
    ``k``), so ranks whose copies differ still agree; with ``None`` each rank
    cuts its own copy without communication.
    """
    what = "distribute_tensor"
    mesh = _check_mesh(device_mesh, what)
    if src_data_rank is not None:
        # The broadcast below communicates: agree on the arguments first, so a mismatch raises on every
        # rank instead of corrupting, aborting or hanging ([Note: cross-rank agreement] in hp_core.agreement).
        agree_over_mesh(
            what,
            mesh,
            "call distribute_tensor on every rank of the mesh with a tensor of the same shape, dtype and "
            "device type, the same placements and the same src_data_rank (the values may differ: "
            "src_data_rank's are used).",
            {
                "tensor": describe(tensor),
                "placements": describe(placements),
                "src_data_rank": describe(src_data_rank),
            },
        )
    return _distribute(tensor, mesh, placements, src_data_rank, what)


def _distribute(
    tensor: Any, mesh: DeviceMesh, placements: Sequence[Placement], src_data_rank: Any, what: str
) -> DTensor:
    """:func:`distribute_tensor` once the ranks are known to agree (or need not: no communication)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{what}: tensor must be a torch.Tensor, got {type(tensor).__name__} {_short(tensor)}; "
            "pass the full tensor, e.g. torch.as_tensor(value)."
        )
    if isinstance(tensor, DTensor):
        raise TypeError(f"{what}: tensor is already a DTensor; use .redistribute(placements=...) instead.")
    normalized = normalize_placements(placements, mesh, tensor.dim(), what)
    if src_data_rank is not None:
        if not isinstance(src_data_rank, int) or isinstance(src_data_rank, bool):
            raise TypeError(
                f"{what}: src_data_rank must be an int (a rank within each mesh dim's group) or None, got "
                f"{type(src_data_rank).__name__} {src_data_rank!r}; e.g. src_data_rank=0."
            )
        for mesh_dim in range(mesh.ndim):
            if not 0 <= src_data_rank < mesh.size(mesh_dim):
                raise ValueError(
                    f"{what}: src_data_rank={src_data_rank} is outside mesh dim {mesh_dim} of size "
                    f"{mesh.size(mesh_dim)}; use a group rank in [0, {mesh.size(mesh_dim)}) or None."
                )
    full = tensor.detach()
    if src_data_rank is not None:
        full = full.contiguous().clone()
        for mesh_dim in range(mesh.ndim):
            hc.broadcast(full, group=mesh_group(mesh, mesh_dim), group_src=src_data_rank)
    layout = Layout(mesh, normalized, tuple(tensor.shape), global_stride_like(tensor, tuple(tensor.shape)))
    local = slice_for_layout(full, layout)
    if local.untyped_storage().data_ptr() in (
        full.untyped_storage().data_ptr(),
        tensor.untyped_storage().data_ptr(),
    ):
        local = local.clone()  # own storage: do not keep the full tensor alive or alias the caller's
    return DTensor(local, layout, requires_grad=tensor.requires_grad)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
    output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
) -> nn.Module:
    """Turn ``module``'s parameters and buffers into DTensors and hook its inputs and outputs.

    ``partition_fn(name, submodule, mesh)`` is called for every submodule and
    may replace parameters with sharded ones; whatever is still a plain tensor
    afterwards is replicated. ``input_fn(module, inputs, mesh)`` and
    ``output_fn(module, outputs, mesh)`` become forward pre- and post-hooks
    (returning None keeps the value).
    """
    what = "distribute_module"
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{what}: module must be a torch.nn.Module, got {type(module).__name__} {_short(module)}."
        )
    mesh = _check_mesh(device_mesh, what)
    for name, fn in (("partition_fn", partition_fn), ("input_fn", input_fn), ("output_fn", output_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{what}: {name} must be a callable or None, got {type(fn).__name__} {_short(fn)}; "
                f"see distribute_module's docstring for the signature of {name}."
            )
    # Replicating the parameters broadcasts them: agree on the module first ([Note: cross-rank
    # agreement] in hp_core.agreement); partition_fn's own distribute_tensor calls check theirs.
    agree_over_mesh(
        what,
        mesh,
        "build the same module on every rank of the mesh before distributing it, and pass the same "
        "functions.",
        {
            "parameters and buffers": describe(
                dict(itertools.chain(module.named_parameters(), module.named_buffers()))
            ),
            "functions": describe(tuple(fn is not None for fn in (partition_fn, input_fn, output_fn))),
        },
    )
    replicate = (Replicate(),) * mesh.ndim
    # A partition_fn that raises half-way must leave the module as it was (nothing half-applied).
    saved = [(sub, dict(sub._parameters), dict(sub._buffers)) for sub in module.modules()]
    try:
        for name, sub in module.named_modules():
            if partition_fn is not None:
                partition_fn(name, sub, mesh)
            for key, param in list(sub._parameters.items()):
                if param is not None and not isinstance(param, DTensor):
                    dt = _distribute(param.data, mesh, replicate, 0, what)
                    sub.register_parameter(key, nn.Parameter(dt, param.requires_grad))
            for key, buffer in list(sub._buffers.items()):
                if buffer is not None and not isinstance(buffer, DTensor):
                    sub._buffers[key] = _distribute(buffer, mesh, replicate, 0, what)
    except BaseException:
        for sub, parameters, buffers in saved:
            sub._parameters.clear()
            sub._parameters.update(parameters)
            sub._buffers.clear()
            sub._buffers.update(buffers)
        raise
    if input_fn is not None:
        fn_in = input_fn
        module.register_forward_pre_hook(lambda mod, inputs: fn_in(mod, inputs, mesh))
    if output_fn is not None:
        fn_out = output_fn
        module.register_forward_hook(lambda mod, inputs, outputs: fn_out(mod, outputs, mesh))
    return module

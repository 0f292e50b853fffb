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

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import hp_core.collectives as hc
import torch
from hp_core import DeviceMesh
from hp_core.distributed import mesh_group
from torch import nn

from hp_dtensor import checkpoint as _dcp
from hp_dtensor.layout import Layout, global_stride_like, normalize_placements
from hp_dtensor.placements import Partial, Placement, Replicate, Shard
from hp_dtensor.redistribute import redistribute_local, slice_for_layout

__all__ = ["DTensor", "distribute_module", "distribute_tensor", "new_dtensor"]


def _dispatch_not_ready(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError(
        "hp_dtensor: import hp_dtensor (not only hp_dtensor.dtensor) to register the op rules."
    )


# Set by hp_dtensor.ops.dispatch at import: one global lookup per op instead of an import statement.
_DISPATCH: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] = _dispatch_not_ready


def _check_mesh(mesh: Any, what: str) -> DeviceMesh:
    if isinstance(mesh, DeviceMesh):
        return mesh
    raise TypeError(
        f"{what}: device_mesh must be an hp_core.DeviceMesh, got "
        f"{type(mesh).__module__}.{type(mesh).__name__}; "
        "build one with hp_core.init_device_mesh(...) (a torch DeviceMesh converts with from_torch_dtensor)."
    )


_make_wrapper = torch.Tensor._make_wrapper_subclass


def new_dtensor(local: torch.Tensor, layout: Layout) -> DTensor:
    """A DTensor around ``local`` (no grad, no checks): the dispatcher's hot path skips ``__init__``."""
    out = _make_wrapper(DTensor, layout.shape, strides=layout.stride, dtype=local.dtype, device=local.device)
    out._local = local
    out._layout = layout
    return out


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
        return _dcp.write_items(self, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        """DCP load: this rank's box of the global tensor; only saved parts overlapping it are read."""
        return _dcp.chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """DCP save and load: the local tensor to write from or load into in place."""
        return _dcp.tensor_shard(self, index)

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
        and inconsistent shapes raise an error naming the ranks and sizes.
        """
        what = "DTensor.from_local"
        mesh = _check_mesh(device_mesh, what)
        if not isinstance(local, torch.Tensor) or isinstance(local, DTensor):
            raise TypeError(f"{what}: local must be a plain torch.Tensor, got {type(local).__name__}.")
        normalized = normalize_placements(placements, mesh, local.dim(), what)
        layout = _layout_for_local(local, mesh, normalized, shape, run_check, what)
        return _FromLocal.apply(local, layout)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece as a plain tensor (a view); differentiable.

        The gradient of the local tensor becomes a DTensor with this tensor's
        layout, or with ``grad_placements`` when given.
        """
        return _ToLocal.apply(self, grad_placements)

    def redistribute(
        self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None
    ) -> DTensor:
        """The same global tensor under ``placements`` (see :func:`hp_dtensor.explain_redistribute`)."""
        what = "DTensor.redistribute"
        if device_mesh is not None and _check_mesh(device_mesh, what) != self._layout.mesh:
            raise ValueError(
                f"{what}: device_mesh {device_mesh!r} differs from the tensor's mesh {self._layout.mesh!r}; "
                "redistribution moves data within one mesh. Use full_tensor() and distribute_tensor() to "
                "change meshes."
            )
        if placements is None:
            raise ValueError(f"{what}: pass placements=, e.g. [Replicate()] * {self._layout.mesh.ndim}.")
        layout = self._layout
        target = normalize_placements(placements, layout.mesh, layout.ndim, what)
        if target == layout.placements and layout.ragged is None:
            return self
        if self.requires_grad and torch.is_grad_enabled():
            return _Redistribute.apply(self, target)
        # Nothing to record for autograd: skip the Function machinery (a large share of the cost
        # of a small redistribution); the result is the same tensor _Redistribute.forward builds.
        local, out = redistribute_local(self._local, layout, target)
        return new_dtensor(local, out)

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank, as a plain tensor; differentiable.

        Right for uneven and ragged shards: gathers use the per-rank sizes of
        the layout.
        """
        replicated = self.redistribute(placements=[Replicate()] * self._layout.mesh.ndim)
        return replicated.to_local()


# -- layouts for from_local ---------------------------------------------------------------


def _gather_table(mesh: DeviceMesh, value: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every mesh coordinate's ``value``, in row-major coordinate order (one gather per mesh dim)."""
    data: Any = value
    with torch.profiler.record_function("hp_dtensor::from_local_gather_shapes"):  # not a hot path
        for mesh_dim in reversed(range(mesh.ndim)):
            data = hc.all_gather_object(data, mesh_group(mesh, mesh_dim))
    flat: list[tuple[int, ...]] = []

    def walk(node: Any, depth: int) -> None:
        if depth == mesh.ndim:
            flat.append(tuple(node))
            return
        for child in node:
            walk(child, depth + 1)

    walk(data, 0)
    return flat


def _layout_for_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: Sequence[int] | None,
    run_check: bool,
    what: str,
) -> Layout:
    if shape is None and not run_check:
        sizes = list(local.shape)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                sizes[placement.dim] *= mesh.size(mesh_dim)
        return Layout(mesh, placements, sizes, global_stride_like(local, sizes))
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if len(shape) != local.dim():
            raise ValueError(
                f"{what}: shape={shape} has {len(shape)} dims but the local tensor has {local.dim()} "
                f"(shape {tuple(local.shape)}); give the global shape with the same number of dims."
            )
        sharded = {p.dim for p in placements if isinstance(p, Shard)}
        for dim in range(local.dim()):
            if dim not in sharded and local.shape[dim] != shape[dim]:
                raise ValueError(
                    f"{what}: dim {dim} is not sharded, so the local size {local.shape[dim]} must equal "
                    f"shape[{dim}]={shape[dim]}; fix shape= or the placements {list(placements)}."
                )
        if not sharded:
            return Layout(mesh, placements, shape, global_stride_like(local, shape))
    table = _gather_table(mesh, tuple(local.shape))
    coords = list(itertools.product(*(range(n) for n in mesh.shape)))
    me = mesh.get_coordinate()
    assert me is not None
    global_shape = list(local.shape)
    for dim in range(local.dim()):
        sharding = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
        if sharding:
            global_shape[dim] = sum(
                table[i][dim]
                for i, c in enumerate(coords)
                if all(c[m] == me[m] for m in range(mesh.ndim) if m not in sharding)
            )
    if shape is not None and tuple(global_shape) != shape:
        raise ValueError(
            f"{what}: the ranks' local shapes {dict(zip(coords, table, strict=True))} add up to "
            f"{tuple(global_shape)}, not shape={shape}; pass the true global shape."
        )
    # Consistency: every line of every sharded dim adds up, unsharded dims agree.
    for i, c in enumerate(coords):
        for dim in range(local.dim()):
            sharding = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
            if not sharding:
                if table[i][dim] != global_shape[dim]:
                    raise ValueError(
                        f"{what}: rank at mesh coordinate {c} has local shape {table[i]} but this rank has "
                        f"{tuple(local.shape)}; dim {dim} is not sharded, so every rank must have size "
                        f"{global_shape[dim]} there. Fix the local tensors or the placements."
                    )
                continue
            total = sum(
                table[j][dim]
                for j, o in enumerate(coords)
                if all(o[m] == c[m] for m in range(mesh.ndim) if m not in sharding)
            )
            if total != global_shape[dim]:
                raise ValueError(
                    f"{what}: the shards of dim {dim} through mesh coordinate {c} add up to {total}, but "
                    f"elsewhere to {global_shape[dim]}; local shapes per coordinate: "
                    f"{dict(zip(coords, table, strict=True))}."
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
    def forward(ctx: Any, dt: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.layout = dt._layout
        local, layout = redistribute_local(dt._local, dt._layout, placements)
        return DTensor(local, layout)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        src: Layout = ctx.layout
        if not isinstance(grad, DTensor):
            return grad, None
        placements = [Replicate() if isinstance(p, Partial) else p for p in src.placements]
        if src.ragged is not None:
            target: Layout | list[Placement] = Layout(
                src.mesh, placements, src.shape, src.stride, ragged=src.ragged
            )
        else:
            target = placements
        local, layout = redistribute_local(grad._local, grad._layout, target)
        return DTensor(local, layout), None


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
    if isinstance(tensor, DTensor):
        raise TypeError(f"{what}: tensor is already a DTensor; use .redistribute(placements=...) instead.")
    normalized = normalize_placements(placements, mesh, tensor.dim(), what)
    if src_data_rank is not None:
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
    mesh = _check_mesh(device_mesh, "distribute_module")
    replicate = [Replicate()] * mesh.ndim
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        for key, param in list(sub._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                sub.register_parameter(
                    key, nn.Parameter(distribute_tensor(param.data, mesh, replicate), param.requires_grad)
                )
        for key, buffer in list(sub._buffers.items()):
            if buffer is not None and not isinstance(buffer, DTensor):
                sub._buffers[key] = distribute_tensor(buffer, mesh, replicate)
    if input_fn is not None:
        fn_in = input_fn
        module.register_forward_pre_hook(lambda mod, inputs: fn_in(mod, inputs, mesh))
    if output_fn is not None:
        fn_out = output_fn
        module.register_forward_hook(lambda mod, inputs, outputs: fn_out(mod, outputs, mesh))
    return module

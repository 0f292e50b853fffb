"""One managed parameter: its sharded DTensor, its padded shard slot, its gathered form.

A parameter is cut like ``torch.chunk`` and padded inside the collectives
([Note: padded shards]); its gathered buffer is allocated once and only
resized ([Note: stable unsharded views]); the module holds the shard or the
gathered tensor by turns ([Note: the registered parameter]); a parameter TP
already sharded is managed through its TP-local tensor ([Note: FSDP x TP]).
The notes sit next to the code they explain.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hp_core import DeviceMesh
from hp_dtensor import DTensor, Layout, Placement, Replicate, Shard, chunk_sizes, local_tensor, new_dtensor
from torch import nn

from hp_fsdp.tp_layout import combined_layout, tp_layout_of

__all__ = ["FSDPParam", "ParamInfo"]


class ParamInfo:
    """Where a parameter lives in the module tree: the owning module and attribute name."""

    __slots__ = ("fqn", "module", "name")

    def __init__(self, module: nn.Module, name: str, fqn: str) -> None:
        self.module = module
        self.name = name
        self.fqn = fqn


def _set_module_param(info: ParamInfo, value: nn.Parameter) -> None:
    """Register ``value`` under the attribute without nn.Module's type checks or hooks (fast path)."""
    info.module._parameters[info.name] = value


# [Note: padded shards]
# A parameter of size ``d`` along its shard dim is cut like ``torch.chunk`` over
# ``W`` ranks: chunks of ``c = ceil(d / W)`` rows, the trailing ranks holding
# fewer rows or none. Collectives need equal sizes, so every rank contributes a
# *padded* chunk of exactly ``c`` rows (zeros past its real rows). For shard
# dim 0 the ``W`` padded chunks laid end to end are the global rows followed by
# the padding, so the gathered parameter is simply the first ``numel`` elements
# of the gathered buffer: a view, no copy. Other shard dims need one copy to
# interleave the chunks (see :meth:`FSDPParam.finish_copy_out`).
#
# [Note: FSDP x TP]
# A parameter that is already an ``hp_dtensor.DTensor`` over a 1-D tensor-parallel
# mesh (from ``parallelize_module``) is managed through its *TP-local* tensor:
# everything above (chunking, padding, gathering, reduce-scatter) treats the
# local tensor as "the parameter". The gathered form registered on the module
# is that tensor wrapped again as a DTensor with the TP layout, so the TP
# forward hooks and DTensor ops see what they saw before ``fully_shard``.
#
# The sharded form is a DTensor over the combined mesh of the data-parallel
# dims and the TP dim, with a layout that is exact for what each rank holds:
#
# * the TP placement shards another tensor dim than FSDP (row-wise weights) or
#   replicates: the mesh is ``(*dp_dims, tp)`` with placements
#   ``(*dp_placements, tp_placement)``, e.g. ``(Shard(0), Shard(1))``;
# * the TP placement shards the same dim as FSDP (column-wise weight and
#   bias): FSDP cuts the TP-local rows again, so rank ``(dp=i, tp=j)`` holds
#   rows starting at ``offset_tp(j) + offset_dp(i)`` -- TP-major, which is
#   what torch's ``_StridedShard`` expresses. hp_dtensor orders nested shards
#   of one dim by mesh dim, so the mesh is ordered with the TP dim *before*
#   the FSDP shard dim, e.g. ``("tp", "dp")`` with ``(Shard(0), Shard(0))``.
#
# Uneven sizes are recorded in the layout's ragged table (computed locally,
# no communication), so ``full_tensor()``, redistribution and DCP offsets are
# exact.


class FSDPParam:
    """The state of one parameter managed by a unit.

    ``replicate=True`` makes it a DDP-style parameter: held whole on every rank
    (``Replicate()`` on every mesh dim) and all-reduced after backward.
    """

    sharded_param: nn.Parameter
    unsharded_param: nn.Parameter | None

    def __init__(
        self,
        param: nn.Parameter,
        infos: list[ParamInfo],
        mesh: DeviceMesh,
        shard_dim: int,
        *,
        replicate: bool,
        device: torch.device,
        offload: bool,
        pin_memory: bool,
    ) -> None:
        self.infos = infos  # a shared (tied) parameter has several owners
        self.orig_param_id = id(param)  # to recognise the same Parameter still held by a parent module
        self.fqn = infos[0].fqn
        self.mesh = mesh
        self.replicate = replicate
        self.device = device
        self.offload = offload
        self.pin_memory = pin_memory
        self.shard_dim = shard_dim
        self.orig_dtype = param.dtype
        # TP parameters: FSDP works on the TP-local tensor, see [Note: FSDP x TP]
        self.tp_layout: Layout | None = tp_layout_of(param, self.fqn)
        self.global_shape = tuple(param.shape)
        local_param: torch.Tensor = param
        if self.tp_layout is not None:
            dt = param if isinstance(param, DTensor) else param.data
            assert isinstance(dt, DTensor)  # tp_layout_of found the layout on one of them
            local_param = local_tensor(dt)
        self.shape = tuple(local_param.shape)
        self.numel = local_param.numel()
        shard_mesh_dim = mesh.ndim - 1
        self.world = 1 if replicate else mesh.size(shard_mesh_dim)
        self.shard_rank = 0 if replicate else mesh.get_local_rank(shard_mesh_dim)
        if replicate:
            self.placements: tuple[Placement, ...] = (Replicate(),) * mesh.ndim
            self.padded_shape = self.shape
            self.local_rows = self.shape[shard_dim] if self.shape else 1
        else:
            rows = chunk_sizes(self.shape[shard_dim], self.world)
            self.placements = (*([Replicate()] * (mesh.ndim - 1)), Shard(shard_dim))
            padded = list(self.shape)
            padded[shard_dim] = -(-self.shape[shard_dim] // self.world)
            self.padded_shape = tuple(padded)
            self.local_rows = rows[self.shard_rank]
        self.padded_numel = math.prod(self.padded_shape)
        if self.tp_layout is None:
            self.layout = Layout(mesh, self.placements, self.shape)
        else:
            self.layout = combined_layout(self.tp_layout, mesh, self.placements, self.world)
            self.placements = self.layout.placements
        self.unsharded_param = None
        self._requires_grad_seen = param.requires_grad  # see [Note: requires_grad follows the user]
        self._unsharded_buffer: torch.Tensor | None = None  # see [Note: stable unsharded views]
        self._unsharded_view_buffer: torch.Tensor | None = None  # dim != 0: the assembled tensor
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        # reshard_after_forward=N: this rank's 1/N of the gathered buffer, kept from forward to backward
        self.post_forward_data: torch.Tensor | None = None
        self._init_sharded(local_param.detach(), requires_grad=param.requires_grad)

    # -- sharded state ------------------------------------------------------------------

    def _local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full`` (the TP-local tensor for TP params, the parameter otherwise)."""
        if self.replicate:
            return full
        start = min(self.shard_rank * self.padded_shape[self.shard_dim], self.shape[self.shard_dim])
        return full.narrow(self.shard_dim, start, self.local_rows)

    @property
    def home_device(self) -> torch.device:
        """Where the shard lives: the CPU with offload, else the platform device."""
        return torch.device("cpu") if self.offload else self.device

    def _init_sharded(self, full: torch.Tensor, *, requires_grad: bool) -> None:
        local = self._local_from_full(full)
        target = full.device if full.is_meta else self.home_device  # meta stays meta, offload or not
        local = local.to(target).clone(memory_format=torch.contiguous_format)
        self._wrap_local(local, requires_grad=requires_grad)

    def _wrap_local(self, local: torch.Tensor, *, requires_grad: bool) -> None:
        if self.offload and self.pin_memory and _can_pin(local):
            local = local.pin_memory()
        self.sharded_param = nn.Parameter(new_dtensor(local, self.layout), requires_grad=requires_grad)
        for info in self.infos:
            _set_module_param(info, self.sharded_param)

    def adopt_registered(self) -> None:
        """Re-read the shard after something outside hp_fsdp replaced or swapped it.

        ``nn.Module._apply`` (``to_empty``, ``.to``) swaps the contents of
        DTensor parameters in place (or registers a new Parameter), and
        ``load_state_dict(assign=True)`` registers the state dict's value (a
        new Parameter) on the owning module (see [Note: loading with
        assign=True]). An owner whose registered parameter is no longer
        :attr:`sharded_param` holds the new shard (else the first owner's
        holds it, swapped in place); every other owner of a tied parameter is
        pointed at it.
        """
        registered = [info.module._parameters.get(info.name) for info in self.infos]
        current = next(
            (r for r in registered if r is not None and r is not self.sharded_param), registered[0]
        )
        if current is None:
            return
        self.orig_dtype = current.dtype  # .to(dtype) changes what gradients are cast back to
        if isinstance(current, DTensor) and current.layout_spec == self.layout:
            local = local_tensor(current)
            if self.offload and self.pin_memory and _can_pin(local):
                self._wrap_local(local, requires_grad=current.requires_grad)
                return
            self.sharded_param = current
            for info in self.infos:
                _set_module_param(info, current)
            return
        source = local_tensor(current) if isinstance(current, DTensor) else current  # TP meta-init
        self._wrap_local(
            self._local_from_full(source.detach()).contiguous(), requires_grad=current.requires_grad
        )

    def assign_problem(self, key: str, value: Any) -> str | None:
        """Why ``value`` cannot become this parameter under ``load_state_dict(assign=True)``, or None.

        [Note: loading with assign=True]
        ``load_state_dict(sd, assign=True)`` registers each value as the
        parameter itself instead of copying it into the existing one (FSDP2's
        meta-device recipe: ``fully_shard`` on meta, then load a sharded state
        dict with ``assign=True``). The registered parameter of a unit is its
        shard, so the value must be that shard: an ``hp_dtensor.DTensor`` with
        this parameter's layout (mesh, placements, global shape), its local
        tensor on the shard's device. As in FSDP2, nothing else is accepted: a
        full tensor would have to be cut and a DTensor of another sharding
        redistributed, which makes new tensors instead of assigning the given
        ones (and a cut view would keep the whole full tensor alive). Those
        values load without ``assign`` (after ``to_empty`` for a meta-device
        model), which copies them into the shards.
        After the load a post-hook makes the assigned Parameter the shard
        (:meth:`adopt_registered`), as FSDP2's ``reset_sharded_param`` does.
        """
        if not isinstance(value, DTensor):
            return (
                f"{key!r} is a plain {type(value).__name__} of shape {tuple(value.shape)}, "
                f"not a DTensor with placements {self.layout.placements} on {self.layout.mesh}"
            )
        spec = value.layout_spec
        if spec != self.layout:
            return (
                f"{key!r} is a DTensor with placements {spec.placements} on {spec.mesh}, the "
                f"parameter's are {self.layout.placements} on {self.layout.mesh}"
            )
        device = local_tensor(value).device
        home = self.home_device
        if device.type != home.type or (
            device.index is not None and home.index is not None and device.index != home.index
        ):
            return f"{key!r} holds its shard on {device}, the parameter's shard lives on {home}"
        return None

    def load_full_or_sharded(self, value: torch.Tensor) -> torch.Tensor:
        """A state-dict value as a DTensor with this parameter's layout, without communication when possible.

        A plain tensor of the full shape is cut locally; a DTensor is
        redistributed to this layout if its placements differ.
        """
        if isinstance(value, DTensor):
            if value.layout_spec == self.layout:
                return value
            if value.device_mesh == self.layout.mesh:
                return value.redistribute(placements=self.placements)
            value = value.full_tensor()  # another mesh (e.g. a TP-only model): gather, then cut
        if tuple(value.shape) != self.global_shape:
            return value  # let nn.Module report the shape mismatch with its usual message
        if self.tp_layout is not None:
            offsets, sizes = self.layout.local_offset(), self.layout.local_shape()
            local = value.detach()
            for dim, (start, size) in enumerate(zip(offsets, sizes, strict=True)):
                local = local.narrow(dim, start, size)
            return new_dtensor(local.to(self.local_shard().device).contiguous(), self.layout)
        local = self._local_from_full(value.detach())
        return new_dtensor(local.to(self.local_shard().device), self.layout)

    def local_shard(self) -> torch.Tensor:
        """This rank's unpadded shard (a plain tensor sharing the parameter's storage).

        Read with :func:`hp_dtensor.local_tensor`, an attribute read: going
        through ``.data`` would dispatch a ``detach`` through hp_dtensor for
        every parameter on every all-gather (about 3% of a small model's step
        in ``benchmarks/fsdp_step.py``), and ``to_local()`` runs an autograd
        Function. The local tensor of a Parameter never requires grad, so
        copying from it records nothing for autograd.
        """
        local = local_tensor(self.sharded_param)  # type: ignore[arg-type]  # the Parameter is a DTensor
        return local.detach() if local.requires_grad else local

    # -- gathered state -----------------------------------------------------------------

    @property
    def gathered_numel(self) -> int:
        """Elements of the padded gathered buffer: ``world`` padded chunks."""
        return self.world * self.padded_numel

    # [Note: stable unsharded views]
    # Autograd saves the gathered parameters that forward ops use (a linear saves
    # its weight). When a unit reshards after forward we free the *storage* of the
    # gathered buffer (``untyped_storage().resize_(0)``) but keep the tensor objects;
    # before backward the storage is re-allocated and refilled in place, so every
    # view autograd saved sees the right values again. This is why the gathered
    # buffer of a parameter is allocated once and then only resized.

    def alloc_unsharded(self, dtype: torch.dtype) -> torch.Tensor:
        """The flat gathered buffer, (re)allocated in place; see [Note: stable unsharded views]."""
        buffer = self._unsharded_buffer
        if buffer is None or buffer.dtype != dtype:
            buffer = torch.empty(self.gathered_numel, dtype=dtype, device=self.device)
            self._unsharded_buffer = buffer
            self.unsharded_param = None
            self._unsharded_view_buffer = None
        else:
            storage = buffer.untyped_storage()
            nbytes = self.gathered_numel * buffer.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
        if self.shard_dim != 0 and not self.replicate:
            view_buffer = self._unsharded_view_buffer
            if view_buffer is None:
                self._unsharded_view_buffer = torch.empty(self.shape, dtype=dtype, device=self.device)
            else:
                storage = view_buffer.untyped_storage()
                nbytes = self.numel * view_buffer.element_size()
                if storage.size() != nbytes:
                    storage.resize_(nbytes)
        return buffer

    def copy_in(self, slot: torch.Tensor) -> None:
        """Write this rank's shard into ``slot`` (flat, padded_numel), casting and zero-padding."""
        local = self.local_shard()
        if self.replicate or self.local_rows == self.padded_shape[self.shard_dim]:
            slot.view(self.padded_shape).copy_(local)
            return
        shaped = slot.view(self.padded_shape)
        shaped.zero_()
        if self.local_rows:
            shaped.narrow(self.shard_dim, 0, self.local_rows).copy_(local)

    def slot(self, rank: int, numel: int) -> torch.Tensor:
        """Slot ``rank`` of ``numel`` elements inside the gathered buffer (an all-gather input, aliased)."""
        assert self._unsharded_buffer is not None
        return self._unsharded_buffer[rank * numel : (rank + 1) * numel]

    def keep_post_forward(self, size: int, rank: int) -> None:
        """Keep this rank's piece of the gathered buffer for a group of ``size`` ranks.

        The piece is padded chunks ``rank * world/size`` to ``(rank + 1) *
        world/size - 1``, contiguous in the flat buffer (see [Note: reshard to
        groups of N ranks] in :mod:`hp_fsdp.post_forward`). It is a copy, so
        the gathered buffer can be freed.
        """
        per = self.world // size
        numel = per * self.padded_numel
        if self.shard_dim == 0:
            self.post_forward_data = self.slot(rank, numel).clone()
            return
        # Other shard dims: finish_copy_out released the flat buffer once it had assembled the
        # parameter, so cut the padded chunks out of the assembled tensor again.
        full = self._unsharded_view_buffer
        assert full is not None
        piece = torch.empty(numel, dtype=full.dtype, device=full.device)
        chunks = piece.view(per, *self.padded_shape)
        step = self.padded_shape[self.shard_dim]
        size_dim = self.shape[self.shard_dim]
        for index in range(per):
            start = (rank * per + index) * step
            rows = max(0, min(step, size_dim - start))
            if rows < step:
                chunks[index].zero_()
            if rows:
                chunks[index].narrow(self.shard_dim, 0, rows).copy_(full.narrow(self.shard_dim, start, rows))
        self.post_forward_data = piece

    def copy_in_post_forward(self, slot: torch.Tensor) -> None:
        """Write the kept piece into ``slot`` (the backward all-gather's input) and drop it."""
        assert self.post_forward_data is not None
        slot.copy_(self.post_forward_data)
        self.post_forward_data = None

    def finish_copy_out(self) -> None:
        """Make the gathered values visible as the unsharded parameter (a view for shard dim 0)."""
        buffer = self._unsharded_buffer
        assert buffer is not None
        if self.shard_dim != 0 and not self.replicate:
            view_buffer = self._unsharded_view_buffer
            assert view_buffer is not None
            chunks = buffer.view(self.world, *self.padded_shape)
            merged = chunks.movedim(0, self.shard_dim)
            sizes = list(self.padded_shape)
            sizes[self.shard_dim] *= self.world
            merged = merged.reshape(sizes).narrow(self.shard_dim, 0, self.shape[self.shard_dim])
            with torch.autograd._unsafe_preserve_version_counter(view_buffer):
                view_buffer.copy_(merged)
            buffer.untyped_storage().resize_(0)  # the assembled copy is the parameter now
        if self.unsharded_param is None:
            if self.shard_dim != 0 and not self.replicate:
                assert self._unsharded_view_buffer is not None
                data = self._unsharded_view_buffer
            else:
                data = buffer[: self.numel].view(self.shape)
            if self.tp_layout is not None:
                data = new_dtensor(data, self.tp_layout)
            flag = self.sharded_param.requires_grad
            self.unsharded_param = nn.Parameter(data, requires_grad=flag)
            self._requires_grad_seen = flag
        else:
            self.sync_requires_grad()

    def sync_requires_grad(self) -> None:
        """Make the sharded and the gathered parameter agree on the ``requires_grad`` the user set last.

        [Note: requires_grad follows the user]
        The user freezes or unfreezes the parameter they see between steps,
        possibly after ``fully_shard``: usually the sharded one, but while a
        unit stays gathered (the root after a forward without grad) the
        module and ``named_parameters()`` show the gathered one. Autograd
        decides from the gathered parameter the module computes with, and
        the optimizer and ``_check_gradients_arrived`` read the sharded one.
        So at every gather, at every forward (the unit may still be gathered
        from before) and at every reshard the flag one of them changed since
        the last agreement (``_requires_grad_seen``) is copied to the other;
        when both changed, the shard's wins. FSDP2 copies the shard's flag at
        each unshard only. A frozen parameter then gets no gradient: nothing
        is accumulated for it, it adds zeros to its unit's reduction on every
        rank alike (the flag is the same on every rank when every rank sets
        it), and its ``.grad`` stays unset, so the optimizer skips it.
        """
        full = self.unsharded_param
        if full is None:
            return
        sharded = self.sharded_param
        seen = self._requires_grad_seen
        if sharded.requires_grad != seen:
            flag = sharded.requires_grad
        elif full.requires_grad != seen:
            flag = full.requires_grad
        else:
            return
        if sharded.requires_grad != flag:
            sharded.requires_grad_(flag)
        if full.requires_grad != flag:
            full.requires_grad_(flag)
        self._requires_grad_seen = flag

    def free_unsharded(self) -> None:
        """Release the gathered storage; the tensor objects stay for the saved views."""
        for buffer in (self._unsharded_buffer, self._unsharded_view_buffer):
            if buffer is not None and buffer.untyped_storage().size() != 0:
                buffer.untyped_storage().resize_(0)

    def is_unsharded_allocated(self) -> bool:
        """Whether the gathered parameter currently has storage."""
        buffer = self._unsharded_view_buffer if self.shard_dim != 0 and not self.replicate else None
        buffer = buffer if buffer is not None else self._unsharded_buffer
        return buffer is not None and buffer.untyped_storage().size() != 0

    # [Note: the registered parameter]
    # Between iterations the module holds the sharded ``nn.Parameter`` (a DTensor),
    # so optimizers, ``state_dict()`` and ``named_parameters()`` see shards. While a
    # unit is gathered, the module attribute is swapped to a plain
    # ``nn.Parameter`` viewing the gathered buffer, so the module's forward runs on
    # ordinary tensors and autograd accumulates the full gradient there.

    def to_unsharded_module_param(self) -> None:
        """Point the owning modules at the gathered parameter (see [Note: the registered parameter])."""
        assert self.unsharded_param is not None
        for info in self.infos:
            _set_module_param(info, self.unsharded_param)

    def to_sharded_module_param(self) -> None:
        """Point the owning modules back at the sharded DTensor parameter (with the user's latest flag)."""
        self.sync_requires_grad()  # see [Note: requires_grad follows the user]
        for info in self.infos:
            _set_module_param(info, self.sharded_param)

    # -- gradients ----------------------------------------------------------------------

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The full gradient accumulated since the last reduction (and clear it from the param)."""
        grad: torch.Tensor | None = None
        full = self.unsharded_param
        if full is not None and full.grad is not None:
            grad = self._plain_grad(full.grad)
            full.grad = None
        if self.unsharded_accumulated_grad is not None:
            acc = self.unsharded_accumulated_grad
            self.unsharded_accumulated_grad = None
            grad = acc if grad is None else acc + grad.to(acc.dtype)
        return grad

    def stash_unsharded_grad(self, dtype: torch.dtype) -> None:
        """No-sync step: keep the full gradient (in the reduce dtype) for a later reduction."""
        if self.unsharded_param is None or self.unsharded_param.grad is None:
            return
        grad = self._plain_grad(self.unsharded_param.grad)
        self.unsharded_param.grad = None
        if self.unsharded_accumulated_grad is None:
            self.unsharded_accumulated_grad = grad.to(dtype) if grad.dtype != dtype else grad
        else:
            self.unsharded_accumulated_grad += grad.to(dtype)

    def _plain_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as a plain tensor of the gathered (TP-local) shape."""
        if not isinstance(grad, DTensor):
            return grad
        if self.tp_layout is not None and grad.layout_spec != self.tp_layout:
            grad = grad.redistribute(placements=self.tp_layout.placements)  # e.g. Partial -> Shard
        return local_tensor(grad)

    def accumulate_sharded_grad(self, local_grad: torch.Tensor, *, main_grad: bool) -> None:
        """Add the reduced local gradient to ``.grad`` (or the fp32 ``main_grad``)."""
        param = self.sharded_param
        if main_grad:
            target_dtype = torch.float32
            existing = getattr(param, "main_grad", None)
        else:
            target_dtype = self.orig_dtype
            existing = param.grad
        home = torch.device("cpu") if self.offload else local_grad.device
        local = local_grad.to(device=home, dtype=target_dtype)
        if existing is not None:
            existing_local = local_tensor(existing) if isinstance(existing, DTensor) else existing
            existing_local.add_(local)
            return
        if not local.is_contiguous():
            local = local.contiguous()  # shard dims other than 0: DTensor locals are contiguous
        # A contiguous piece stays a view of the unit's reduce output (as torch's FSDP2 does): a copy
        # would hold the output and the copies (2/W of the unit) at once.
        grad = new_dtensor(local, self.layout)
        if main_grad:
            param.main_grad = grad  # type: ignore[attr-defined]
        else:
            param.grad = grad

    def __repr__(self) -> str:
        kind = "replicate" if self.replicate else f"Shard({self.shard_dim})"
        return f"FSDPParam({self.fqn}, shape={self.shape}, {kind})"


def _can_pin(tensor: torch.Tensor) -> bool:
    """Pinning needs an accelerator runtime; on a CPU-only platform it is skipped (see CPUOffloadPolicy)."""
    from hp_core import get_platform

    if tensor.device.type != "cpu" or tensor.is_pinned():
        return False
    try:
        # Where tensors really live, not the device type code branches on: under
        # NCCL/HCCL emulation the platform says "cuda" while tensors stay on CPU.
        return get_platform().handle.is_accelerator
    except Exception:
        return False

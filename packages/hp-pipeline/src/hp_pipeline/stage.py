"""``PipelineStage``: one model chunk, the tensors it keeps between its steps, and its arithmetic.

A stage runs the compute steps of a schedule for one chunk of the model:
``F`` (forward of a micro-batch), ``B`` (full backward), and the split
backward of the zero-bubble schedules, ``I`` (input gradient only) and ``W``
(weight gradient only). It knows nothing about other ranks; the executor
(:mod:`hp_pipeline.executor`) moves tensors between stages and calls these
methods in the order a schedule prescribes.

Details: [Note: tensor metadata], [Note: what crosses a stage boundary],
[Note: split backward].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_pipeline._torch_api import as_process_group
from hp_pipeline.boundary import DTensorMeta, MeshFinder, dtensor_meta, is_dtensor, local_of, rebuild

# [Note: what crosses a stage boundary]
# A stage's forward returns a tensor or a tuple/list of tensors; all of them go
# to the next stage as its positional arguments. Floating-point (and complex)
# outputs that require grad get a gradient back in the backward; every other
# tensor (token ids, integer masks, float tensors computed without parameters)
# is passed through and gets none. Both sides decide this from the metadata, so
# they always agree on how many gradients travel back.


GetMesh = Callable[[tuple[str, ...], Any], Any]
"""torch's ``GetMeshCallback``: ``(mesh_dim_names, mesh_layout) -> DeviceMesh``."""

__all__ = ["PipelineStage", "TensorMeta"]


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient travels back: what a receiver needs to allocate."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    # A DTensor's: shape and dtype are then its shard's ([Note: DTensors across stages]).
    dtensor: DTensorMeta | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        grad = bool(tensor.requires_grad and _differentiable(tensor))
        if is_dtensor(tensor):
            local = local_of(tensor)
            return cls(tuple(local.shape), local.dtype, grad, dtensor_meta(tensor))
        return cls(tuple(tensor.shape), tensor.dtype, grad)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def zeros(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def __str__(self) -> str:
        grad = ", grad" if self.requires_grad else ""
        whole = "" if self.dtensor is None else f" (shard of {self.dtensor})"
        return f"{list(self.shape)} {str(self.dtype).replace('torch.', '')}{grad}{whole}"


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _flatten_outputs(stage_index: int, out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    kinds = type(out).__name__ if not isinstance(out, (tuple, list)) else [type(t).__name__ for t in out]
    raise TypeError(
        f"stage {stage_index}'s forward returned {kinds}; a pipeline stage must return a tensor or a "
        "tuple/list of tensors (they become the next stage's positional arguments)"
    )


def _as_device(device: object) -> torch.device:
    """``device`` as a ``torch.device``, or an error naming the value and the accepted forms."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, (str, int)) and not isinstance(device, bool):
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as exc:
            cause: Exception | None = exc
    else:
        cause = None
    raise ValueError(
        f"PipelineStage: device={device!r} is not a device; pass a torch.device, a string such as "
        "'cpu' or 'cuda:0', or None for hp_core.get_platform().device()"
    ) from cause


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    return type(out)(t.detach() for t in out)


@dataclass
class _MicroState:
    """What one micro-batch leaves on a stage between its forward and its backward."""

    inputs: tuple[torch.Tensor, ...] = ()
    outputs: tuple[torch.Tensor, ...] = ()
    raw_output: Any = None
    loss: torch.Tensor | None = None
    output_grads: tuple[torch.Tensor | None, ...] | None = None
    input_grads: tuple[torch.Tensor | None, ...] | None = None
    roots: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # kept from I for W


# [Note: tensor metadata]
# A receiving rank must allocate its buffer before the data arrives, so it has
# to know the shape and dtype of every tensor a peer will send. These are
# exchanged once, on the first step of a schedule, as small objects sent ahead
# of the tensors (:class:`TensorMeta`, one per tensor and micro-batch, so uneven
# micro-batches work), and cached on the stage. Later steps post receives
# straight into freshly allocated buffers of the cached shape; a stage whose
# output shape changes raises a clear error instead of corrupting its peer.


# [Note: split backward]
# ``I`` computes only the gradient of the stage's inputs with
# ``torch.autograd.grad(..., retain_graph=True)``; ``W`` then runs
# ``torch.autograd.backward(..., inputs=parameters)``, which accumulates only
# parameter gradients and frees the graph. ``W`` re-traverses the part of the
# graph that ``I`` walked; that costs some arithmetic, but it needs no
# cooperation from the modules and keeps exactly the numerics of a full
# backward, and ``I`` still comes first on the critical path, which is the point
# of the zero-bubble schedules.


class PipelineStage:
    """One chunk of the model, placed as stage ``stage_index`` of ``num_stages``.

    Args:
        submodule: the chunk (torch's name for it). Its forward takes the
            previous stage's outputs as positional arguments (stage 0: the
            micro-batch's ``args`` and ``kwargs``) and returns a tensor or a
            tuple/list of tensors.
        stage_index: ``0 .. num_stages-1``.
        num_stages: stages of the whole pipeline (``v * p`` for interleaved).
        device: where receive buffers are allocated. Defaults to
            ``hp_core.get_platform().device()``, never to the module's device,
            so a module built on ``meta`` still gets real buffers (materialise
            its parameters, e.g. with ``to_empty``, before the first step).
        group: the pipeline process group; ``None`` for the default group. A
            1-D ``DeviceMesh`` (ours or torch's) stands for its own group
            ([Note: meshes as groups] in :mod:`hp_pipeline._torch_api`).
        get_mesh: torch's ``GetMeshCallback``: ``get_mesh(mesh_dim_names,
            mesh_layout)`` returns the mesh on which a DTensor received from a
            neighbour stage is rebuilt, when no DTensor of this stage's module
            (its parameters, buffers, inputs or outputs) lies on a mesh with
            those dim names already ([Note: DTensors across stages] in
            :mod:`hp_pipeline.boundary`).

    torch's other arguments (``input_args``, ``output_args``,
    ``output_grads``, ``input_grads``, ``dw_builder``) are not taken: shapes
    are always learned on the first step (example tensors would not be
    checked against them) and the split backward is autograd's own (no
    ``dw_builder``). The package README lists the differences from torch.

    Shapes and dtypes of the tensors a stage receives are learned on the first
    step and cached (see [Note: tensor metadata]).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | Any | None = None,
        get_mesh: GetMesh | None = None,
    ) -> None:
        # Every argument is checked before any attribute is set: a refused stage is not half-built.
        if not isinstance(submodule, nn.Module):
            raise TypeError(
                f"PipelineStage: submodule is a {type(submodule).__name__}, not an nn.Module; wrap a "
                "function in a module (e.g. a small nn.Module subclass whose forward calls it)"
            )
        for name, value in (("num_stages", num_stages), ("stage_index", stage_index)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"PipelineStage: {name}={value!r} is a {type(value).__name__}, not an int; pass an int"
                )
        if num_stages < 1:
            raise ValueError(f"PipelineStage: num_stages must be an int >= 1, got {num_stages!r}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(
                f"PipelineStage: stage_index must be in 0 .. {num_stages - 1} (num_stages={num_stages}), "
                f"got {stage_index!r}"
            )
        resolved = None if device is None else _as_device(device)
        if resolved is not None and resolved.type == "meta":
            raise ValueError(
                "PipelineStage: device='meta' cannot hold received activations; pass the device the "
                "stage computes on (or leave it None to use hp_core.get_platform().device())"
            )
        group = as_process_group("PipelineStage", group)
        if get_mesh is not None and not callable(get_mesh):
            raise TypeError(
                f"PipelineStage: get_mesh={get_mesh!r} is a {type(get_mesh).__name__}, not a callable; pass "
                "torch's GetMeshCallback, a function (mesh_dim_names, mesh_layout) -> DeviceMesh, or None"
            )
        self.submod = submodule
        self.get_mesh = get_mesh
        self._meshes = MeshFinder(stage_index, get_mesh)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self._device = resolved
        self.group = group
        # [Note: tensor metadata]: micro-batch -> metadata of that micro's inputs / outputs.
        self.inputs_meta: dict[int, tuple[TensorMeta, ...]] = {}
        self.outputs_meta: dict[int, tuple[TensorMeta, ...]] = {}
        self._micro: dict[int, _MicroState] = {}
        # Results of the last step on the last stage, kept after the step's state is freed.
        self._last_outputs: dict[int, Any] = {}
        self._last_losses: dict[int, torch.Tensor] = {}

    # -- identity ---------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def device(self) -> torch.device:
        """The real device receive buffers go to (resolved lazily: the platform may be set late)."""
        if self._device is None:
            from hp_core import get_platform

            self._device = get_platform().device()
        return self._device

    def __repr__(self) -> str:
        return f"PipelineStage({type(self.submod).__name__}, stage {self.stage_index} of {self.num_stages})"

    def _check_materialized(self) -> None:
        for name, tensor in [*self.submod.named_parameters(), *self.submod.named_buffers()]:
            if tensor.is_meta:
                raise RuntimeError(
                    f"stage {self.stage_index}: {name} is still on the meta device; materialise the "
                    f"module first, e.g. module.to_empty(device={str(self.device)!r}) and then "
                    "initialise or load its weights"
                )

    # -- per-step state ---------------------------------------------------------

    def _clear(self) -> None:
        self._micro.clear()

    def _begin_step(self) -> None:
        self._micro.clear()
        self._last_outputs.clear()
        self._last_losses.clear()

    def _state(self, micro: int) -> _MicroState:
        state = self._micro.get(micro)
        if state is None:
            state = self._micro[micro] = _MicroState()
        return state

    def _received_inputs(self, micro: int, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Make received (or locally handed-off) tensors leaves that collect their gradient."""
        metas = self.inputs_meta[micro]
        out = []
        for tensor, meta in zip(tensors, metas, strict=True):
            if meta.dtensor is not None and not is_dtensor(tensor):  # [Note: DTensors across stages]
                tensor = rebuild(tensor.detach(), meta.dtensor, self._meshes.find(meta.dtensor, self.submod))
            leaf = tensor.detach()
            if meta.requires_grad:
                leaf.requires_grad_(True)
            out.append(leaf)
        return tuple(out)

    # -- compute steps ----------------------------------------------------------

    def forward_one_chunk(
        self,
        micro: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        *,
        keep_for_backward: bool,
    ) -> tuple[torch.Tensor, ...]:
        """``F``: run the module on one micro-batch; returns the flattened outputs."""
        if not self.is_first:
            args = self._received_inputs(micro, args)
        out = self.submod(*args, **(kwargs or {}))
        outputs = _flatten_outputs(self.stage_index, out)
        self._meshes.remember(outputs)
        state = self._state(micro)
        if keep_for_backward:
            state.inputs = tuple(a for a in args if isinstance(a, torch.Tensor))
            state.outputs = outputs
        if self.is_last:
            state.raw_output = out
            self._last_outputs[micro] = _detached(out)
        return outputs

    def compute_loss(self, micro: int, loss_fn: Any, target: Any) -> torch.Tensor:
        """Apply ``loss_fn(output, target)`` to the last stage's output of ``micro``."""
        state = self._state(micro)
        loss = loss_fn(state.raw_output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn returned {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + "; it must return a scalar tensor (reduce with mean or sum)"
            )
        state.loss = loss
        self._last_losses[micro] = loss.detach()
        return loss

    def _roots(self, micro: int, scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors backward starts from, and the gradients seeded into them."""
        state = self._micro[micro]
        if state.roots is not None:
            return state.roots
        if self.is_last:
            if state.loss is None:
                raise RuntimeError(f"stage {self.stage_index}: backward of micro-batch {micro} has no loss")
            return [state.loss], [torch.full_like(state.loss, scale)]
        if state.output_grads is None:
            raise RuntimeError(
                f"stage {self.stage_index}: backward of micro-batch {micro} has no output gradient"
            )
        roots, seeds = [], []
        for out, grad in zip(state.outputs, state.output_grads, strict=True):
            if grad is not None and out.requires_grad:
                roots.append(out)
                seeds.append(grad)
        return roots, seeds

    def _grad_inputs(self, micro: int) -> list[torch.Tensor]:
        return [t for t in self._micro[micro].inputs if t.requires_grad and t.is_leaf]

    def _collect_input_grads(self, micro: int, grads: dict[int, torch.Tensor | None]) -> None:
        state = self._micro[micro]
        if self.is_first:
            state.input_grads = ()
            return
        metas = self.inputs_meta[micro]
        state.input_grads = tuple(grads.get(i) for i, meta in enumerate(metas) if meta.requires_grad)

    def backward_one_chunk(self, micro: int, scale: float) -> None:
        """``B``: gradients of parameters and of the inputs in one backward pass."""
        roots, seeds = self._roots(micro, scale)
        state = self._micro[micro]
        leaf_ids = {id(t) for t in self._grad_inputs(micro)}
        if roots:
            torch.autograd.backward(roots, seeds)
        self._collect_input_grads(micro, {i: t.grad for i, t in enumerate(state.inputs) if id(t) in leaf_ids})
        self._release(micro)

    def backward_input(self, micro: int, scale: float) -> None:
        """``I``: only the input gradients; the graph is kept for ``W`` ([Note: split backward])."""
        roots, seeds = self._roots(micro, scale)
        state = self._micro[micro]
        state.roots = (roots, seeds)
        leaves = self._grad_inputs(micro)
        grads: dict[int, torch.Tensor | None] = {}
        if roots and leaves:
            found = torch.autograd.grad(roots, leaves, seeds, retain_graph=True, allow_unused=True)
            by_id = {id(t): g for t, g in zip(leaves, found, strict=True)}
            grads = {i: by_id.get(id(t)) for i, t in enumerate(state.inputs)}
        self._collect_input_grads(micro, grads)

    def backward_weight(self, micro: int, scale: float) -> None:
        """``W``: accumulate the parameter gradients of ``micro`` and free its graph."""
        roots, seeds = self._roots(micro, scale)
        params = [p for p in self.submod.parameters() if p.requires_grad]
        if roots and params:
            torch.autograd.backward(roots, seeds, inputs=params)
        self._release(micro)

    def _release(self, micro: int) -> None:
        state = self._micro[micro]
        state.inputs = ()
        state.outputs = ()
        state.roots = None
        state.output_grads = None
        if state.loss is not None:
            state.loss = state.loss.detach()

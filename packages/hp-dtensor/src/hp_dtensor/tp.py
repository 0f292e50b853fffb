"""Tensor parallelism: parallel styles and ``parallelize_module``.

A style shards one module's parameters and converts its inputs and outputs
at the boundary, so the code inside the module runs unchanged on DTensors:

* :class:`ColwiseParallel`: ``nn.Linear`` weight ``Shard(0)`` (output
  features; bias ``Shard(0)``), ``nn.Embedding`` weight ``Shard(1)``. Input
  replicated, output sharded on the last dim.
* :class:`RowwiseParallel`: ``nn.Linear`` weight ``Shard(1)`` (input
  features; bias replicated), ``nn.Embedding`` weight ``Shard(0)``. Input
  sharded on the last dim, output partial and then reduced (all-reduce to
  ``Replicate()``, or reduce-scatter to ``Shard(1)`` for sequence parallel).
* :class:`SequenceParallel`: parameters replicated, activations sharded on
  the sequence dim (norms and dropout between the two linear styles).

``input_layouts`` say how a plain input tensor is laid out (it becomes a
DTensor with ``from_local``); ``desired_input_layouts`` what the module
needs; ``output_layouts`` what it hands on; ``use_local_output`` whether the
next module gets a plain tensor. Same names and defaults as
``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import hp_core.collectives as hc
import torch
import torch._guards
from hp_core import DeviceMesh
from hp_core.distributed import mesh_group
from torch import nn

import hp_dtensor.tracing  # noqa: F401  (registers the metadata types for torch.compile)
from hp_dtensor.dtensor import DTensor, _FromLocal, distribute_tensor
from hp_dtensor.layout import Layout, chunk_sizes, global_stride_like
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["ColwiseParallel", "ParallelStyle", "RowwiseParallel", "SequenceParallel", "parallelize_module"]


def _convert_input(
    value: Any,
    mesh: DeviceMesh,
    given: Placement | None,
    desired: Placement | None,
    known_sizes: dict[int, int],
    gather_sizes: bool,
) -> Any:
    if given is None or desired is None or not hasattr(value, "dim"):
        return value
    if not isinstance(value, DTensor):
        value = _from_local_input(value, mesh, given, known_sizes, gather_sizes)
    if value.placements != (desired,):
        value = value.redistribute(placements=[desired])
    return value


def _from_local_input(
    local: torch.Tensor, mesh: DeviceMesh, given: Placement, known_sizes: dict[int, int], gather_sizes: bool
) -> DTensor:
    """Wrap a plain input as a DTensor placed ``given``, with the right global size when it is uneven.

    [Note: uneven TP boundaries]
    ``DTensor.from_local`` without ``shape`` takes the global size of a sharded
    dim as local size x mesh size, which is wrong for a ``torch.chunk`` cut of
    a dim that the TP degree does not divide (hidden 18 over 4 ranks is cut
    5, 5, 5, 3: rank 0 would take 20, rank 3 twelve). So the size is found
    in this order:

    1. from the module, with no communication: an ``nn.Linear``'s input
       features are its weight's global ``in_features`` (a row-wise linear's
       ``Shard(-1)`` input, the usual output of a column-wise one handed on as
       a plain tensor);
    2. otherwise (a sequence-sharded plain tensor: ``SequenceParallel``, or a
       column-wise linear with ``input_layouts=Shard(1)``) nothing local tells
       the size, so by default the even cut is assumed, as torch's
       ``DTensor.from_local`` does: no communication, and no host
       synchronisation on an accelerator, at every boundary of every step.
       A style built with ``gather_input_sizes=True`` gathers the ranks'
       sizes of that dim once per call instead (one all-gather of one
       integer per rank, then a read on the host), which also accepts a
       ragged cut; a DTensor input (``use_local_output=False`` upstream)
       needs neither;
    3. under ``torch.compile`` case 2 cannot gather (the sizes would be graph
       data, not shapes), so there the even cut is always assumed; uneven
       sequence shards must come in as DTensors there.
    """
    if not isinstance(given, Shard):
        return DTensor.from_local(local, mesh, [given])
    dim = given.dim % local.dim() if local.dim() else 0
    parts = mesh.size(0)
    me = mesh.get_local_rank()
    size = known_sizes.get(dim - local.dim())
    if size is None:
        if not gather_sizes or _tracing(local):
            return DTensor.from_local(local, mesh, [given])
        sizes = _gather_sizes(local, dim, mesh)
        size = sum(sizes)
        if sizes != chunk_sizes(size, parts):  # a ragged cut: from_local keeps the per-rank table
            shape = list(local.shape)
            shape[dim] = size
            return DTensor.from_local(local, mesh, [given], shape=shape)
    expected = chunk_sizes(size, parts)[me]
    if local.shape[dim] != expected:
        raise ValueError(
            f"tensor parallel input: dim {dim} of the local input has {local.shape[dim]} entries on TP rank "
            f"{me}, but the module needs {size} in all, which torch.chunk cuts into "
            f"{chunk_sizes(size, parts)} over {parts} ranks; shard the input with "
            f"torch.chunk(x, {parts}, dim={dim})[{me}] or pass a DTensor."
        )
    shape = list(local.shape)
    shape[dim] = size
    layout = Layout(mesh, (Shard(dim),), shape, global_stride_like(local, shape))
    result: DTensor = _FromLocal.apply(local, layout)
    return result


def _tracing(value: torch.Tensor) -> bool:
    """Whether ``value`` is being traced by torch.compile (a fake tensor), where no sizes can be gathered."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode(value) is not None


def _gather_sizes(local: torch.Tensor, dim: int, mesh: DeviceMesh) -> list[int]:
    """Every TP rank's size of ``dim`` of its local input, in rank order (one small all-gather)."""
    mine = torch.tensor([local.shape[dim]], dtype=torch.int64, device=local.device)
    out = torch.empty(mesh.size(0), dtype=torch.int64, device=local.device)
    with torch.profiler.record_function("hp_dtensor::tp_input_sizes"):  # one small collective: cheap label
        hc.all_gather_into_tensor(out, mine, mesh_group(mesh, 0))
    return [int(n) for n in out.tolist()]


def _convert_output(value: Any, output: Placement, use_local: bool) -> Any:
    if not isinstance(value, DTensor):
        return value
    if value.placements != (output,):
        value = value.redistribute(placements=[output])
    return value.to_local() if use_local else value


def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    param = getattr(module, name, None)
    if param is None or isinstance(param, DTensor):
        return
    dt = distribute_tensor(param.data, mesh, [placement])
    new = nn.Parameter(dt, requires_grad=param.requires_grad)
    module.register_parameter(name, new)
    if new.requires_grad:
        new.register_hook(_grad_like(dt.placements))


def _grad_like(placements: Sequence[Placement]) -> Any:
    """A gradient hook that hands the gradient over with the parameter's placements.

    [Note: gradient placements of parameters]
    Backward ops choose their output placements from what they see, not from
    the parameter: a norm's weight under sequence parallelism gets a
    ``Partial("sum")`` gradient (a sum over the local rows), and a row-wise
    embedding table whose ids were redistributed for the lookup a replicated
    one (normally its gradient is already row-sharded: [Note: row-wise
    backward] in :mod:`hp_dtensor.ops.embedding`). The optimizer would reconcile them at its first
    in-place op anyway; doing it here (the same all-reduce for a partial
    gradient, a local slice for a replicated one) gives every parameter a
    gradient laid out like itself, which is what gradient clipping, FSDP
    and checkpointing code expects.
    """
    target = tuple(placements)

    def hook(grad: Any) -> Any:
        if isinstance(grad, DTensor) and grad.placements != target:
            return grad.redistribute(placements=target)
        return grad

    return hook


class ParallelStyle:
    """Base class: ``apply(module, mesh)`` shards parameters and installs the boundary hooks."""

    input_layouts: Placement | None
    desired_input_layouts: Placement | None
    output_layouts: Placement
    use_local_output: bool
    #: gather the ranks' sizes of a sequence-sharded plain input per call ([Note: uneven TP boundaries])
    gather_input_sizes: bool = False

    def _params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        raise NotImplementedError

    def _known_input_sizes(self, module: nn.Module) -> dict[int, int]:
        """Global sizes of input dims (negative: from the end) that the module fixes.

        See [Note: uneven TP boundaries].

        An ``nn.Linear`` takes ``in_features`` on its last dim; its (possibly
        sharded) weight's global shape says how many, with no communication.
        """
        if isinstance(module, nn.Linear):
            return {-1: int(module.weight.shape[1])}
        return {}

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Shard ``module``'s parameters over the 1-D ``mesh`` and hook its forward."""
        if mesh.ndim != 1:
            raise ValueError(
                f"{type(self).__name__}: tensor parallelism takes a 1-D mesh, got a {mesh.ndim}-D mesh "
                f"{mesh.shape}; pass the TP dim, e.g. mesh['tp']."
            )
        self._params(module, mesh)
        given, desired = self.input_layouts, self.desired_input_layouts
        output_layout, use_local = self.output_layouts, self.use_local_output
        known_sizes = self._known_input_sizes(module)
        gather_sizes = self.gather_input_sizes

        # One opaque call each under torch.compile ([Note: TP boundaries under torch.compile]); the
        # metadata is closed over, so only the tensor crosses into the traced call.
        @torch._dynamo.nonstrict_trace
        def convert_input(value: torch.Tensor) -> torch.Tensor:
            return _convert_input(value, mesh, given, desired, known_sizes, gather_sizes)

        @torch._dynamo.nonstrict_trace
        def convert_output(value: torch.Tensor) -> torch.Tensor:
            return _convert_output(value, output_layout, use_local)

        def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if not args or not isinstance(args[0], torch.Tensor):
                return args
            return (convert_input(args[0]), *args[1:])

        def post_hook(mod: nn.Module, args: Any, output: Any) -> Any:
            if not isinstance(output, torch.Tensor):
                return output
            return convert_output(output)

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module


class ColwiseParallel(ParallelStyle):
    """Shard output features: replicated input in, last-dim-sharded output out."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        gather_input_sizes: bool = False,
    ) -> None:
        self.input_layouts = input_layouts or Replicate()
        self.desired_input_layouts = Replicate()
        self.gather_input_sizes = gather_input_sizes
        self.output_layouts = output_layouts or Shard(-1)
        self.use_local_output = use_local_output

    def _params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if isinstance(module, nn.Linear):
            _shard_param(module, "weight", mesh, Shard(0))
            _shard_param(module, "bias", mesh, Shard(0))
        elif isinstance(module, nn.Embedding):
            _shard_param(module, "weight", mesh, Shard(1))
        else:
            raise TypeError(
                f"ColwiseParallel supports nn.Linear and nn.Embedding, got {type(module).__name__}."
            )


class RowwiseParallel(ParallelStyle):
    """Shard input features: last-dim-sharded input in, reduced output out."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        self.input_layouts = input_layouts or Shard(-1)
        self.desired_input_layouts = Shard(-1)
        self.output_layouts = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def _params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if isinstance(module, nn.Linear):
            _shard_param(module, "weight", mesh, Shard(1))
            _shard_param(module, "bias", mesh, Replicate())
        elif isinstance(module, nn.Embedding):
            _shard_param(module, "weight", mesh, Shard(0))
            self.desired_input_layouts = Replicate()
            if self.input_layouts == Shard(-1):
                self.input_layouts = Replicate()
        else:
            raise TypeError(
                f"RowwiseParallel supports nn.Linear and nn.Embedding, got {type(module).__name__}."
            )


class SequenceParallel(ParallelStyle):
    """Replicated parameters, activations sharded on ``sequence_dim`` (for norms and dropout)."""

    def __init__(
        self, *, sequence_dim: int = 1, use_local_output: bool = False, gather_input_sizes: bool = False
    ) -> None:
        self.gather_input_sizes = gather_input_sizes
        self.input_layouts = Shard(sequence_dim)
        self.desired_input_layouts = Shard(sequence_dim)
        self.output_layouts = Shard(sequence_dim)
        self.use_local_output = use_local_output

    def _params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                _shard_param(module, name, mesh, Replicate())


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
) -> nn.Module:
    """Apply a style to ``module``, or each style of a plan to the submodules its key names.

    Keys are dotted submodule names and may use ``fnmatch`` wildcards per
    segment (``"layers.*.attn.q"``). A key that matches nothing is an error
    that lists the module's names, so typos do not silently leave a layer
    unsharded.
    """
    if parallelize_plan is None:
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan.apply(module, device_mesh)
    names = [name for name, _ in module.named_modules() if name]
    for pattern, style in parallelize_plan.items():
        matched = [name for name in names if _match(pattern, name)]
        if not matched:
            raise KeyError(
                f"parallelize_module: plan key {pattern!r} matches no submodule; the module has {names}."
            )
        for name in matched:
            style.apply(module.get_submodule(name), device_mesh)
    return module


def _match(pattern: str, name: str) -> bool:
    parts: Sequence[str] = pattern.split(".")
    segments = name.split(".")
    return len(parts) == len(segments) and all(
        fnmatch.fnmatchcase(s, p) for s, p in zip(segments, parts, strict=True)
    )

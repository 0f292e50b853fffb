"""Tensor parallelism: parallel styles and ``parallelize_module``.

A style shards one module's parameters and converts its inputs and outputs
at the boundary, so the code inside the module runs unchanged on DTensors:
:class:`ColwiseParallel`, :class:`RowwiseParallel` and
:class:`SequenceParallel`, with ``input_layouts``, ``desired_input_layouts``,
``output_layouts`` and ``use_local_output`` by the same names and defaults as
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
from hp_dtensor._agree import agree_over_mesh, describe
from hp_dtensor.dtensor import DTensor, _check_mesh, _distribute, _FromLocal
from hp_dtensor.layout import Layout, chunk_sizes, global_stride_like
from hp_dtensor.placements import Placement, Replicate, Shard, torch_equivalent

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
    # parallelize_module agreed on the whole module across ranks already: no per-parameter check.
    dt = _distribute(param.data, mesh, [placement], 0, "parallelize_module")
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


# -- argument checks (see the README's "Bad input": styles are checked when built, plans before any change)


def _layout_arg(style: str, name: str, value: Any) -> Placement | None:
    """A style's layout argument: one Placement (ours or torch's equivalent) or None, checked when built."""
    if value is None or isinstance(value, Placement):
        return value
    converted = torch_equivalent(value)
    if converted is not None:
        return converted
    hint = (
        "; pass the placement itself, not a sequence (a style has one input and one output)"
        if isinstance(value, (list, tuple))
        else ""
    )
    raise TypeError(
        f"{style}({name}={value!r}): expected one Placement such as Replicate(), Shard(-1) or Partial(), "
        f"or None for the default{hint}."
    )


def _flag_arg(style: str, name: str, value: Any) -> bool:
    """A style's boolean option: a truthy string such as "no" must not silently mean True."""
    if value is not True and value is not False:
        raise TypeError(f"{style}({name}={value!r}): expected True or False.")
    return value


def _check_tp_mesh(mesh: DeviceMesh, what: str) -> None:
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names
        example = f"mesh[{names[-1]!r}]" if names else "mesh['tp'] (name the dims with mesh_dim_names)"
        raise ValueError(
            f"{what}: tensor parallelism takes a 1-D mesh, got a {mesh.ndim}-D mesh {mesh.shape} "
            f"(dims {names}); pass the TP dim, e.g. {example}."
        )


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

    def _check_module(self, module: nn.Module, where: str) -> None:
        """Raise if this style cannot shard ``module`` (named ``where`` in the message); default: any."""

    def _boundary(self, module: nn.Module) -> tuple[Placement | None, Placement | None]:
        """The (given, desired) input placements at ``module``'s boundary; styles may depend on its type."""
        return self.input_layouts, self.desired_input_layouts

    def __repr__(self) -> str:
        # getattr: a user's subclass need not set every attribute, and repr must not fail on it.
        fields = ("input_layouts", "output_layouts", "use_local_output")
        values = ", ".join(f"{name}={getattr(self, name, None)!r}" for name in fields)
        return f"{type(self).__name__}({values})"

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Shard ``module``'s parameters over the 1-D ``mesh`` and hook its forward.

        Everything is checked before the module changes; :func:`parallelize_module`
        is the entry point that also checks that the ranks agree.
        """
        what = type(self).__name__
        if not isinstance(module, nn.Module):
            raise TypeError(f"{what}.apply: module must be a torch.nn.Module, got {type(module).__name__}.")
        mesh = _check_mesh(mesh, what)  # a torch mesh becomes ours here, once
        _check_tp_mesh(mesh, what)
        self._check_module(module, "the module")
        self._params(module, mesh)
        given, desired = self._boundary(module)
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
    """Shard output features: replicated input in, last-dim-sharded output out.

    ``nn.Linear`` weight and bias ``Shard(0)`` (output features), ``nn.Embedding``
    weight ``Shard(1)``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        gather_input_sizes: bool = False,
    ) -> None:
        what = "ColwiseParallel"
        self.input_layouts = _layout_arg(what, "input_layouts", input_layouts) or Replicate()
        self.desired_input_layouts = Replicate()
        self.gather_input_sizes = _flag_arg(what, "gather_input_sizes", gather_input_sizes)
        self.output_layouts = _layout_arg(what, "output_layouts", output_layouts) or Shard(-1)
        self.use_local_output = _flag_arg(what, "use_local_output", use_local_output)

    def _check_module(self, module: nn.Module, where: str) -> None:
        _linear_or_embedding(self, module, where)

    def _params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if isinstance(module, nn.Linear):
            _shard_param(module, "weight", mesh, Shard(0))
            _shard_param(module, "bias", mesh, Shard(0))
        else:  # nn.Embedding (_check_module ran first)
            _shard_param(module, "weight", mesh, Shard(1))


class RowwiseParallel(ParallelStyle):
    """Shard input features: last-dim-sharded input in, reduced output out.

    ``nn.Linear`` weight ``Shard(1)`` (input features; bias replicated),
    ``nn.Embedding`` weight ``Shard(0)``. The output is partial and then reduced:
    all-reduce to ``Replicate()``, or reduce-scatter to ``Shard(1)`` for
    sequence parallelism.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        what = "RowwiseParallel"
        self.input_layouts = _layout_arg(what, "input_layouts", input_layouts) or Shard(-1)
        self.desired_input_layouts = Shard(-1)
        self.output_layouts = _layout_arg(what, "output_layouts", output_layouts) or Replicate()
        self.use_local_output = _flag_arg(what, "use_local_output", use_local_output)

    def _check_module(self, module: nn.Module, where: str) -> None:
        _linear_or_embedding(self, module, where)

    def _boundary(self, module: nn.Module) -> tuple[Placement | None, Placement | None]:
        # A row-wise embedding looks replicated ids up in its rows: its input is not cut. Computed
        # per module, so one style object serves a Linear and an Embedding alike.
        if isinstance(module, nn.Embedding):
            given = Replicate() if self.input_layouts == Shard(-1) else self.input_layouts
            return given, Replicate()
        return self.input_layouts, self.desired_input_layouts

    def _params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if isinstance(module, nn.Linear):
            _shard_param(module, "weight", mesh, Shard(1))
            _shard_param(module, "bias", mesh, Replicate())
        else:  # nn.Embedding (_check_module ran first)
            _shard_param(module, "weight", mesh, Shard(0))


class SequenceParallel(ParallelStyle):
    """Replicated parameters, activations sharded on ``sequence_dim`` (for norms and dropout)."""

    def __init__(
        self, *, sequence_dim: int = 1, use_local_output: bool = False, gather_input_sizes: bool = False
    ) -> None:
        what = "SequenceParallel"
        if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool):
            raise TypeError(
                f"{what}(sequence_dim={sequence_dim!r}): expected an int, the dim of the activations that "
                "holds the sequence, e.g. sequence_dim=1 for (batch, sequence, hidden)."
            )
        self.gather_input_sizes = _flag_arg(what, "gather_input_sizes", gather_input_sizes)
        self.use_local_output = _flag_arg(what, "use_local_output", use_local_output)
        self.input_layouts = Shard(sequence_dim)
        self.desired_input_layouts = Shard(sequence_dim)
        self.output_layouts = Shard(sequence_dim)

    def _params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                _shard_param(module, name, mesh, Replicate())


def _linear_or_embedding(style: ParallelStyle, module: nn.Module, where: str) -> None:
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        name = type(style).__name__
        raise TypeError(
            f"{name} shards only nn.Linear and nn.Embedding, but {where} is a {type(module).__name__}; "
            f"apply {name}() to the Linear or Embedding itself (its plan key names that submodule), "
            "or use SequenceParallel() for norms and dropout."
        )


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

    The whole plan is checked before any submodule changes, so a bad plan
    leaves the module as it was; the ranks agree on the plan and the module
    first (sharding broadcasts the parameters, so the call communicates
    anyway: [Note: cross-rank agreement] in ``hp_core.agreement``).
    """
    what = "parallelize_module"
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{what}: module must be a torch.nn.Module, got {type(module).__name__} {module!r:.60}."
        )
    mesh = _check_mesh(device_mesh, what)
    if parallelize_plan is None:
        return module
    _check_tp_mesh(mesh, what)
    agree_over_mesh(
        what,
        mesh,
        "build the same module and the same plan on every rank of the TP mesh.",
        {
            "parallelize_plan": describe(parallelize_plan),
            "module": describe(dict(module.named_parameters())),
        },
    )
    targets = _resolve_plan(module, parallelize_plan, what)
    for _, submodule, style in targets:
        style.apply(submodule, mesh)
    return module


def _resolve_plan(module: nn.Module, plan: Any, what: str) -> list[tuple[str, nn.Module, ParallelStyle]]:
    """Every (name, submodule, style) the plan asks for, after checking all of it; changes nothing."""
    if isinstance(plan, ParallelStyle):
        plan._check_module(module, "the module")
        return [("", module, plan)]
    if not isinstance(plan, dict):
        raise TypeError(
            f"{what}: parallelize_plan must be a ParallelStyle, a dict {{submodule name: ParallelStyle}} "
            f"or None, got {type(plan).__name__} {plan!r:.80}; e.g. "
            "{'up': ColwiseParallel(), 'down': RowwiseParallel()}."
        )
    for key, style in plan.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{what}: plan key {key!r} is a {type(key).__name__}; keys are dotted submodule names "
                "(str), e.g. 'layers.0.mlp.up' or 'layers.*.mlp.up'."
            )
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"{what}: plan[{key!r}] is {type(style).__name__} {style!r:.60}, not a ParallelStyle; use "
                "ColwiseParallel(), RowwiseParallel() or SequenceParallel()."
            )
    names = [name for name, _ in module.named_modules() if name]
    matches = {key: [name for name in names if _match(key, name)] for key in plan}
    unmatched = [key for key, found in matches.items() if not found]
    if unmatched:
        raise KeyError(
            f"{what}: plan key(s) {unmatched} match no submodule; the module has {names}. "
            "Fix the key (dotted names; fnmatch wildcards per segment); nothing was changed."
        )
    claimed: dict[str, str] = {}
    targets: list[tuple[str, nn.Module, ParallelStyle]] = []
    for key, found in matches.items():
        for name in found:
            if name in claimed:
                raise ValueError(
                    f"{what}: submodule {name!r} is matched by plan keys {claimed[name]!r} and {key!r}; "
                    "a module takes one style, so make the keys match disjoint submodules."
                )
            claimed[name] = key
            submodule = module.get_submodule(name)
            plan[key]._check_module(submodule, f"submodule {name!r} (plan key {key!r})")
            targets.append((name, submodule, plan[key]))
    return targets


def _match(pattern: str, name: str) -> bool:
    parts: Sequence[str] = pattern.split(".")
    segments = name.split(".")
    return len(parts) == len(segments) and all(
        fnmatch.fnmatchcase(s, p) for s, p in zip(segments, parts, strict=True)
    )

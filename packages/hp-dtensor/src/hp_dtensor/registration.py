"""Public registration of op sharding rules: torch's ``register_sharding`` and hp's ``register_rule``.

Two forms, both backed by the dispatcher's rule table (:mod:`hp_dtensor.ops.dispatch`), so
integrations never import it ([Note: two registration forms]).
Either overrides an existing rule for the op, as torch's does; decisions cached for the old
rule are forgotten.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from hp_core import DeviceMesh
from torch.utils import _pytree as pytree

from hp_dtensor.dtensor import DTensor
from hp_dtensor.interop import _from_torch_placement
from hp_dtensor.ops.dispatch import SPECIAL, Decision, LocalCall, OpCall, clear_caches, register
from hp_dtensor.out_variants import is_out_variant, meta_result, out_positions, run_out_variant
from hp_dtensor.placements import Partial, Placement, Shard
from hp_dtensor.planner import plan_redistribute

__all__ = [
    "DTensorSpec",
    "Decision",
    "LocalCall",
    "OpCall",
    "TensorMeta",
    "register_rule",
    "register_sharding",
]

Rule = Callable[[OpCall], Decision | None]


class TensorMeta(NamedTuple):
    """Global shape, stride and dtype (torch's ``DTensorSpec.tensor_meta``)."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DTensorSpec:
    """What a :func:`register_sharding` function sees in place of a DTensor argument."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return self.tensor_meta.shape

    @property
    def stride(self) -> tuple[int, ...]:
        """The global stride."""
        return self.tensor_meta.stride

    @property
    def dtype(self) -> torch.dtype:
        """The dtype."""
        return self.tensor_meta.dtype

    @property
    def ndim(self) -> int:
        """The number of tensor dims."""
        return len(self.tensor_meta.shape)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh (DTensor's name for it)."""
        return self.mesh


# [Note: two registration forms]
# * :func:`register_sharding` is torch's ``torch.distributed.tensor.experimental.register_sharding``:
#   the decorated function takes the op's arguments with every DTensor replaced by a
#   :class:`DTensorSpec` and returns the acceptable shardings for *one* mesh dim, as a list of
#   ``(output_placements, input_placements)`` with one placement per output / tensor argument
#   (``None`` for non-tensors). They are combined over the mesh dims as torch does, and hp picks
#   the combination whose inputs cost the fewest bytes to redistribute (:mod:`hp_dtensor.planner`),
#   ties going to fewer collectives, then to fewer placements changed, then to the order given.
# * :func:`register_rule` is hp's native form: ``rule(call: OpCall) -> Decision | None`` sees the
#   call with its layouts and says where each DTensor argument must be and where each output
#   is (None declines: the op then runs replicated with a warning). A :class:`Decision` may
#   carry a ``kernel`` that runs instead of the op on the local tensors and may communicate.
#
# Custom ops (``torch.library.custom_op``) work like aten ops; they need a
# fake implementation (``@op.register_fake``), which hp runs on meta tensors for the output
# shapes, as torch's DTensor runs it on fake tensors.
def register_rule(*ops: Any, keeps_layout: bool = False, cached: bool = True) -> Callable[[Rule], Rule]:
    """Register ``rule(call: OpCall) -> Decision | None`` for each op (hp's native form).

    ``ops`` are OpOverloads, OpOverloadPackets (every overload) or custom ops.
    ``keeps_layout=True`` lets ragged layouts reach the rule (for ops whose
    output has the input's layout); ``cached=False`` is for rules that look
    past the arguments' layouts and values: they run on every call.
    """
    overloads = [_op(op, "register_rule") for op in ops]
    if not overloads:
        raise TypeError(
            "register_rule: name at least one op, e.g. @register_rule(torch.ops.aten.add.Tensor)."
        )

    def wrap(rule: Rule) -> Rule:
        if not callable(rule):
            raise TypeError(f"register_rule: the rule must be callable, got {type(rule).__name__} {rule!r}.")
        register(*overloads, keeps_layout=keeps_layout, cached=cached)(rule)
        for overload in _each_overload(overloads):
            if getattr(SPECIAL.get(overload), "out_variant_rule", None) is not None:
                del SPECIAL[overload]  # an earlier registration's out= runner
            if is_out_variant(overload):  # see [Note: out= variants] in hp_dtensor.out_variants
                SPECIAL[overload] = _OutRunner(overload, rule)
        clear_caches()  # decisions remembered for an earlier rule must not serve this one
        return rule

    return wrap


def register_sharding(op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """torch's ``register_sharding``: ``@register_sharding(op)`` over a function listing shardings.

    ``op`` is an op or a list of ops. See the module docstring; the decorated
    function is returned unchanged.
    """
    overloads = [_op(o, "register_sharding") for o in (op if isinstance(op, list) else [op])]

    def wrapper(sharding_fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(sharding_fn):
            raise TypeError(
                f"register_sharding: decorate a function, got {type(sharding_fn).__name__} {sharding_fn!r}."
            )
        register_rule(*overloads)(_ShardingRule(sharding_fn))
        return sharding_fn

    return wrapper


class _OutRunner:
    """The dispatcher's entry for an out= op with a registered rule (see :mod:`hp_dtensor.out_variants`)."""

    def __init__(self, func: Any, rule: Rule) -> None:
        self.func, self.out_variant_rule = func, rule

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return run_out_variant(self.out_variant_rule, self.func, args, kwargs)


def _each_overload(ops: list[Any]) -> list[Any]:
    """OpOverloads, packets expanded to every overload."""
    return [
        o
        for op in ops
        for o in ([getattr(op, n) for n in op.overloads()] if hasattr(op, "overloads") else [op])
    ]


def _op(op: Any, what: str) -> Any:
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op
    overload = getattr(op, "_opoverload", None)  # a torch.library.custom_op
    if isinstance(overload, torch._ops.OpOverload):
        return overload
    raise TypeError(
        f"{what}: {op!r} ({type(op).__name__}) is not an op; pass an OpOverload such as "
        "torch.ops.aten.add.Tensor, an OpOverloadPacket, or a torch.library.custom_op."
    )


# -- register_sharding's rule ----------------------------------------------------------------


class _Candidate(NamedTuple):
    outputs: list[tuple[Placement, ...] | None]
    inputs: list[tuple[Placement, ...]]  # one per DTensor argument, in call.positions order


class _ShardingRule:
    """The native rule behind one :func:`register_sharding` function."""

    def __init__(self, sharding_fn: Callable[..., Any]) -> None:
        self.sharding_fn = sharding_fn
        self.name = getattr(sharding_fn, "__qualname__", repr(sharding_fn))

    def __call__(self, call: OpCall) -> Decision:
        func = call.func
        outs = out_positions(call) if is_out_variant(func) else []
        inputs = [p for p in call.positions if p not in outs]  # out tensors are written, never moved
        layouts = [call.layout(p) for p in inputs]
        mesh = call.layout(call.positions[0]).mesh
        spec_args, spec_kwargs = pytree.tree_map_only(DTensor, _spec, (call.args, call.kwargs))
        listed = self.sharding_fn(*spec_args, **spec_kwargs)
        groups = _tensor_groups(call)
        returned = _flat_returns(meta_result(func, call.args, call.kwargs), len(func._schema.returns))
        strategies = [
            self._one(item, index, groups, set(outs), returned, func)
            for index, item in enumerate(_items(listed, func))
        ]
        out_dims = [m.dim() if isinstance(m, torch.Tensor) else None for each in returned for m in each]
        inplace = _is_inplace(func)
        best: tuple[Any, ...] | None = None
        for order, combo in enumerate(itertools.product(strategies, repeat=mesh.ndim)):
            candidate = _combine(combo, len(inputs), len(out_dims))
            if not self._valid(candidate, call, layouts, out_dims, inplace, func):
                continue
            cost = _cost(call, inputs, layouts, candidate.inputs)
            if best is None or (cost, order) < best[:2]:
                best = (cost, order, candidate)
        if best is None:
            raise ValueError(
                f"register_sharding: none of the {len(strategies)} sharding(s) {self.name} returned for "
                f"{func} fits inputs with placements {[list(lay.placements) for lay in layouts]} and shapes "
                f"{[lay.shape for lay in layouts]} on mesh {tuple(mesh.shape)}; return one that does "
                "(an all-Replicate one always fits)."
            )
        candidate = best[2]
        return Decision(
            inputs=dict(zip(inputs, candidate.inputs, strict=True)),
            outputs=list(candidate.outputs),
            inplace=inplace,
        )

    def _one(
        self,
        item: Any,
        index: int,
        groups: list[list[int]],
        outs: set[int],
        returned: list[list[Any]],
        func: Any,
    ) -> tuple[list[Placement | None], list[Placement]]:
        """One listed sharding as (a placement per output tensor, a placement per moved DTensor argument).

        A ``Tensor[]`` output takes one placement for every element or a
        list of one per element, as a tensor-list argument does; an out=
        variant's out arguments may be left out of the inputs (they follow
        their output) or given equal to it ([Note: out= variants]).
        """
        where = f"register_sharding: sharding {index} returned by {self.name} for {func}"
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(
                f"{where} is {item!r}; each must be a pair (output_placements, input_placements)."
            )
        outs_given, ins = (
            _placement_list(part, where, name) for part, name in zip(item, ("outputs", "inputs"), strict=True)
        )
        if len(outs_given) != len(returned):
            raise ValueError(
                f"{where} gives {len(outs_given)} output placement(s) {outs_given} but the op returns "
                f"{len(returned)} value(s); give one per output (None for non-tensor outputs, one placement "
                "or a list of one per element for a Tensor[] output)."
            )
        per_output = [
            _per_member(entry, len(each), where, "output")
            for entry, each in zip(outs_given, returned, strict=True)
        ]
        out_flat = [p for each in per_output for p in each]
        entries = [p for p in ins if p is not None]
        moved = [members for members in groups if not set(members) & outs]
        if len(entries) == len(groups) and len(moved) < len(groups):
            given_outs = [e for e, members in zip(entries, groups, strict=True) if set(members) & outs]
            if any(g != o for g, o in zip(given_outs, out_flat, strict=False)):
                raise ValueError(
                    f"{where} places the out argument(s) as {given_outs} but the output(s) as {out_flat}; "
                    "an out tensor receives the output: give it the output's placement (or leave it out)."
                )
            entries = [e for e, members in zip(entries, groups, strict=True) if not set(members) & outs]
        if len(entries) != len(moved):
            raise ValueError(
                f"{where} gives {len(entries)} input placement(s) {entries} (None entries skipped) but the "
                f"call has {len(moved)} DTensor argument(s); give one placement per tensor argument and "
                "None for the others, as in torch."
            )
        per_tensor: list[Placement] = []
        for entry, members in zip(entries, moved, strict=True):
            per_tensor.extend(_per_member(entry, len(members), where, "input"))
        return out_flat, per_tensor

    def _valid(
        self,
        candidate: _Candidate,
        call: OpCall,
        layouts: list[Any],
        out_dims: list[int | None],
        inplace: bool,
        func: Any,
    ) -> bool:
        """torch's filters: no mixed partials, inputs shardable, in-place keeps its argument's layout."""
        placements: tuple[Placement, ...] | None
        for placements in [*candidate.inputs, *(p for p in candidate.outputs if p is not None)]:
            ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
            if len(ops) > 1 and ops != {"sum", "avg"}:
                return False
        for index, (placements, dim) in enumerate(zip(candidate.outputs, out_dims, strict=False)):
            if placements is not None and dim is not None:
                _check_dims(placements, dim, f"output {index}", self.name, func)
        for layout, placements in zip(layouts, candidate.inputs, strict=True):
            _check_dims(placements, layout.ndim, "an input", self.name, func)
            if placements != layout.placements and not _shardable(layout, placements):
                return False
        if inplace:
            first = layouts[0].placements
            if candidate.inputs[0] != first or candidate.outputs[0] != first:
                return False
        return True


def _spec(dt: DTensor) -> DTensorSpec:
    layout = dt.layout_spec
    return DTensorSpec(
        layout.mesh, layout.placements, TensorMeta(torch.Size(layout.shape), layout.stride, dt.dtype)
    )


def _tensor_groups(call: OpCall) -> list[list[int]]:
    """The flat positions of the DTensors of each tensor-bearing argument, in argument order."""
    groups = []
    for value in [*call.args, *call.kwargs.values()]:
        members = [value] if isinstance(value, DTensor) else []
        if isinstance(value, (list, tuple)):
            members = [v for v in value if isinstance(v, DTensor)]
        if members:
            groups.append([call.position_of(v) for v in members])
    return groups


def _items(listed: Any, func: Any) -> list[Any]:
    if isinstance(listed, (str, bytes)) or not isinstance(listed, Sequence) or not listed:
        raise ValueError(
            f"register_sharding: the function for {func} returned {listed!r}; return a non-empty list of "
            "(output_placements, input_placements) pairs."
        )
    return list(listed)


def _placement_list(part: Any, where: str, name: str) -> list[Any]:
    if not isinstance(part, (list, tuple)):
        raise ValueError(
            f"{where}: its {name} must be a list of placements (None for non-tensors), got {part!r}."
        )
    return [_placement(p, where) for p in part]


def _placement(value: Any, where: str) -> Any:
    if value is None or isinstance(value, Placement):
        return value
    if isinstance(value, (list, tuple)):  # one per member of a tensor-list argument
        return tuple(_placement(v, where) for v in value)
    if hasattr(value, "is_shard") and hasattr(value, "is_partial"):  # torch's placements mean the same
        return _from_torch_placement(value, [value])
    raise ValueError(f"{where}: {value!r} is not a placement; use Shard(d), Replicate(), Partial() or None.")


def _per_member(entry: Any, members: int, where: str, what: str) -> list[Any]:
    """One placement per tensor of a (tensor-list) argument or output: one given for all, or one each."""
    if not isinstance(entry, tuple):
        return [entry] * members
    if len(entry) != members:
        raise ValueError(
            f"{where}: a tensor-list {what} of {members} tensors got placements {list(entry)}; "
            "give one placement for all or one per tensor."
        )
    return list(entry)


def _combine(combo: tuple[Any, ...], tensors: int, returns: int) -> _Candidate:
    """One sharding per mesh dim, as placements per tensor (torch's expand_to_full_mesh_op_strategy)."""
    outputs: list[tuple[Placement, ...] | None] = []
    for index in range(returns):
        column = [outs[index] for outs, _ in combo]
        outputs.append(None if any(p is None for p in column) else tuple(column))
    inputs = [tuple(ins[t] for _, ins in combo) for t in range(tensors)]
    return _Candidate(outputs, inputs)


def _check_dims(placements: tuple[Placement, ...], ndim: int, what: str, name: str, func: Any) -> None:
    for p in placements:
        if isinstance(p, Shard) and not 0 <= p.dim < ndim:
            raise ValueError(
                f"register_sharding: {name} placed {what} of {func} ({ndim}-D) as {list(placements)}; "
                f"Shard({p.dim}) is out of range, use a dim in [0, {ndim})."
            )


def _shardable(layout: Any, placements: tuple[Placement, ...]) -> bool:
    """Whether every shard gets at least one element of each sharded dim (torch's is_tensor_shardable)."""
    parts = [1] * layout.ndim
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            parts[p.dim] *= layout.mesh.size(mesh_dim)
    return all(size >= n for size, n in zip(layout.shape, parts, strict=True))


def _cost(
    call: OpCall, positions: list[int], layouts: list[Any], targets: list[tuple[Placement, ...]]
) -> tuple[int, int, int]:
    """(bytes received per rank, collectives, placements changed) to move the DTensor arguments.

    The last term prefers leaving a tensor as it is over a free local cut:
    the cut still copies, and keeps the output no less sharded than needed.
    """
    total = count = changed = 0
    for position, layout, target in zip(positions, layouts, targets, strict=True):
        if target != layout.placements:
            plan = plan_redistribute(layout, target, call.flat[position].element_size())
            total += plan.total_bytes
            count += plan.num_collectives
            changed += sum(1 for a, b in zip(layout.placements, target, strict=True) if a != b)
    return total, count, changed


def _is_inplace(func: Any) -> bool:
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _flat_returns(result: Any, returns: int) -> list[list[Any]]:
    """The op's outputs per schema return: a ``Tensor[]`` return's elements, one item otherwise."""
    if returns == 0:
        return []
    values = list(result) if returns > 1 else [result]
    return [list(v) if isinstance(v, (list, tuple)) else [v] for v in values]

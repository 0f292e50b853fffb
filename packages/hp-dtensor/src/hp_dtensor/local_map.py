"""local_map: run a function written for plain tensors on the local pieces of DTensors.

torch's ``torch.distributed.tensor.experimental.local_map`` by name, argument
order and meaning, for hp_dtensor's DTensor (see :func:`local_map` for the
rules). Both conversions are differentiable, so gradients flow through
``func`` as if it had been written for DTensors; under torch.compile they are
opaque calls ([Note: local_map under torch.compile]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hp_core import DeviceMesh
from torch.distributed._functional_collectives import _are_we_tracing
from torch.utils import _pytree as pytree

from hp_dtensor._agree import agree_over_mesh
from hp_dtensor.dtensor import DTensor, _check_mesh, _FromLocal, _layout_for_local
from hp_dtensor.layout import normalize_placements
from hp_dtensor.pending import wait_local
from hp_dtensor.placements import Placement

__all__ = ["local_map"]

PlacementType = Sequence[Placement] | None
InputPlacements = tuple[PlacementType, ...] | None
OutputPlacements = PlacementType | tuple[PlacementType, ...]

_WHAT = "local_map"


def local_map(
    func: Callable[..., Any] | None = None,
    out_placements: OutputPlacements = None,
    in_placements: InputPlacements = None,
    in_grad_placements: InputPlacements = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Any:
    """``func`` applied to the local pieces of its DTensor arguments; outputs wrapped as DTensors.

    torch's rules:

    * each DTensor argument (in the flattened positional arguments) is checked
      against ``in_placements`` (moved there when ``redistribute_inputs=True``,
      refused otherwise), then handed to ``func`` as its local tensor
      (``to_local(grad_placements=...)`` with ``in_grad_placements``);
    * each tensor in ``func``'s flattened output becomes a DTensor with its entry
      of ``out_placements``; non-tensor outputs need ``None`` there;
    * without any DTensor argument ``func`` runs as it is and its outputs are
      returned unchanged;
    * ``local_map(out_placements=..., ...)`` without ``func`` is a decorator;
    * keyword arguments are passed through untouched, as torch does; a DTensor
      among them is refused (torch hands it to ``func`` as a DTensor).

    ``in_placements`` and
    ``in_grad_placements`` have one entry per flattened positional argument
    (``None`` for non-tensors); ``out_placements`` one per flattened output,
    or a single placement list when ``func`` returns one value.
    ``device_mesh`` defaults to the first DTensor argument's mesh.

    Where torch assumes even output shards, hp gets the global shape right
    when an argument is cut unevenly: one small exchange of the sharded
    outputs' local shapes per such call ([Note: uneven local_map outputs]).
    """
    if redistribute_inputs is not True and redistribute_inputs is not False:
        raise TypeError(
            f"{_WHAT}: redistribute_inputs must be True or False, got "
            f"{type(redistribute_inputs).__name__} {redistribute_inputs!r}."
        )
    if device_mesh is not None:
        device_mesh = _check_mesh(device_mesh, _WHAT)  # a torch mesh becomes ours here, once
    for name, value in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if value is not None and not isinstance(value, (tuple, list)):
            raise TypeError(
                f"{_WHAT}: {name} must be a tuple with one entry per flattened positional argument "
                f"(placements or None), got {type(value).__name__} {value!r}; e.g. ([Shard(0)], None)."
            )
    if func is None:  # decorator factory: @local_map(out_placements=..., ...)
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    if not callable(func):
        raise TypeError(f"{_WHAT}: func must be callable, got {type(func).__name__} {func!r}.")

    options = _Options(
        out_placements,
        in_placements,
        in_grad_placements,
        redistribute_inputs,
        device_mesh,
        None if device_mesh is None else _from_local_on(device_mesh),
    )

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _call(func, options, args, kwargs)

    return wrapped


FromLocal = Callable[[torch.Tensor, tuple[Placement, ...]], DTensor]


@dataclass(frozen=True)
class _Options:
    """local_map's arguments, fixed when ``func`` is wrapped."""

    out_placements: OutputPlacements
    in_placements: InputPlacements
    in_grad_placements: InputPlacements
    redistribute_inputs: bool
    device_mesh: DeviceMesh | None  # None: the first DTensor argument's mesh
    from_local: FromLocal | None  # from_local on device_mesh


def _call(func: Callable[..., Any], options: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    in_placements, in_grad_placements = options.in_placements, options.in_grad_placements
    flat, spec = pytree.tree_flatten(args)
    for name, given in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(flat):
            raise ValueError(
                f"{_WHAT}: {name} has {len(given)} entries but the positional arguments flatten to "
                f"{len(flat)} values ({[type(v).__name__ for v in flat]}); give one entry per value "
                "(None for values that are not DTensors)."
            )
    first: DTensor | None = None  # the first DTensor argument
    uneven = False  # an argument cut into pieces of different sizes: [Note: uneven local_map outputs]
    local_flat: list[Any] = []
    for index, value in enumerate(flat):
        if not isinstance(value, DTensor):
            if (
                in_placements is not None
                and not isinstance(value, torch.Tensor)
                and in_placements[index] is not None
            ):
                raise ValueError(
                    f"{_WHAT}: argument {index} is a {type(value).__name__} ({_short(value)}), not a tensor, "
                    f"but in_placements[{index}]={in_placements[index]!r}; put None there."
                )
            local_flat.append(value)  # plain tensors and non-tensors pass through, as in torch
            continue
        if first is None:
            first = value
        uneven = uneven or len(set(value._layout.table())) > 1
        move_to: tuple[Placement, ...] = ()
        if in_placements is not None:
            wanted = _placements(in_placements[index], value, f"in_placements[{index}]")
            if value.placements != wanted:
                if not options.redistribute_inputs:
                    raise ValueError(
                        f"{_WHAT}: argument {index} has placements {list(value.placements)} but "
                        f"in_placements[{index}] is {list(wanted)}; pass it with those placements, "
                        "or set redistribute_inputs=True to have local_map redistribute it."
                    )
                move_to = wanted
        grad: tuple[Placement, ...] = ()
        if in_grad_placements is not None:
            grad = _placements(in_grad_placements[index], value, f"in_grad_placements[{index}]")
        local_flat.append(_to_local(value, move_to, grad))
    _refuse_dtensor_kwargs(kwargs)
    out = func(*pytree.tree_unflatten(local_flat, spec), **kwargs)
    if first is None:  # no DTensor argument: func ran on plain values, as torch's local_map does
        return out
    if options.from_local is not None and options.device_mesh is not None:
        return _wrap_outputs(out, options.out_placements, options.from_local, options.device_mesh, uneven)
    like = first
    return _wrap_outputs(
        out,
        options.out_placements,
        lambda value, placements: _from_local_like(value, like, placements),
        first.device_mesh,
        uneven,
    )


def _refuse_dtensor_kwargs(kwargs: dict[str, Any]) -> None:
    """A DTensor keyword argument is an error: in_placements covers positional arguments only.

    torch 2.13 hands such an argument to ``func`` as a DTensor, where it
    meets local tensors (hp's op dispatch would take those as replicated: a
    silently wrong value), so hp refuses it, naming the fix.
    """
    for name, value in kwargs.items():
        if any(isinstance(leaf, DTensor) for leaf in pytree.tree_leaves(value)):
            raise TypeError(
                f"{_WHAT}: keyword argument {name!r} holds a DTensor; keyword arguments reach func untouched "
                "(in_placements covers positional arguments only), so func would see a DTensor among local "
                f"tensors. Pass it positionally with an in_placements entry, or pass "
                f"{name}=<dtensor>.to_local()."
            )


def _wrap_outputs(
    out: Any, out_placements: OutputPlacements, from_local: FromLocal, mesh: DeviceMesh, uneven: bool
) -> Any:
    flat, spec = pytree.tree_flatten(out)
    specs = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(specs) != len(flat):
        raise ValueError(
            f"{_WHAT}: func returned {len(flat)} value(s) ({[type(v).__name__ for v in flat]}) but "
            f"out_placements has {len(specs)} entr{'y' if len(specs) == 1 else 'ies'} ({out_placements!r}); "
            "give a tuple with one entry per flattened output (None for non-tensors), or a single "
            "placement list when func returns one tensor."
        )
    wrapped: list[Any] = []
    for index, (value, placements) in enumerate(zip(flat, specs, strict=True)):
        if isinstance(value, DTensor):
            raise TypeError(
                f"{_WHAT}: output {index} of func is already a DTensor; func works on local tensors "
                "and must return plain tensors (call .to_local() inside it, or leave the DTensor out of it)."
            )
        if not isinstance(value, torch.Tensor):
            if placements is not None:
                raise ValueError(
                    f"{_WHAT}: output {index} is a {type(value).__name__} ({_short(value)}), not a tensor, "
                    f"but its out_placements entry is {placements!r}; put None there."
                )
            wrapped.append(value)
            continue
        if placements is None:
            raise ValueError(
                f"{_WHAT}: output {index} is a tensor of shape {tuple(value.shape)} but its out_placements "
                f"entry is None; give its placements, e.g. {[_example(mesh)]}."
            )
        normalized = normalize_placements(placements, mesh, value.dim(), f"{_WHAT} out_placements")
        wrapped.append((value, normalized))
    return pytree.tree_unflatten(_as_dtensors(wrapped, from_local, mesh, uneven), spec)


# [Note: uneven local_map outputs]
# torch's local_map wraps each output with ``from_local`` assuming even shards
# (global size = local size x mesh size), which is wrong as soon as func
# returns pieces of different sizes (7 rows on 2 ranks: 4 and 3). When any
# DTensor argument is cut into pieces of different sizes (known on every rank
# alike from its layout, so every rank makes the same choice), hp gathers the
# local shapes of all sharded outputs in one small exchange over the mesh (the
# cross-rank agreement of ``from_local(run_check=True)``, which also checks that
# every rank returned outputs of the same number of dims and dtype) and builds
# each output's layout from that table: torch.chunk sizes give a plain layout,
# others a ragged one. With evenly cut arguments (the hot path: attention heads,
# torchtitan's local_map'd attention and loss) even outputs are assumed, as
# torch does: no collective, and no device-to-host read, which the exchange
# would cost on a GPU. So a func returning data-dependent sizes from evenly cut
# inputs still needs ``DTensor.from_local(..., shape=...)`` by hand. No exchange
# while torch.compile traces either (shapes cannot be gathered there). torch's
# signature, which the API contract pins, has no place to pass global shapes.
def _as_dtensors(outputs: list[Any], from_local: FromLocal, mesh: DeviceMesh, uneven: bool) -> list[Any]:
    """Each ``(local, placements)`` output as a DTensor, with its global shape right; others unchanged."""
    pairs = [(i, item) for i, item in enumerate(outputs) if isinstance(item, tuple)]
    unknown = [
        i
        for i, (value, placements) in pairs
        if any(p.is_shard() and mesh.size(m) > 1 for m, p in enumerate(placements))
    ]
    tables: dict[int, list[tuple[int, ...]]] = {}
    if unknown and uneven and not _are_we_tracing():
        described = [(outputs[i][0].dim(), str(outputs[i][0].dtype), repr(outputs[i][1])) for i in unknown]
        extra = [size for i in unknown for size in outputs[i][0].shape]
        rows = agree_over_mesh(
            _WHAT,
            mesh,
            "make func return, on every rank, outputs of the same number of dims and dtype (their sizes "
            "may differ only along sharded dims).",
            {"outputs": described},
            extra=extra,
        )
        assert rows is not None
        start = 0
        for i in unknown:
            ndim = outputs[i][0].dim()
            tables[i] = [tuple(row[start : start + ndim]) for row in rows]
            start += ndim
    result = list(outputs)
    for i, (value, placements) in pairs:
        if i in tables:
            layout = _layout_for_local(value, mesh, placements, None, tables[i], f"{_WHAT} output {i}")
            result[i] = _FromLocal.apply(value, layout)
        else:
            result[i] = from_local(value, placements)
    return result


def _placements(given: Any, value: DTensor, what: str) -> tuple[Placement, ...]:
    if given is None:
        raise ValueError(
            f"{_WHAT}: {what} is None but that argument is a DTensor with placements "
            f"{list(value.placements)}; give its placements (e.g. {list(value.placements)})."
        )
    return normalize_placements(given, value.device_mesh, value.ndim, f"{_WHAT} {what}")


def _example(mesh: DeviceMesh) -> str:
    return "[" + ", ".join(["Replicate()"] * mesh.ndim) + "]"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# One opaque call each under torch.compile ([Note: local_map under torch.compile]).


# [Note: local_map under torch.compile]
# Dynamo cannot build a wrapper subclass from Python metadata, so the two
# conversions are ``torch._dynamo.nonstrict_trace`` calls (as the TP boundaries
# are, [Note: TP boundaries under torch.compile] in ``tracing.py``): each is one
# opaque call that AOTAutograd traces through, with the mesh and placements
# passed as pytree constants. ``func`` itself is traced by dynamo as usual.
@torch._dynamo.nonstrict_trace
def _to_local(
    value: DTensor, move_to: tuple[Placement, ...], grad_placements: tuple[Placement, ...]
) -> torch.Tensor:
    """``value`` moved to ``move_to`` (if any), as a local tensor whose gradient has ``grad_placements``."""
    if move_to:
        value = value.redistribute(placements=move_to)
    # func gets finished tensors, as torch's local_map waits for an async redistribution's result.
    wait_local(value._local)
    return value.to_local(grad_placements=grad_placements or None)


@torch._dynamo.nonstrict_trace
def _from_local_like(value: torch.Tensor, like: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """``value`` as a DTensor on ``like``'s mesh (a mesh cannot cross into the call by itself)."""
    return DTensor.from_local(value, like.device_mesh, placements)


def _from_local_on(mesh: DeviceMesh) -> FromLocal:
    """``from_local`` on ``mesh`` as one opaque call, the mesh closed over (built outside compiled code)."""

    @torch._dynamo.nonstrict_trace
    def from_local(value: torch.Tensor, placements: tuple[Placement, ...]) -> DTensor:
        return DTensor.from_local(value, mesh, placements)

    return from_local

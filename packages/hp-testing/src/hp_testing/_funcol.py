"""Functional collectives (``torch.distributed._functional_collectives``) through the emulation layer.

torch's own DTensor, ``torch.compile``d code and some user code never call
``torch.distributed.all_gather_into_tensor``: they call the functional
collectives, which go straight to the process group's C++ backend and so
would slip past the wrappers in :mod:`hp_testing.emulation`. A rank that skips
a functional all-gather hangs a GPU job just the same, so this module wraps
the public functional entry points too, sharing one sequence per group with
the classic collectives ([Note: functional collectives in the layer]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hp_testing._calls import Call, describe
from hp_testing._nesting import Nested, depth

__all__ = ["FUNCTIONAL", "install_functional", "uninstall_functional"]

#: functional name -> the torch.distributed collective it behaves like on the wire.
FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_autograd": "all_gather_into_tensor",
    "all_gather_tensor": "all_gather_into_tensor",
    "all_gather_tensor_autograd": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_autograd": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "all_to_all_single_autograd": "all_to_all_single",
    "broadcast": "broadcast",
}

_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _module() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


def _process_group(group: Any, tag: str) -> Any:
    """The ProcessGroup behind any functional ``group`` form (group, ranks, mesh, (mesh, dim), name)."""
    funcol = _module()
    name = funcol._resolve_group_name(group, tag)
    return dist.distributed_c10d._resolve_process_group(name)


def _meta(shape: tuple[int, ...] | list[int], like: torch.Tensor) -> torch.Tensor:
    """A shape-only stand-in for an output the functional op allocates itself."""
    return torch.empty(tuple(shape), dtype=like.dtype, device="meta")


# [Note: functional collectives in the layer]
# Each wrapper translates its arguments into the ``torch.distributed`` call with
# the same wire behaviour (``all_gather_tensor`` is an ``all_gather_into_tensor``,
# ``reduce_scatter_tensor`` a ``reduce_scatter_tensor`` and so on) and hands that
# to :meth:`hp_testing.emulation.Layer.check_collective`. Because NCCL and HCCL
# run a group's functional and classic collectives on one communicator in issue
# order, both kinds share one sequence per group, and a rank that issues a
# functional all-gather where its peers issue a classic one of the same size is
# not flagged (it works on the real backend too).
#
# What is not done for functional collectives: strict mode's read guard (their
# results are ``AsyncCollectiveTensor``s that wait on first use, so reading one
# early is not a hazard), and the ``*_coalesced`` and ``*_inplace`` variants,
# which no torch component in 2.13 calls on the training path.
def describe_functional(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """Describe functional collective ``name`` as the torch.distributed call it performs."""
    funcol = _module()
    bound = _signature(getattr(funcol, name)).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    tensor: torch.Tensor = a["self"]
    group = _process_group(a["group"], a.get("tag", ""))
    world = dist.get_world_size(group)
    wire = FUNCTIONAL[name]
    if wire == "all_reduce":
        call = describe(wire, {"tensor": tensor, "op": a["reduceOp"], "group": group, "async_op": False})
    elif wire == "broadcast":
        src = a["src"]
        call = describe(wire, {"tensor": tensor, "src": src, "group": group, "async_op": False})
    elif wire == "all_gather_into_tensor":
        out_shape = list(tensor.shape) or [1]
        out_shape[0] *= world
        call = describe(
            wire,
            {"output_tensor": _meta(out_shape, tensor), "input_tensor": tensor, "group": group},
        )
    elif wire == "reduce_scatter_tensor":
        out_shape = list(tensor.shape) or [1]
        out_shape[a["scatter_dim"]] //= world
        call = describe(
            wire,
            {"output": _meta(out_shape, tensor), "input": tensor, "op": a["reduceOp"], "group": group},
        )
    else:
        outs = a.get("output_split_sizes")
        total = sum(outs) if outs else tensor.shape[0]
        out = _meta([total, *tensor.shape[1:]], tensor)
        call = describe(
            wire,
            {
                "output": out,
                "input": tensor,
                "output_split_sizes": outs,
                "input_split_sizes": a.get("input_split_sizes"),
                "group": group,
            },
        )
    call.name = f"funcol.{name}"
    call.shown = f"funcol.{name}: {call.shown}"
    return call


@functools.cache
def _signature(fn: Callable[..., Any]) -> Any:
    import inspect

    return inspect.signature(fn)


def _wrap(name: str, orig: Callable[..., Any], check: Callable[[Call], object]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or _module()._are_we_tracing():
            # traced into a graph: the graph's ops are checked each time it runs instead
            # ([Note: compiled graphs under the emulation] in hp_testing._funcol_ops)
            return orig(*args, **kwargs)
        if depth():
            return orig(*args, **kwargs)
        check(describe_functional(name, args, kwargs))
        with Nested():  # all_gather_tensor calls all_gather_single: count the outer call only
            return orig(*args, **kwargs)

    wrapper.__hp_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def install_functional(check: Callable[[Call], object]) -> None:
    """Wrap the functional entry points; ``check`` runs the layer's rules and cross-rank checks."""
    funcol = _module()
    for name in FUNCTIONAL:
        orig = getattr(funcol, name, None)
        if orig is None or name in _ORIGINALS:
            continue
        _ORIGINALS[name] = orig
        setattr(funcol, name, _wrap(name, orig, check))


def uninstall_functional() -> None:
    """Put the original functional entry points back."""
    funcol = _module()
    for name, orig in _ORIGINALS.items():
        setattr(funcol, name, orig)
    _ORIGINALS.clear()

"""One torch.distributed call, described once for the rules, the cross-rank checks and the report.

:func:`describe` turns the bound arguments of a wrapped ``torch.distributed``
function into a :class:`Call`: its group, tensors, reduce op, root or peer,
and a ``key`` that every rank of the group must agree on (see
[Note: what must match across ranks]). The Python call site is the first
frame outside torch, hp_core and hp_testing, so an error points at the user's
line rather than a library's.

[Note: what must match across ranks]
Element counts, not shapes: NCCL and gloo only see ``count`` and the data
type, so a ``(2, 4)`` against an ``(8,)`` all-reduce works on every backend
and is not flagged. The op name, dtype, reduce op and root must agree. For
``all_to_all_single`` the split sizes must agree pairwise (rank i's
``input_split_sizes[j]`` equals rank j's ``output_split_sizes[i]``), which is
checked separately from the key.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Call", "NotAMemberError", "call_site", "describe", "global_peer"]


class NotAMemberError(RuntimeError):
    """A rank called a collective on a group it does not belong to (torch skips it silently)."""


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_SKIP_DIRS: tuple[str, ...] = ()


def _skip_dirs() -> tuple[str, ...]:
    global _SKIP_DIRS
    if not _SKIP_DIRS:
        import contextlib
        import functools

        dirs = [
            _package_dir(torch),
            os.path.dirname(os.path.abspath(__file__)) + os.sep,
            os.path.abspath(contextlib.__file__),
            os.path.abspath(functools.__file__),
        ]
        hp_core = sys.modules.get("hp_core")
        if hp_core is not None:
            dirs.append(_package_dir(hp_core))
        _SKIP_DIRS = tuple(dirs)
    elif "hp_core" in sys.modules and not any("hp_core" in d for d in _SKIP_DIRS):
        _SKIP_DIRS = (*_SKIP_DIRS, _package_dir(sys.modules["hp_core"]))
    return _SKIP_DIRS


def call_site(depth: int = 2) -> str:
    """``file:line in function`` of the first frame outside torch, hp_core and hp_testing."""
    skip = _skip_dirs()
    frame: Any = sys._getframe(depth)
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if fallback is None:
            fallback = frame
        if not filename.startswith(skip) and not filename.startswith("<"):
            break
        frame = frame.f_back
    if frame is None:
        frame = fallback
    if frame is None:
        return "<unknown>"
    parts = frame.f_code.co_filename.split(os.sep)
    short = os.sep.join(parts[-2:])
    return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"


def reduce_op_name(op: Any) -> tuple[str, float | None]:
    """``("sum", None)``, ``("premul_sum", 0.5)``, ... for any torch ReduceOp form."""
    factor = None
    kind = op
    if not isinstance(op, dist.ReduceOp.RedOpType) and hasattr(op, "op"):
        kind = op.op
        try:
            raw = op.factor
        except Exception:
            raw = None
        if raw is not None:
            factor = float(raw.item()) if isinstance(raw, torch.Tensor) else float(raw)
    name = str(kind).rsplit(".", 1)[-1].lower()
    return name, factor


@dataclass
class Call:
    """A described call; ``key`` must be equal on every rank of ``group``."""

    name: str
    kind: str  # "collective", "p2p", "object", "barrier"
    group: Any
    group_ranks: tuple[int, ...]
    group_name: str
    inputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    outputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    reduce_op: str | None = None
    premul_factor: float | None = None
    dtype: torch.dtype | None = None
    root: int | None = None
    peer: int | None = None
    tag: int = 0
    async_op: bool = False
    uneven: list[int] | None = None
    splits: tuple[list[int], list[int]] | None = None
    key: tuple[Any, ...] = ()
    shown: str = ""
    site: str = ""

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        out = []
        for label, tensor in [*self.outputs, *self.inputs]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append((label, tensor))
        return out


def _group(fn: str, group: Any) -> tuple[Any, tuple[int, ...], str]:
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise NotAMemberError(
            f"{fn}(): rank {dist.get_rank()} is not a member of the group it passed (new_group returned "
            "NON_GROUP_MEMBER here); torch would skip the call on this rank while the members wait for "
            "it. Call the collective only on the group's ranks."
        )
    ranks = tuple(dist.get_process_group_ranks(group))
    if dist.get_rank() not in ranks:
        raise NotAMemberError(
            f"{fn}(): rank {dist.get_rank()} is not in the group {list(ranks)}; "
            "call the collective only on the group's ranks."
        )
    return group, ranks, str(getattr(group, "group_name", "") or ranks)


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(s) for s in t.shape) or "scalar"


def _root(args: dict[str, Any], name: str, ranks: tuple[int, ...]) -> int | None:
    value = args.get(name)
    group_value = args.get(f"group_{name}")
    if value is None and group_value is not None and 0 <= group_value < len(ranks):
        return ranks[group_value]
    return value if isinstance(value, int) else None


def _even_splits(t: torch.Tensor, splits: Any, world: int) -> list[int]:
    if splits:
        return [int(s) for s in splits]
    size = t.shape[0] if t.dim() else 0
    return [size // world] * world


def describe(name: str, args: dict[str, Any]) -> Call:
    """Normalise the bound arguments of ``torch.distributed.<name>`` into a :class:`Call`."""
    if name == "batch_isend_irecv":
        raise ValueError("batch_isend_irecv is described per op")
    group, ranks, gname = _group(name, args.get("group"))
    call = Call(name=name, kind="collective", group=group, group_ranks=ranks, group_name=gname)
    call.async_op = bool(args.get("async_op", False))
    op = args.get("op")
    if op is not None:
        call.reduce_op, call.premul_factor = reduce_op_name(op)
    world = len(ranks)
    detail = ""
    if name in ("all_reduce", "broadcast", "reduce"):
        t = args["tensor"]
        call.inputs = [("tensor", t)]
        call.outputs = [("tensor", t)]
        call.dtype = t.dtype
        if name != "all_reduce":
            call.root = _root(args, "src" if name == "broadcast" else "dst", ranks)
        call.key = (name, t.numel(), str(t.dtype), call.reduce_op, call.root)
        detail = f"tensor {_shape(t)} {t.dtype}"
    elif name in ("all_gather_single", "all_gather_into_tensor"):
        out, inp = args["output_tensor"], args["input_tensor"]
        call.inputs, call.outputs = [("input_tensor", inp)], [("output_tensor", out)]
        call.dtype = inp.dtype
        call.key = ("all_gather_single", inp.numel(), out.numel(), str(inp.dtype))
        detail = f"in {_shape(inp)} out {_shape(out)} {inp.dtype}"
    elif name == "all_gather":
        outs, inp = list(args["tensor_list"]), args["tensor"]
        call.inputs = [("tensor", inp)]
        call.outputs = [(f"tensor_list[{i}]", t) for i, t in enumerate(outs)]
        call.dtype = inp.dtype
        sizes = [t.numel() for t in outs]
        if len(set(sizes)) > 1:
            call.uneven = sizes
        call.key = (name, tuple(sizes), str(inp.dtype))
        detail = f"in {_shape(inp)} outs {sizes} {inp.dtype}"
    elif name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        out, inp = args["output"], args["input"]
        call.inputs, call.outputs = [("input", inp)], [("output", out)]
        call.dtype = inp.dtype
        call.key = ("reduce_scatter_single", inp.numel(), out.numel(), str(inp.dtype), call.reduce_op)
        detail = f"in {_shape(inp)} out {_shape(out)} {inp.dtype}"
    elif name == "reduce_scatter":
        out, ins = args["output"], list(args["input_list"])
        call.inputs = [(f"input_list[{i}]", t) for i, t in enumerate(ins)]
        call.outputs = [("output", out)]
        call.dtype = out.dtype
        call.key = (name, tuple(t.numel() for t in ins), str(out.dtype), call.reduce_op)
        detail = f"out {_shape(out)} {out.dtype}"
    elif name == "all_to_all_single":
        out, inp = args["output"], args["input"]
        call.inputs, call.outputs = [("input", inp)], [("output", out)]
        call.dtype = inp.dtype
        ins = _even_splits(inp, args.get("input_split_sizes"), world)
        outs = _even_splits(out, args.get("output_split_sizes"), world)
        call.splits = (ins, outs)
        call.key = (name, str(inp.dtype), tuple(inp.shape[1:]))
        detail = f"in {_shape(inp)} out {_shape(out)} {inp.dtype} splits in={ins} out={outs}"
    elif name == "all_to_all":
        outs, ins = list(args["output_tensor_list"]), list(args["input_tensor_list"])
        call.inputs = [(f"input_tensor_list[{i}]", t) for i, t in enumerate(ins)]
        call.outputs = [(f"output_tensor_list[{i}]", t) for i, t in enumerate(outs)]
        call.dtype = ins[0].dtype if ins else None
        call.splits = ([t.numel() for t in ins], [t.numel() for t in outs])
        call.key = (name, str(call.dtype))
        detail = f"ins {call.splits[0]} outs {call.splits[1]} {call.dtype}"
    elif name in ("gather", "scatter"):
        t = args["tensor"]
        lst = args.get("gather_list" if name == "gather" else "scatter_list") or []
        call.root = _root(args, "dst" if name == "gather" else "src", ranks)
        (call.inputs if name == "gather" else call.outputs).append(("tensor", t))
        side = call.outputs if name == "gather" else call.inputs
        side.extend((f"list[{i}]", x) for i, x in enumerate(lst))
        call.dtype = t.dtype
        call.key = (name, t.numel(), str(t.dtype), call.root)
        detail = f"tensor {_shape(t)} {t.dtype}"
    elif name in ("barrier", "monitored_barrier"):
        call.kind = "barrier"
        call.key = ("barrier",)
    elif name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"):
        call.kind = "object"
        if name == "broadcast_object_list":
            call.root = _root(args, "src", ranks)
            call.key = (name, call.root, len(args["object_list"]))
            detail = f"{len(args['object_list'])} object(s)"
        elif name == "scatter_object_list":
            call.root = _root(args, "src", ranks)
            call.key = (name, call.root)
        elif name == "gather_object":
            call.root = _root(args, "dst", ranks)
            call.key = (name, call.root)
        else:
            call.key = (name,)
    else:  # pragma: no cover - wrappers only exist for the names above
        raise KeyError(name)
    root = f", root {call.root}" if call.root is not None else ""
    op_text = f", op {call.reduce_op.upper()}" if call.reduce_op else ""
    call.shown = f"{call.key[0]}({detail}{op_text}{root})"
    return call


def describe_p2p(name: str, tensor: torch.Tensor, peer: int | None, group: Any, tag: int) -> Call:
    """A send or receive; ``peer`` is a global rank (``None``: any source)."""
    group, ranks, gname = _group(name, group)
    call = Call(name=name, kind="p2p", group=group, group_ranks=ranks, group_name=gname)
    call.peer = peer
    call.tag = int(tag or 0)
    call.dtype = tensor.dtype
    if "send" in name:
        call.inputs = [("tensor", tensor)]
    else:
        call.outputs = [("tensor", tensor)]
    direction = "to" if "send" in name else "from"
    call.shown = f"{name}({_shape(tensor)} {tensor.dtype} {direction} rank {peer})"
    call.key = (name, tensor.numel(), str(tensor.dtype))
    return call


def object_p2p(name: str, peer: int | None, group: Any) -> Call:
    group, ranks, gname = _group(name, group)
    call = Call(name=name, kind="object", group=group, group_ranks=ranks, group_name=gname, peer=peer)
    call.shown = f"{name}(peer {peer})"
    call.key = (name,)
    return call


def global_peer(args: dict[str, Any], send: bool) -> int | None:
    """The peer of a p2p call as a global rank (``dst``/``src`` or ``group_dst``/``group_src``)."""
    peer = args.get("dst" if send else "src")
    group_peer = args.get("group_dst" if send else "group_src")
    if peer is None and group_peer is not None:
        group: Any = args.get("group") or dist.group.WORLD
        peer = dist.get_global_rank(group, group_peer)
    return peer

"""Running a checked call on gloo with the emulated backend's result where gloo lacks the feature.

gloo has no ``PREMUL_SUM``, moves no float8 and refuses uneven ``all_gather``
lists; NCCL (and HCCL, for the gather) accept them. Under an emulated profile
these are carried out with the same result the real backend gives:

- ``PREMUL_SUM``: scale locally, then ``SUM`` (what the ReduceOp docs define it as);
- float8 moves under ``nccl-emu``: the bytes, as ``uint8`` views (NCCL moves bytes too);
- uneven ``all_gather``: pad to the largest piece, gather once, slice out.

The rules that *refuse* calls live in :mod:`hp_testing.profiles`; this module
only executes calls the rules let through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hp_testing._calls import Call
from hp_testing._hazards import DoneWork
from hp_testing.profiles import Profile

__all__ = ["FP8", "AllWork", "BatchPart", "execute", "transfer_view"]

#: Gather-like collectives that only move bytes (fp8 may pass as uint8 there).
MOVES = (
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
)
FP8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def _bytes_view(value: Any) -> Any:
    """fp8 tensors (and lists of them) as uint8 views: gloo refuses fp8, NCCL moves its bytes."""
    if isinstance(value, torch.Tensor) and value.dtype in FP8:
        return value.view(torch.uint8)
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [_bytes_view(v) for v in value]
    return value


def transfer_view(profile: Profile, tensor: torch.Tensor) -> torch.Tensor:
    """What gloo is handed for a point-to-point ``tensor`` under ``profile`` (fp8 as bytes on nccl-emu)."""
    if profile.name == "nccl-emu" and tensor.dtype in FP8:
        return tensor.view(torch.uint8)
    return tensor


class AllWork:
    """The first handle of a batch: its own op's work, but waiting it waits every op of the batch.

    The results of a batch are handed over together (checks, every transfer);
    what only reads state (``get_future``, ``result``, ...) is the first op's.
    """

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def wait(self, timeout: Any = None) -> bool:
        for handle in self._handles:
            if timeout is None:
                handle.wait()
            else:
                handle.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handles[0], name)


class BatchPart:
    """Another op of a batch: waited through the first handle (a gloo work waited twice blocks
    forever), its state read from its own work (a future that completes when the op does)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def wait(self, timeout: Any = None) -> bool:
        del timeout  # the first handle's wait, run before this one, waited the real work
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def execute(
    profile: Profile,
    name: str,
    orig: Callable[..., Any],
    args: dict[str, Any],
    call: Call,
    gather_single: Callable[..., Any],
) -> Any:
    """Run collective ``name`` on gloo; ``gather_single`` is torch's own ``all_gather_single``."""
    if call.reduce_op == "premul_sum" and profile.emulated:
        _emulate_premul(name, args, call)
    if profile.name == "nccl-emu" and call.dtype in FP8 and name in MOVES:
        for key, value in list(args.items()):
            args[key] = _bytes_view(value)
    if name == "all_gather" and call.uneven is not None:
        return _uneven_all_gather(args, call, gather_single)
    return orig(**args)


def _emulate_premul(name: str, args: dict[str, Any], call: Call) -> None:
    """NCCL's PREMUL_SUM on gloo: scale locally, then SUM (the same result, see ReduceOp docs)."""
    factor = call.premul_factor if call.premul_factor is not None else 1.0
    args["op"] = dist.ReduceOp.SUM
    with torch.no_grad():
        if name in ("all_reduce", "reduce"):
            args["tensor"].mul_(factor)
        elif name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            args["input"] = args["input"] * factor
        elif name == "reduce_scatter":
            args["input_list"] = [t * factor for t in args["input_list"]]


def _uneven_all_gather(args: dict[str, Any], call: Call, gather_single: Callable[..., Any]) -> Any:
    """NCCL and HCCL gather uneven lists; gloo refuses. Pad, gather once, slice out."""
    outputs: list[torch.Tensor] = list(args["tensor_list"])
    source: torch.Tensor = args["tensor"]
    largest = max(t.numel() for t in outputs)
    padded = source.new_zeros(largest)
    padded[: source.numel()].copy_(source.reshape(-1))
    buffer = source.new_empty(largest * len(outputs))
    gather_single(buffer, padded, group=call.group)
    for index, out in enumerate(outputs):
        out.copy_(buffer[index * largest : index * largest + out.numel()].view_as(out))
    return DoneWork() if call.async_op else None

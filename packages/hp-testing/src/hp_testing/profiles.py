"""Backend profiles: what NCCL, HCCL and gloo accept, checked before any traffic moves.

A profile is data: the reduce ops, the dtypes per kind of operation, and the
layout and point-to-point rules of one backend, each with the document it comes
from. :func:`check_call` applies a profile to one described call (see
:mod:`hp_testing._calls`) and raises :class:`BackendRuleError` naming the rule,
the observed value, the fix and the source. Why gloo has a profile too:
[Note: why the gloo profile has rules too]; NCCL's rule for a group's first
batch: [Note: the first batch on a group].
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["PROFILES", "BackendRuleError", "Profile", "check_call", "get_profile"]

_FP8 = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

SOURCES = {
    "torch-reduceop": "torch.distributed.ReduceOp docstring (torch 2.13): "
    "https://docs.pytorch.org/docs/stable/distributed.html#torch.distributed.ReduceOp",
    "torch-p2p-tag": "torch.distributed.send/recv/isend/irecv docstrings (torch 2.13): "
    "'tag is not supported with the NCCL backend'",
    "torch-all-gather": "torch.distributed.all_gather docstring (torch 2.13): "
    "'Complex and uneven sized tensors are supported'",
    "torch-monitored-barrier": "torch.distributed.monitored_barrier docstring (torch 2.13): "
    "'this collective is only supported with the GLOO backend'",
    "torch-broadcast-object": "torch.distributed.broadcast_object_list docstring (torch 2.13): "
    "'each rank must provide lists of equal sizes'",
    "nccl-types": "NCCL API, ncclDataType_t and ncclRedOp_t: "
    "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api/types.html",
    "nccl-fp8": "PyTorch ProcessGroupNCCL.cpp: 'Float8 dtypes are not currenlty supported for NCCL "
    "reductions' (all_reduce, reduce, reduce_scatter); gathers and p2p move fp8 bytes",
    "nccl-contiguous": "PyTorch ProcessGroupNCCL.cpp check_gpu_single_tensor: 'Tensors must be contiguous' "
    "(contiguous in the tensor's suggested memory format)",
    "nccl-p2p": "NCCL user guide, Point-to-point communication: 'This operation is blocking for the GPU. "
    "If multiple ncclSend() and ncclRecv() operations need to progress concurrently to complete, they "
    "must be fused within a ncclGroupStart()/ncclGroupEnd() section.' "
    "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html",
    "nccl-anysource": "PyTorch ProcessGroupNCCL: recvAnysource is not supported (recv needs src)",
    "hccl-allreduce": "Ascend HCCL API reference, HcclAllReduce/HcclReduce: op in sum, prod, max, min; "
    "dataType int8, int16, int32, int64, float16, float32, bfp16 (Atlas A2); 'prod' not for int16 "
    "or bfp16: https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/hcclapiref/"
    "hcclcpp_07_0021.html",
    "hccl-allreduce-350": "Ascend HCCL API reference (CANN 9.0), HcclAllReduce: the Atlas 350 card adds "
    "float64 (and uint64) to the reduced types of Atlas A2/A3: https://www.hiascend.com/doc_center/source/"
    "en/CANNCommunityEdition/900/API/hcclug/hcclcpp_07_0021.html",
    "hccl-types": "Ascend HCCL API reference, HcclDataType (no float8 type): "
    "https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/hcclapiref/",
    "hccl-contiguous": "torch_npu ProcessGroupHCCL.cpp: 'Tensors must be contiguous' "
    "(test/distributed/_fault_mode_cases/error_discontinuous_tensor.py in Ascend/pytorch)",
    "gloo-noncontiguous": "measured on gloo, torch 2.13: all_reduce(ones(4, 4)[:, 0]) returns "
    "[2, 1, 1, 1] and overwrites row 0 of the base",
    "gloo-measured": "measured on gloo, torch 2.13 (2 ranks): PREMUL_SUM rejected asynchronously, "
    'float8 and int16 rejected even for all_gather ("Invalid scalar type"), uneven all_gather rejected',
}


class BackendRuleError(ValueError):
    """A call the emulated backend would reject (or gloo would corrupt); the message cites the rule."""


REDUCE_KINDS = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single"})


# [Note: the first batch on a group]
# torch 2.13's own ``batch_isend_irecv`` docstring (distributed_c10d.py, the
# wheel this project pins) still says: "if this API is the first collective
# call in the ``group`` passed to ``dist.P2POp``, all ranks of the ``group``
# must participate in this API call; otherwise, the behavior is undefined".
# The reason is in ``ProcessGroupNCCL::pointToPoint``: inside a batch
# (``ncclActiveGroupCounter_ > 0``) it selects the communicator "like a
# collective" (the device key, the whole group's communicator) rather than the
# two-rank one a single send uses, and creates it on first use, lazily, with
# ``ncclCommInitRank`` over every rank of the group, which blocks until all of
# them have called it. A collective on the group creates the same
# communicator. So under NCCL, unless the default group was bound to a device
# at ``init_process_group(device_id=...)`` (eager init; hp_core does not pass
# one), each rank of the group must reach a batch or a collective on the group
# before the first batch can complete; a rank that only does single sends, or
# nothing, on the group leaves the others hanging in the communicator's
# creation. The ``nccl-emu`` profile emulates exactly that: the first
# ``batch_isend_irecv`` of a test (or ``hp-run`` script) on a group waits until
# every member has joined the group by a batch or a collective, so the hang
# becomes a ``PeerFailedError`` or a ``DeadlockError`` naming the rule. Not
# applied to ``hccl-emu``: no source for HCCL's behaviour was found.
@dataclass(frozen=True)
class Profile:
    """One backend's rules. ``name`` is the marker value (``"nccl-emu"``)."""

    name: str
    device_type: str  # what hp_core.get_platform() reports
    backend: str  # the semantics hp_core's capability table uses
    reduce_ops: frozenset[str]
    reduce_dtypes: frozenset[torch.dtype] | None  # None: anything gloo reduces
    move_dtypes: frozenset[torch.dtype] | None
    reduce_source: str
    move_source: str
    contiguity: str  # "strict" (is_contiguous()) or "memory-format" (suggested format)
    contiguity_source: str
    uneven_all_gather: bool
    p2p_tags: bool
    recv_any_source: bool
    monitored_barrier: bool
    stream_ordered_p2p: bool  # NCCL/HCCL: p2p between a pair runs in issue order, blocking
    no_reduce_for: dict[str, frozenset[torch.dtype]] = field(default_factory=dict)
    first_batch_joins_group: bool = False  # [Note: the first batch on a group]

    @property
    def emulated(self) -> bool:
        return self.name != "gloo"


_INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
_FLOATS = frozenset({torch.float16, torch.float32, torch.float64, torch.bfloat16})
_COMPLEX = frozenset({torch.complex64, torch.complex128})

_NCCL_MOVE = frozenset(
    {torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, *_FLOATS, *_COMPLEX, *_FP8}
)
_HCCL_REDUCE = frozenset(
    {
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.bfloat16,
        torch.bool,
    }
)
_HCCL_REDUCE_350 = _HCCL_REDUCE | {torch.float64}
_HCCL_MOVE = frozenset({*_INTS, *_FLOATS, torch.bool})
#: ``HP_TEST_HCCL_SOC=a2`` applies the Atlas A2/A3 reduce dtypes (no float64); the default
#: follows the newest documented generation, where float64 reductions exist.
ENV_HCCL_SOC = "HP_TEST_HCCL_SOC"

PROFILES: dict[str, Profile] = {
    "gloo": Profile(
        name="gloo",
        device_type="cpu",
        backend="gloo",
        reduce_ops=frozenset({"sum", "avg", "max", "min", "product", "band", "bor", "bxor"}),
        reduce_dtypes=None,
        move_dtypes=frozenset({*_INTS - {torch.int16}, *_FLOATS, *_COMPLEX, torch.bool}),
        reduce_source="gloo-measured",
        move_source="gloo-measured",
        contiguity="memory-format",
        contiguity_source="gloo-noncontiguous",
        uneven_all_gather=False,
        p2p_tags=True,
        recv_any_source=True,
        monitored_barrier=True,
        stream_ordered_p2p=False,
    ),
    "nccl-emu": Profile(
        name="nccl-emu",
        device_type="cuda",
        backend="nccl",
        reduce_ops=frozenset({"sum", "avg", "max", "min", "product", "premul_sum"}),
        reduce_dtypes=_NCCL_MOVE - _FP8,
        move_dtypes=_NCCL_MOVE,
        reduce_source="nccl-fp8",
        move_source="nccl-types",
        contiguity="memory-format",
        contiguity_source="nccl-contiguous",
        uneven_all_gather=True,
        p2p_tags=False,
        recv_any_source=False,
        monitored_barrier=False,
        stream_ordered_p2p=True,
        first_batch_joins_group=True,
    ),
    "hccl-emu": Profile(
        name="hccl-emu",
        device_type="npu",
        backend="hccl",
        reduce_ops=frozenset({"sum", "max", "min", "product"}),
        reduce_dtypes=_HCCL_REDUCE_350,
        move_dtypes=_HCCL_MOVE,
        reduce_source="hccl-allreduce-350",
        move_source="hccl-types",
        contiguity="strict",
        contiguity_source="hccl-contiguous",
        uneven_all_gather=True,
        p2p_tags=False,
        recv_any_source=False,
        monitored_barrier=False,
        stream_ordered_p2p=True,
        no_reduce_for={"product": frozenset({torch.int16, torch.bfloat16})},
    ),
}


# [Note: why the gloo profile has rules too]
# gloo itself checks little: it reduces a non-contiguous view over the wrong
# elements and writes into its base, and a failed ``PREMUL_SUM`` or integer
# ``AVG`` breaks the group for every later collective. The ``gloo`` profile
# turns those into clear errors at the call site.
def get_profile(name: str) -> Profile:
    """The profile called ``name``; ``hccl-emu`` honours ``HP_TEST_HCCL_SOC=a2``."""
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown backend profile {name!r}; choose one of {sorted(PROFILES)}") from None
    if name == "hccl-emu" and os.environ.get(ENV_HCCL_SOC, "").strip().lower() in ("a2", "a3"):
        profile = replace(profile, reduce_dtypes=_HCCL_REDUCE, reduce_source="hccl-allreduce")
    return profile


def _fail(profile: Profile, call: Any, rule: str, fix: str, source: str) -> BackendRuleError:
    where = f" (called at {call.site})" if getattr(call, "site", "") else ""
    return BackendRuleError(
        f"{call.name}() under backend={profile.name!r}: {rule}{where}. Fix: {fix}. "
        f"[rule source: {SOURCES[source]}]"
    )


def _contiguous(profile: Profile, tensor: torch.Tensor) -> bool:
    if tensor.is_contiguous():
        return True
    if profile.contiguity == "strict":
        return False
    # NCCL checks contiguity in the tensor's suggested memory format, so a
    # dense channels-last tensor passes; a strided view with gaps does not.
    if tensor.dim() == 4:
        return tensor.is_contiguous(memory_format=torch.channels_last)
    if tensor.dim() == 5:
        return tensor.is_contiguous(memory_format=torch.channels_last_3d)
    return False


def check_call(profile: Profile, call: Any) -> None:
    """Raise :class:`BackendRuleError` if ``profile``'s backend would refuse ``call``."""
    for label, tensor in call.tensors():
        if tensor.layout != torch.strided:
            raise _fail(
                profile,
                call,
                f"{label} has layout {tensor.layout}",
                "pass a dense tensor (.to_dense())",
                profile.contiguity_source,
            )
        if not _contiguous(profile, tensor):
            raise _fail(
                profile,
                call,
                f"{label} is not contiguous (shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())})",
                "pass t.contiguous() and copy the result back into the view if the op is in place",
                profile.contiguity_source,
            )
    dtype = call.dtype
    if dtype is not None and dtype.is_complex:
        # torch hands complex tensors to every backend as real views (view_as_real, in the
        # Python wrappers and in ProcessGroupNCCL), so the backend's own dtype is the real one.
        dtype = dtype.to_real()
    if call.reduce_op is not None:
        op = call.reduce_op
        if op not in profile.reduce_ops:
            allowed = sorted(profile.reduce_ops)
            source = "torch-reduceop" if profile.backend != "hccl" else "hccl-allreduce"
            if profile.name == "gloo" and op == "premul_sum":
                source = "gloo-measured"
            raise _fail(
                profile,
                call,
                f"reduce op {op.upper()} is not supported by {profile.backend}",
                f"use one of {allowed}"
                + (
                    " (or hp_core.all_reduce(op='premul_sum'), which emulates it)"
                    if op == "premul_sum"
                    else ""
                ),
                source,
            )
        if dtype is not None and profile.reduce_dtypes is not None and dtype not in profile.reduce_dtypes:
            raise _fail(
                profile,
                call,
                f"dtype {dtype} cannot be reduced by {profile.backend}",
                f"reduce in one of {sorted(str(d) for d in profile.reduce_dtypes)} and cast back",
                profile.reduce_source,
            )
        banned = profile.no_reduce_for.get(op, frozenset())
        if dtype in banned:
            raise _fail(
                profile,
                call,
                f"op {op.upper()} does not support dtype {dtype}",
                "cast to float32 first",
                profile.reduce_source,
            )
    if dtype is not None and call.kind != "object":
        if profile.name == "gloo" and (dtype in _FP8 or dtype == torch.int16):
            carrier = torch.uint8 if dtype in _FP8 else torch.float16
            raise _fail(
                profile,
                call,
                f"gloo cannot move dtype {dtype} (it fails asynchronously and breaks the peers)",
                f"view it as {carrier} for the transfer (t.view({carrier})), or use hp_core's "
                "collectives, which carry every dtype",
                "gloo-measured",
            )
        if profile.move_dtypes is not None and dtype not in profile.move_dtypes:
            raise _fail(
                profile,
                call,
                f"dtype {dtype} is not a {profile.backend} data type",
                f"use one of {sorted(str(d) for d in profile.move_dtypes)}",
                profile.move_source,
            )
    if call.uneven and not profile.uneven_all_gather:
        raise _fail(
            profile,
            call,
            f"the tensors of an all_gather have different sizes {call.uneven}",
            "pad to the largest size or use hp_core.all_gather_into_tensor(..., input_sizes=...)",
            "gloo-measured",
        )
    if call.kind == "p2p" and call.peer is None and not profile.recv_any_source:
        raise _fail(
            profile,
            call,
            f"recv without src (any source) is not supported by {profile.backend}",
            "pass src=",
            "nccl-anysource",
        )
    if call.name == "monitored_barrier" and not profile.monitored_barrier:
        raise _fail(
            profile,
            call,
            f"monitored_barrier does not exist on {profile.backend}",
            "use barrier()",
            "torch-monitored-barrier",
        )

"""hp_dtensor over PyTorch's OpInfo database (2 ranks): [Note: the op_db sweep] in ``opdb_sweep.py``.

CI runs one sample of each op in :data:`CI_OPS` (the ops a training step
touches) under every placement of its first tensor, and checks the first
input's gradient on the Shard placements; ``HP_COMPOSITION=full`` runs every
float32 CPU op of op_db with three samples, every gradient checked. No case may be wrong,
come back a plain tensor, or differ between ranks; an error must be a
``NotImplementedError`` naming the op. Today's failures are listed in
:data:`KNOWN`, and the test fails when a known failure starts passing too, so
the table only shrinks. ``scripts/op_db_sweep.py`` is the same sweep with
torch's DTensor beside it and a table of the communication.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_dtensor import DTensor, Replicate

sys.path.insert(0, str(Path(__file__).parent))
from opdb_sweep import (
    CaseResult,
    SweepHang,
    failures,
    float32_cpu_ops,
    op_key,
    run_case,
    run_sweep,
)

FULL = os.environ.get("HP_COMPOSITION") == "full"

#: The covering subset: OpInfo names (``name.variant``) a training step touches.
CI_OPS = (
    # pointwise
    "add", "sub", "mul", "div.no_rounding_mode", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "tanh",
    "sigmoid", "abs", "clamp", "where", "lerp", "addcmul", "addcdiv", "masked_fill", "maximum", "erf",
    "reciprocal", "nan_to_num", "nn.functional.gelu", "nn.functional.silu", "nn.functional.relu",
    "nn.functional.hardswish", "nn.functional.prelu", "nn.functional.glu",
    # reductions
    "sum", "mean", "amax", "amin", "max.reduction_with_dim", "max.reduction_no_dim", "var", "std",
    "linalg.vector_norm", "logsumexp", "argmax", "cumsum", "all", "any", "prod",
    # norms, softmax
    "nn.functional.layer_norm", "nn.functional.rms_norm", "native_layer_norm", "nn.functional.group_norm",
    "nn.functional.normalize", "softmax", "log_softmax", "torch.ops.aten._safe_softmax.default",
    "nn.functional.batch_norm",
    # matmul family, attention
    "mm", "bmm", "addmm", "matmul", "nn.functional.linear", "baddbmm", "einsum", "mv", "dot", "outer",
    "addmv", "addr",
    "nn.functional.scaled_dot_product_attention",
    # views and shapes
    "view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "flatten", "split",
    "chunk", "cat", "stack", "narrow", "select", "unflatten", "contiguous", "clone", "repeat", "tril", "triu",
    "ravel", "view_as", "reshape_as", "repeat_interleave", "hstack", "vstack", "kron",
    # spatial (vision towers)
    "nn.functional.conv2d", "nn.functional.conv1d", "nn.functional.pad.constant",
    "nn.functional.max_pool2d", "nn.functional.avg_pool2d", "nn.functional.adaptive_avg_pool2d",
    "nn.functional.interpolate.bilinear", "nn.functional.interpolate.nearest", "nn.functional.pixel_shuffle",
    "nn.functional.grid_sample",
    # indexing
    "gather", "scatter", "scatter_add", "index_select", "index_add", "index_put", "take_along_dim",
    "nn.functional.embedding", "__getitem__",
    # losses
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.mse_loss",
    "nn.functional.l1_loss", "nn.functional.binary_cross_entropy_with_logits", "nn.functional.kl_div",
    # complex (rotary embeddings)
    "view_as_complex", "complex", "polar", "real", "conj", "angle",
    # foreach (optimizers)
    "_foreach_add", "_foreach_mul", "_foreach_addcmul", "_foreach_lerp", "_foreach_sqrt", "_foreach_norm",
    "_foreach_max",
)  # fmt: skip

#: Today's failures, by (OpInfo name, variant): reason. The test fails when one of these passes
#: again (remove it) and when an op not listed here fails (fix it, or list it with the reason).
#: Found by the full sweep (2 samples per op, values and gradients); none fails in CI's cases.
KNOWN: dict[tuple[str, str], str] = {
    ("tensor_split", ""): "a tensor of split indices is read as data in C++; torch's DTensor fails alike",
    ("to_sparse", ""): "sparse layouts are not supported (NotImplementedError naming aten._to_sparse)",
    ("linalg.matrix_rank", ""): "sample 1 (Replicate) returns a plain tensor; torch's DTensor too",
    ("linalg.matrix_rank", "hermitian"): "sample 1 (Replicate) returns a plain tensor; torch's DTensor too",
    ("as_strided_scatter", ""): (
        "torch's own autograd formula is the wrong reference: plain as_strided_scatter(x, s, (), (), 0) "
        "gives x.grad = grad at the overwritten element (should be 0); hp gives 0"
    ),
    ("max_pool2d_with_indices_backward", ""): (
        "the gradient is a plain tensor: torch's derivative formula builds it with a factory "
        "(aten.zeros) that no DTensor reaches; torch's DTensor alike"
    ),
    ("sgn", ""): "the gradient is a plain aten._efficientzerotensor from torch's formula; torch alike",
    ("nn.functional.linear_cross_entropy", "chunked_none"): (
        "the gradient is a plain tensor: torch's Python backward of the chunked op allocates with "
        "torch.empty and fills it from DTensors"
    ),
}
if FULL:  # sample 1 (Replicate) with its gradient: a case only the full sweep checks (repeat is in CI_OPS)
    KNOWN[("repeat", "")] = "an empty repeat's gradient is a plain aten.zeros from torch's formula"


def known_drift(
    failing: dict[str, list[CaseResult]], ran: set[str], known: dict[tuple[str, str], str]
) -> tuple[list[str], list[str]]:
    """(new failures, known failures that now pass), by op key, each with its evidence.

    A KNOWN entry counts as passing only if its op ran in this sweep: CI runs a subset.
    """
    known_keys = {
        f"{name}.{variant}" if variant else name: reason for (name, variant), reason in known.items()
    }
    new = [
        f"{key}: " + "; ".join(_evidence(r) for r in cases[:4])
        for key, cases in sorted(failing.items())
        if key not in known_keys
    ]
    fixed = [
        f"{key} (was: {reason})" for key, reason in known_keys.items() if key in ran and key not in failing
    ]
    return new, fixed


def _evidence(r: CaseResult) -> str:
    """One failing case in a line: the forward's class, or the gradient's when the forward passed."""
    if r.hp != "ok" or r.hp_grad in ("", "ok"):
        return f"s{r.sample} {r.placement} {r.hp}: {r.hp_detail[:160]}"
    return f"s{r.sample} {r.placement} grad {r.hp_grad}: {r.hp_grad_detail[:160]}"


def _ci_grad(key: str, placement: str) -> bool:
    """Whether CI checks this case's gradient: on Shard cases only.

    A backward from Replicate inputs is mostly each rank's plain backward;
    leaving it to the full sweep keeps CI within 2x of the forward-only run.
    """
    return placement != "R"


def _names(ops: list[Any]) -> dict[str, str]:
    return {op_key(op): op.name for op in ops}


@pytest.mark.distributed(world_size=2, timeout=7200 if FULL else 600)
def test_op_db(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    side = dist.new_group(backend="gloo")
    ops = float32_cpu_ops(None if FULL else CI_OPS)
    try:
        results, _ = run_sweep(
            ops, mesh, side, max_samples=3 if FULL else 1, with_torch=False, with_grad=FULL or _ci_grad
        )
    except SweepHang as hang:
        pytest.fail(f"{hang}: {hang.result.hp_detail} (a hang stops the sweep; fix it before anything else)")
    ran = {r.op for r in results}
    new, fixed = known_drift(failures(results, _names(ops)), ran, KNOWN)
    assert not new, "new op_db failures (fix, or add to KNOWN with the reason):\n" + "\n".join(new)
    assert not fixed, "KNOWN failures that now pass (remove them from KNOWN):\n" + "\n".join(fixed)
    if not FULL:  # every op of the subset must have been checked, or the list is lying
        missing = sorted({op_key(op) for op in ops} - ran)
        assert not missing, f"CI_OPS with no case run (no sample, or the plain call raised): {missing}"


# -- the sweep's classification catches planted faults ----------------------------------------


class _Planted:
    """An op-like callable with an OpInfo's name: right on plain tensors, ``fault`` on hp DTensors."""

    def __init__(self, name: str, fault: Any) -> None:
        self.name, self.variant_test_name, self._fault = name, "", fault

    def __call__(self, x: torch.Tensor) -> Any:
        if isinstance(x, DTensor):
            return self._fault(x)
        return x * 2


class _Sample:
    def __init__(self, x: torch.Tensor) -> None:
        self.input, self.args, self.kwargs = x, (), {}


def _hang(x: DTensor) -> Any:
    raise RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete")


def _not_implemented(x: DTensor) -> Any:
    raise NotImplementedError("hp_dtensor: no rule for aten.planted.default")


def _rank_one_raises(x: DTensor) -> Any:
    if dist.get_rank() == 1:
        raise ValueError("planted: rank 1 only")
    return x * 2


PLANTED = {
    "ok": lambda x: x * 2,
    "wrong": lambda x: x * 2 + 1,
    "not_dtensor": lambda x: x.full_tensor() * 2,
    "disagree": _rank_one_raises,
    "error": _not_implemented,
}


def _run_planted(
    cls: type, prefix: str, plants: dict[str, Any], mesh: Any, side: Any
) -> tuple[_Sample, list[tuple[str, CaseResult]]]:
    """(the sample, (planted kind, result) for every plant and placement of a (5, 3) sample)."""
    torch.manual_seed(0)
    sample = _Sample(torch.randn(5, 3))
    results = []
    for kind, fault in plants.items():
        op = cls(f"{prefix}_{kind}", fault)
        for placement in ("S(0)", "S(1)", "R"):
            r = run_case(op, sample, placement, mesh, side, key=op.name, index=0)
            assert r is not None
            results.append((kind, r))
    return sample, results


@pytest.mark.distributed(world_size=2)
def test_sweep_classifies_planted_faults(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    side = dist.new_group(backend="gloo")
    sample, results = _run_planted(_Planted, "planted", PLANTED, mesh, side)
    for kind, r in results:
        assert (r.hp, r.torch) == (kind, "ok"), (kind, r)
    results = [r for _, r in results]
    # CI's verdict: a NotImplementedError naming an aten op is accepted, every other class is not
    failing = failures(results, {})
    assert sorted(failing) == ["planted_disagree", "planted_not_dtensor", "planted_wrong"]
    with pytest.raises(SweepHang, match="planted_hang"):
        run_case(_Planted("planted_hang", _hang), sample, "S(0)", mesh, side, key="planted_hang", index=0)


def test_known_table_only_shrinks() -> None:
    wrong = CaseResult(op="a.v", sample=0, placement="S(0)", hp="wrong", hp_detail="mismatch")
    known = {("a", "v"): "today's bug", ("b", ""): "today's other bug"}
    # a listed failure that still fails, a listed one that was not run: nothing to say
    assert known_drift({"a.v": [wrong]}, {"a.v"}, known) == ([], [])
    # a failure not listed
    new, fixed = known_drift({"a.v": [wrong], "c": [wrong]}, {"a.v", "c"}, known)
    assert new == ["c: s0 S(0) wrong: mismatch"] and fixed == []
    # a listed failure that passes now
    assert known_drift({}, {"a.v"}, known) == ([], ["a.v (was: today's bug)"])


# -- the sweep's backward classification catches planted faults -------------------------------


class _Backward(torch.autograd.Function):
    """``x * 2`` whose backward is ``fault(grad_output)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fault: Any) -> torch.Tensor:
        ctx.fault = fault
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        return ctx.fault(grad), None


class _PlantedGrad(_Planted):
    """Right forward everywhere; on hp DTensors a backward of ``fault`` (plain: 2 * cotangent)."""

    supports_autograd = True

    def __call__(self, x: torch.Tensor) -> Any:
        if isinstance(x, DTensor):
            return _Backward.apply(x, self._fault)
        return x * 2


def _bwd_through_replicate(g: DTensor) -> Any:
    """Right, but gathers the gradient and cuts it again: communicates on a Shard case."""
    return g.redistribute(placements=[Replicate()]).redistribute(placements=g.placements) * 2


PLANTED_GRAD = {
    "ok": lambda g: g * 2,
    "wrong": lambda g: g * 3,
    "disagree": _rank_one_raises,  # the forward's faults, raised in the backward
    "error": _not_implemented,
}


@pytest.mark.distributed(world_size=2)
def test_sweep_classifies_planted_backward_faults(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    side = dist.new_group(backend="gloo")
    sample, results = _run_planted(_PlantedGrad, "planted_grad", PLANTED_GRAD, mesh, side)
    for kind, r in results:
        assert (r.hp, r.hp_grad, r.torch, r.torch_grad) == ("ok", kind, "ok", "ok"), (kind, r)
        assert r.hp_bwd_comms == 0 and r.torch_bwd_comms == 0, r
    results = [r for _, r in results]
    # CI rejects a bad gradient as it rejects a bad forward; a NotImplementedError naming an aten op passes
    assert sorted(failures(results, {})) == ["planted_grad_disagree", "planted_grad_wrong"]
    # the backward's collectives are counted, apart from the forward's
    op = _PlantedGrad("planted_grad_comms", _bwd_through_replicate)
    r = run_case(op, sample, "S(0)", mesh, side, key=op.name, index=0)
    assert r is not None and (r.hp, r.hp_grad, r.hp_comms) == ("ok", "ok", 0), r
    assert r.hp_bwd_comms > 0 and r.torch_bwd_comms == 0, r
    # without with_grad, or on an op without autograd, no gradient is checked
    r = run_case(
        _PlantedGrad("planted_grad_wrong", lambda g: g * 3),
        sample,
        "S(0)",
        mesh,
        side,
        key="w",
        index=0,
        with_grad=False,
    )
    assert r is not None and (r.hp_grad, r.torch_grad) == ("", ""), r
    r = run_case(
        _Planted("planted_no_autograd", lambda x: x * 2), sample, "S(0)", mesh, side, key="n", index=0
    )
    assert r is not None and (r.hp_grad, r.torch_grad) == ("", ""), r

"""hp_dtensor against PyTorch's OpInfo database: case generation, running, classification.

[Note: the op_db sweep]
``torch.testing._internal.common_methods_invocations.op_db`` describes every
public op with sample inputs. For each op that supports float32 on CPU, the
sweep takes the first N samples and, for each placement of the sample's first
tensor that fits a 1-D mesh (``Shard(d)`` on every dim of size >= 1, even or
not, and ``Replicate()``; every other tensor ``Replicate()``), runs the op on
hp_dtensor DTensors, on torch's DTensors built on the same process group
(``mesh.to_torch()``), and on plain tensors, which are the only reference:
torch's DTensor is itself wrong on a few uneven cases.

Each side of a case gets one class:

- ``ok``: every tensor output is a DTensor of that side whose ``full_tensor()``
  matches the plain result (the OpInfo's float32 tolerance overrides, else
  rtol = atol = 1e-5), and non-tensor outputs are equal;
- ``wrong``: a value (or the output structure) differs;
- ``not_dtensor``: a tensor output came back as a plain tensor;
- ``error``: the call raised (type and first line recorded);
- ``disagree``: the ranks got different outcomes (exception types, output
  layouts, or verdicts);
- ``hang``: a collective timed out (the process group's timeout is the watchdog).

Why the ranks compare outcomes before comparing values: ``full_tensor()`` is a
collective, so a rank that got a DTensor while its peer raised would block in
it. Every step therefore ends with an ``all_gather_object`` on a separate gloo
group (:func:`agree`): outcomes first, values only when the layouts agree.
After a hang the default group may hold a half-finished collective, so the
sweep stops (:class:`SweepHang`); a driver reruns it with the op denied.

Random ops and ops that return uninitialised memory are skipped
(:data:`NONDETERMINISTIC`): one process and a DTensor draw differently, so no
answer can be checked. Collectives are counted around the op call only: hp
with ``hp_testing.record_collectives`` (every hp_core tensor collective), torch
with ``CommDebugMode``. A fallback is recorded when hp warns that an op has
"no sharding rule"; hp warns once per aten op, so :func:`_forget_fallback_warnings`
resets that memory before each case when it can (``reset_fallback_stats``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import hp_dtensor
import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from hp_testing import record_collectives
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils import _pytree as pytree

__all__ = [
    "KINDS",
    "NONDETERMINISTIC",
    "CaseResult",
    "SweepHang",
    "agree",
    "float32_cpu_ops",
    "format_table",
    "op_key",
    "run_case",
    "run_sweep",
    "summarize",
]

KINDS = ("ok", "wrong", "not_dtensor", "error", "disagree", "hang")

#: Ops whose output cannot be checked against one process: random draws (a DTensor
#: draws per shard, one process draws once) and uninitialised memory. By OpInfo name;
#: ``feature_alpha_dropout.without_train`` is deterministic and stays in.
NONDETERMINISTIC = frozenset(
    {
        "bernoulli",
        "cauchy",
        "exponential",
        "geometric",
        "log_normal",
        "multinomial",
        "normal",
        "uniform",
        "rand_like",
        "randint",
        "randint_like",
        "randn",
        "randn_like",
        "nn.functional.alpha_dropout",
        "nn.functional.dropout",
        "nn.functional.dropout2d",
        "nn.functional.dropout3d",
        "nn.functional.feature_alpha_dropout.with_train",
        "nn.functional.fractional_max_pool2d",
        "nn.functional.fractional_max_pool3d",
        "nn.functional.rrelu",
        "svd_lowrank",
        "pca_lowrank",
        "empty",
        "empty_like",
        "empty_permuted",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "resize_as_",
    }
)

_TIMEOUT = re.compile(r"timed?[ _-]?out|timeout|deadline", re.IGNORECASE)
_DEFAULT_TOL = (1e-5, 1e-5)
_RAISED = object()
# The foreach ops live in their own lists beside op_db; their samples are lists of tensors.
_FOREACH_DBS = ("unary", "binary", "pointwise", "reduce", "other")


class SweepHang(RuntimeError):
    """A collective timed out: the default group cannot be trusted, so the sweep stops here."""

    def __init__(self, result: CaseResult) -> None:
        super().__init__(f"hang in {result.op} sample {result.sample} {result.placement}")
        self.result = result


@dataclass
class CaseResult:
    """The outcome of one (op, sample, placement) case, for hp and for torch's DTensor."""

    op: str
    sample: int
    placement: str
    hp: str
    hp_detail: str = ""
    hp_comms: int = 0
    fallback: bool = False
    torch: str = ""
    torch_detail: str = ""
    torch_comms: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def op_key(op: Any) -> str:
    """``name`` or ``name.variant``: how the sweep, the KNOWN table and the report name an OpInfo."""
    variant = getattr(op, "variant_test_name", "")
    return f"{op.name}.{variant}" if variant else op.name


def float32_cpu_ops(names: Iterable[str] | None = None) -> list[Any]:
    """The OpInfos that support float32 on CPU (all, or those whose :func:`op_key` or name is in ``names``).

    An unknown name raises, naming it: a typo would otherwise shrink a sweep silently.
    """
    from torch.testing._internal import common_methods_invocations as db

    every = itertools.chain(db.op_db, *(getattr(db, f"foreach_{kind}_op_db", ()) for kind in _FOREACH_DBS))
    ops = [op for op in every if torch.float32 in op.supported_dtypes("cpu")]
    if names is None:
        return ops
    wanted = list(names)
    keys = {op_key(op) for op in ops}
    # an exact key picks one op; a bare name that is no key picks all its variants ("div")
    chosen = [op for op in ops if op_key(op) in wanted or (op.name in wanted and op.name not in keys)]
    found = {op_key(op) for op in chosen} | {op.name for op in chosen}
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ValueError(
            f"op_db has no float32 CPU op named {missing}; names are OpInfo names with the variant "
            "after a dot (e.g. 'div.no_rounding_mode'), as float32_cpu_ops() lists them."
        )
    return chosen


def _tolerance(op: Any) -> tuple[float, float]:
    """(rtol, atol): the loosest float32 override among the OpInfo's decorators, at least 1e-5 each."""
    rtol, atol = _DEFAULT_TOL
    for info in itertools.chain(getattr(op, "decorators", ()) or (), getattr(op, "skips", ()) or ()):
        for deco in getattr(info, "decorators", ()) or ():
            overrides = getattr(deco, "d", None)
            tol = overrides.get(torch.float32) if isinstance(overrides, dict) else None
            if hasattr(tol, "rtol") and hasattr(tol, "atol"):  # toleranceOverride's tol; other dicts exist
                rtol, atol = max(rtol, float(tol.rtol)), max(atol, float(tol.atol))
    return rtol, atol


def _leaves(sample: Any) -> tuple[list[Any], Any]:
    return pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))


def _placements_for(sample: Any) -> list[str]:
    """``S(d)`` for each dim of the first tensor of size >= 1, then ``R``; [] when no tensor is strided."""
    leaves, _ = _leaves(sample)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors or any(t.layout != torch.strided or t.is_meta for t in tensors):
        return []
    first = tensors[0]
    return [f"S({d})" for d in range(first.dim()) if first.shape[d] >= 1] + ["R"]


def _clone_args(leaves: list[Any], spec: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    fresh = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    return pytree.tree_unflatten(fresh, spec)


def _distributed_args(
    leaves: list[Any],
    spec: Any,
    placement: str,
    wrap: Callable[[torch.Tensor, int | None], Any],
    every: bool = False,
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The sample's arguments with every tensor made a DTensor by ``wrap(t, shard_dim or None)``.

    The first tensor takes ``placement``, the others ``Replicate()``; with
    ``every`` (foreach ops, whose lists hold a model's parameters and their
    optimizer states cut alike) every tensor that has the dim is cut too.
    """
    shard = int(placement[2:-1]) if placement.startswith("S(") else None
    out, first = [], True
    for x in leaves:
        if isinstance(x, torch.Tensor):
            cut = shard if first or (every and shard is not None and x.dim() > shard) else None
            out.append(wrap(x.clone(), cut))
            first = False
        else:
            out.append(x)
    return pytree.tree_unflatten(out, spec)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:300]


def agree(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``value``, gathered over the side ``group`` (gloo; never the group under test)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


@dataclass
class _Side:
    """One side of a case (hp or torch): what it returned or raised, and what it sent."""

    output: Any = None
    raised: BaseException | None = None
    comms: int = 0
    fallback: bool = False
    no_reference: bool = False

    def shape_of_outcome(self, dtensor_type: type) -> Any:
        """What the ranks must agree on before values are compared: exception type or output layouts."""
        if self.no_reference:
            return ("no_reference",)
        if self.raised is not None:
            kind = "hang" if _TIMEOUT.search(str(self.raised)) else "raised"
            return (kind, type(self.raised).__name__, _first_line(self.raised))
        leaves, spec = pytree.tree_flatten(self.output)
        described = []
        for x in leaves:
            if isinstance(x, dtensor_type):
                described.append(("dt", tuple(str(p) for p in x.placements), tuple(x.shape)))
            elif isinstance(x, torch.Tensor):
                described.append(("plain", tuple(x.shape)))
            else:
                described.append(("value", type(x).__name__))
        return ("returned", str(spec), tuple(described))


def _forget_fallback_warnings() -> None:
    """Let hp warn again for ops it already warned about, so each case sees its own fallbacks.

    hp_dtensor's ``reset_fallback_stats()`` where it exists (it also forgets the
    warned ops); before it, the set ``hp_dtensor.ops.dispatch._warned``. With
    neither, fallbacks show on the first case of each aten op only.
    """
    reset = getattr(hp_dtensor, "reset_fallback_stats", None)
    if reset is not None:
        reset()
        return
    from hp_dtensor.ops import dispatch

    seen = getattr(dispatch, "_warned", None)
    if isinstance(seen, set):
        seen.clear()


def _fell_back(caught: Sequence[warnings.WarningMessage]) -> bool:
    """Whether the op just run took hp's replicated fallback: its stats, else its warning's text."""
    stats = getattr(hp_dtensor, "fallback_stats", None)
    if stats is not None and stats():
        return True
    return any("no sharding rule" in str(w.message).lower() for w in caught)


def _run_hp(
    op: Callable[..., Any], leaves: list[Any], spec: Any, placement: str, mesh: Any, every: bool
) -> _Side:
    side = _Side()
    _forget_fallback_warnings()

    def wrap(t: torch.Tensor, shard: int | None) -> Any:
        where = hp_dtensor.Shard(shard) if shard is not None else hp_dtensor.Replicate()
        return hp_dtensor.distribute_tensor(t, mesh, [where], src_data_rank=None)

    try:
        args = _distributed_args(leaves, spec, placement, wrap, every)
        with warnings.catch_warnings(record=True) as caught, record_collectives() as log:
            warnings.simplefilter("always")
            side.output = op(args[0], *args[1], **args[2])
        side.comms = len(log)
        side.fallback = _fell_back(caught)
    except Exception as exc:
        side.raised = exc
    return side


def _run_torch(
    op: Callable[..., Any], leaves: list[Any], spec: Any, placement: str, mesh: Any, every: bool
) -> _Side:
    side = _Side()
    torch_mesh = mesh.to_torch()

    def wrap(t: torch.Tensor, shard: int | None) -> Any:
        where = tdt.Shard(shard) if shard is not None else tdt.Replicate()
        return tdt.distribute_tensor(t, torch_mesh, [where], src_data_rank=None)

    try:
        args = _distributed_args(leaves, spec, placement, wrap, every)
        with warnings.catch_warnings(), CommDebugMode() as comm:
            warnings.simplefilter("ignore")
            side.output = op(args[0], *args[1], **args[2])
        side.comms = int(comm.get_total_counts())
    except Exception as exc:
        side.raised = exc
    return side


def _verdict(side: _Side, reference: Any, dtensor_type: type, tol: tuple[float, float]) -> tuple[str, str]:
    """(class, detail) of a side whose ranks agree on the outcome; may communicate (full_tensor)."""
    got, got_spec = pytree.tree_flatten(side.output)
    want, want_spec = pytree.tree_flatten(reference)
    if len(got) != len(want):
        return "wrong", f"output structure {got_spec} != {want_spec}"
    plain = [
        i
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if isinstance(w, torch.Tensor) and not isinstance(g, dtensor_type)
    ]
    worst: tuple[str, str] | None = None
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(g, dtensor_type):
            g = g.full_tensor()  # every rank reaches here with the same layouts (see agree)
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            worst = worst or (
                "wrong",
                f"output {i}: {type(g).__name__} where one process gives {type(w).__name__}",
            )
            continue
        if isinstance(w, torch.Tensor):
            try:
                torch.testing.assert_close(g, w, rtol=tol[0], atol=tol[1], equal_nan=True, check_device=False)
            except AssertionError as exc:
                lines = [line for line in str(exc).splitlines() if line.strip()]
                worst = worst or ("wrong", f"output {i}: " + " / ".join(lines[:3])[:300])
        elif not _same_value(g, w, tol):
            worst = worst or ("wrong", f"output {i}: {g!r} != {w!r}"[:300])
    if plain:
        return "not_dtensor", f"outputs {plain} are plain tensors" + (f"; also {worst[1]}" if worst else "")
    return worst or ("ok", "")


def _same_value(got: Any, want: Any, tol: tuple[float, float]) -> bool:
    if isinstance(want, float) and isinstance(got, (float, int)):
        if math.isnan(want):
            return math.isnan(got)
        return math.isclose(got, want, rel_tol=tol[0], abs_tol=tol[1])
    return bool(got == want)


def _settle(
    side: _Side, reference: Any, dtensor_type: type, tol: tuple[float, float], group: dist.ProcessGroup
) -> tuple[str, str]:
    """One side's class, agreed by every rank (two side-group gathers, values only if layouts agree).

    ``skip`` when some rank had no reference (the plain call raised).
    """
    outcomes = agree(side.shape_of_outcome(dtensor_type), group)
    if any(o[0] == "no_reference" for o in outcomes):
        return "skip", "the plain call raised"
    if any(o[0] == "hang" for o in outcomes):
        return "hang", next(f"{o[1]}: {o[2]}" for o in outcomes if o[0] == "hang")
    if any(o != outcomes[0] for o in outcomes):
        return "disagree", " | ".join(f"rank {r}: {_describe(o)}" for r, o in enumerate(outcomes))[:600]
    if outcomes[0][0] == "raised":
        return "error", f"{outcomes[0][1]}: {outcomes[0][2]}"
    try:
        local = _verdict(side, reference, dtensor_type, tol)
    except Exception as exc:
        kind = "hang" if _TIMEOUT.search(str(exc)) else "error"
        local = (kind, f"comparing: {type(exc).__name__}: {_first_line(exc)}")
    verdicts = agree(local, group)
    if any(v[0] == "hang" for v in verdicts):
        return next(v for v in verdicts if v[0] == "hang")
    if any(v[0] != verdicts[0][0] for v in verdicts):
        return "disagree", " | ".join(f"rank {r}: {v[0]} {v[1]}" for r, v in enumerate(verdicts))[:600]
    return verdicts[0]


def _describe(outcome: Any) -> str:
    if outcome[0] == "returned":
        return "returned " + ", ".join(str(x) for x in outcome[2])
    return f"{outcome[1]}: {outcome[2]}"


def run_case(
    op: Callable[..., Any],
    sample: Any,
    placement: str,
    mesh: Any,
    group: dist.ProcessGroup,
    *,
    key: str,
    index: int,
    tol: tuple[float, float] = _DEFAULT_TOL,
    with_torch: bool = True,
) -> CaseResult | None:
    """Run one case on plain tensors, hp DTensors and torch DTensors; None if the plain call raises.

    Every rank must call it with the same arguments (same seed). Without
    ``with_torch`` torch's side is not run (its class stays ""). Raises
    :class:`SweepHang` after recording a hang on hp's side or torch's.
    """
    leaves, spec = _leaves(sample)
    try:
        args = _clone_args(leaves, spec)
        reference = op(args[0], *args[1], **args[2])
    except Exception:
        reference = _RAISED
    result = CaseResult(op=key, sample=index, placement=placement, hp="")
    every = key.startswith("_foreach")
    # Invalid samples for this dtype/device have no reference: the ranks learn it in the first gather.
    if reference is _RAISED:
        hp_side = _Side(no_reference=True)
    else:
        hp_side = _run_hp(op, leaves, spec, placement, mesh, every)
    result.hp, result.hp_detail = _settle(hp_side, reference, hp_dtensor.DTensor, tol, group)
    if result.hp == "skip":
        return None
    result.hp_comms, result.fallback = hp_side.comms, hp_side.fallback
    if result.hp == "hang":
        raise SweepHang(result)
    if not with_torch:
        return result
    torch_side = _run_torch(op, leaves, spec, placement, mesh, every)
    result.torch, result.torch_detail = _settle(torch_side, reference, tdt.DTensor, tol, group)
    result.torch_comms = torch_side.comms
    if result.torch == "hang":
        raise SweepHang(result)
    return result


def cases(op: Any, max_samples: int, seed: int = 0) -> Iterator[tuple[int, Any, str]]:
    """(sample index, sample, placement) for the first ``max_samples`` samples, the same on every rank."""
    torch.manual_seed(seed)
    samples = list(itertools.islice(op.sample_inputs("cpu", torch.float32), max_samples))
    for index, sample in enumerate(samples):
        for placement in _placements_for(sample):
            yield index, sample, placement


def run_sweep(
    ops: Sequence[Any],
    mesh: Any,
    group: dist.ProcessGroup,
    *,
    max_samples: int = 1,
    deny: Iterable[str] = (),
    on_result: Callable[[CaseResult], None] | None = None,
    with_torch: bool = True,
) -> tuple[list[CaseResult], list[str]]:
    """Run every case of ``ops`` (minus random ops and ``deny``); returns (results, skipped op notes).

    Raises :class:`SweepHang` (its ``result`` is the hung case) after a hang.
    """
    denied = set(deny)
    results: list[CaseResult] = []
    skipped: list[str] = []
    for op in ops:
        key = op_key(op)
        if key in NONDETERMINISTIC or op.name in NONDETERMINISTIC:
            skipped.append(f"{key}: random or uninitialised output")
            continue
        if key in denied:
            skipped.append(f"{key}: denied (hung earlier)")
            continue
        tol = _tolerance(op)
        try:
            todo = list(cases(op, max_samples))
        except Exception as exc:
            skipped.append(f"{key}: sample_inputs raised {type(exc).__name__}: {_first_line(exc)}")
            continue
        if not todo:
            skipped.append(f"{key}: no sample with a strided tensor input")
        for index, sample, placement in todo:
            result = run_case(
                op, sample, placement, mesh, group, key=key, index=index, tol=tol, with_torch=with_torch
            )
            if result is not None:
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results, skipped


def summarize(results: Sequence[CaseResult]) -> dict[str, Any]:
    """The figures of the table and of the last JSON line."""
    both_ok = [r for r in results if r.placement.startswith("S(") and r.hp == "ok" and r.torch == "ok"]
    hp_only = sorted({r.op for r in both_ok if r.hp_comms > 0 and r.torch_comms == 0})
    return {
        "cases": len(results),
        "ops": len({r.op for r in results}),
        "hp": {k: sum(r.hp == k for r in results) for k in KINDS},
        "torch": {k: sum(r.torch == k for r in results) for k in KINDS},
        "hp_fallback_cases": sum(r.fallback for r in results),
        "shard_both_ok": len(both_ok),
        "shard_hp_communicates": sum(r.hp_comms > 0 for r in both_ok),
        "shard_torch_communicates": sum(r.torch_comms > 0 for r in both_ok),
        "ops_hp_communicates_torch_not": hp_only,
    }


def format_table(summary: dict[str, Any]) -> str:
    """A readable table of :func:`summarize`'s figures."""
    lines = [f"{summary['cases']} cases over {summary['ops']} ops", f"{'class':<12} {'hp':>6} {'torch':>6}"]
    lines += [f"{k:<12} {summary['hp'][k]:>6} {summary['torch'][k]:>6}" for k in KINDS]
    lines.append(f"hp cases through the fallback: {summary['hp_fallback_cases']}")
    lines.append(
        f"Shard cases ok on both: {summary['shard_both_ok']}; hp communicates in "
        f"{summary['shard_hp_communicates']}, torch in {summary['shard_torch_communicates']}"
    )
    lines.append(
        "ops where hp communicates and torch does not: "
        + (", ".join(summary["ops_hp_communicates_torch_not"]) or "none")
    )
    return "\n".join(lines)


def failures(results: Sequence[CaseResult], op_names: dict[str, str]) -> dict[str, list[CaseResult]]:
    """Per op key, the hp cases CI rejects: any class but ok, except a NotImplementedError naming the op.

    ``op_names`` maps an op key to the names its error may use (the OpInfo name's last part).
    """
    bad: dict[str, list[CaseResult]] = {}
    for r in results:
        if r.hp == "ok" or (r.hp == "error" and _names_op(r.hp_detail, op_names.get(r.op, r.op))):
            continue
        bad.setdefault(r.op, []).append(r)
    return bad


def _names_op(detail: str, name: str) -> bool:
    if not detail.startswith("NotImplementedError"):
        return False
    return "aten." in detail or name.split(".")[-1] in detail


def counts_by_kind(results: Sequence[CaseResult]) -> Counter[str]:
    """hp classes of ``results``, for short messages."""
    return Counter(r.hp for r in results)

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

The backward: for an op whose OpInfo ``supports_autograd`` and whose first
tensor is floating, each side whose forward is ``ok`` runs the op again with
that first tensor requiring grad, then ``torch.autograd.backward`` with one
fixed random cotangent per differentiable output (:data:`GRAD_SEED`, drawn
from its own generator, so every rank and every side gets the same one; on a
DTensor output it takes the output's placements, a ``Partial`` read as
``Replicate``, cut locally). The first tensor's gradient (``full_tensor()``) is
compared with plain autograd's and classed as above (``hp_grad`` /
``torch_grad``; "" when not checked: no autograd, the forward not ok, or no
plain gradient). Only the backward call is counted (``hp_bwd_comms``,
``torch_bwd_comms``, ``bwd_fallback``). The ranks agree on the forward's
outcome before the backward (a collective) and on the gradient's layout
before ``full_tensor()``, as for the forward.
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
    "GRAD_SEED",
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

#: Seed of the backward's cotangents: fixed, so every rank and every side draws the same ones.
GRAD_SEED = 25

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
    hp_grad: str = ""
    hp_grad_detail: str = ""
    hp_bwd_comms: int = 0
    bwd_fallback: bool = False
    torch_grad: str = ""
    torch_grad_detail: str = ""
    torch_bwd_comms: int = 0

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


@dataclass(frozen=True)
class _Flavour:
    """What differs between hp's DTensor and torch's: how to cut a tensor, its type, how to count."""

    dtensor_type: type
    wrap: Callable[[torch.Tensor, int | None], Any]
    like: Callable[[torch.Tensor, Any], Any]  # a full tensor cut as a DTensor output is (Partial as R)
    is_hp: bool

    def counting(self) -> Any:
        return record_collectives() if self.is_hp else CommDebugMode()

    def count(self, counter: Any) -> int:
        return len(counter) if self.is_hp else int(counter.get_total_counts())


def _flavour(lib: Any, mesh: Any, is_hp: bool) -> _Flavour:
    """A side built from ``lib`` (``hp_dtensor`` or ``torch.distributed.tensor``: same names) on ``mesh``."""

    def wrap(t: torch.Tensor, shard: int | None) -> Any:
        where = lib.Shard(shard) if shard is not None else lib.Replicate()
        return lib.distribute_tensor(t, mesh, [where], src_data_rank=None)

    def like(t: torch.Tensor, out: Any) -> Any:
        where = [lib.Replicate() if p.is_partial() else p for p in out.placements]
        return lib.distribute_tensor(t, out.device_mesh, where, src_data_rank=None)

    return _Flavour(lib.DTensor, wrap, like, is_hp=is_hp)


def _run_side(
    op: Callable[..., Any], leaves: list[Any], spec: Any, placement: str, flavour: _Flavour, every: bool
) -> _Side:
    side = _Side()
    if flavour.is_hp:
        _forget_fallback_warnings()
    try:
        args = _distributed_args(leaves, spec, placement, flavour.wrap, every)
        with warnings.catch_warnings(record=True) as caught, flavour.counting() as counter:
            warnings.simplefilter("always" if flavour.is_hp else "ignore")
            side.output = op(args[0], *args[1], **args[2])
        side.comms = flavour.count(counter)
        side.fallback = flavour.is_hp and _fell_back(caught)
    except Exception as exc:
        side.raised = exc
    return side


# -- the backward ---------------------------------------------------------------------------------


@dataclass
class _PlainGrad:
    """Plain autograd's answer: the output leaves given a cotangent, the cotangents, the first grad."""

    indices: list[int]
    cotangents: list[torch.Tensor]
    grad: torch.Tensor


def _first_tensor(args: Any) -> torch.Tensor:
    return next(x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor))


def _grad_wanted(op: Any, leaves: list[Any]) -> bool:
    """Whether the case checks a gradient: the OpInfo supports autograd and its first tensor is floating."""
    if not getattr(op, "supports_autograd", False):
        return False
    first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
    return first is not None and first.is_floating_point()


def _plain_grad(op: Callable[..., Any], leaves: list[Any], spec: Any) -> _PlainGrad | None:
    """The reference gradient of the first input, or None when plain autograd gives none (or raises).

    Every rank computes the same thing locally, so the ranks agree on None without a gather.
    """
    try:
        args = _clone_args(leaves, spec)
        first = _first_tensor(args).requires_grad_(True)
        outputs = pytree.tree_leaves(op(args[0], *args[1], **args[2]))
        generator = torch.Generator().manual_seed(GRAD_SEED)
        indices, cotangents = [], []
        for i, out in enumerate(outputs):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                indices.append(i)
                cotangents.append(torch.randn(out.shape, dtype=out.dtype, generator=generator))
        if not indices:
            return None
        torch.autograd.backward([outputs[i] for i in indices], cotangents)
    except Exception:
        return None
    return None if first.grad is None else _PlainGrad(indices, cotangents, first.grad)


def _grad_forward(
    op: Callable[..., Any], leaves: list[Any], spec: Any, placement: str, flavour: _Flavour, every: bool
) -> tuple[_Side, torch.Tensor | None]:
    """The forward again, its first DTensor requiring grad: (outcome, that DTensor)."""
    side, first = _Side(), None
    try:
        args = _distributed_args(leaves, spec, placement, flavour.wrap, every)
        first = _first_tensor(args).requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            side.output = op(args[0], *args[1], **args[2])
    except Exception as exc:
        side.raised = exc
    return side, first


def _grad_backward(forward: _Side, first: Any, plain: _PlainGrad, flavour: _Flavour) -> _Side:
    """Backward of ``forward``'s output with the plain cotangents; the side's output is ``first.grad``."""
    side = _Side()
    try:
        outputs = pytree.tree_leaves(forward.output)
        roots = [outputs[i] for i in plain.indices]
        cotangents = [
            flavour.like(c, r) if isinstance(r, flavour.dtensor_type) else c
            for c, r in zip(plain.cotangents, roots, strict=True)
        ]
        if flavour.is_hp:
            _forget_fallback_warnings()
        with warnings.catch_warnings(record=True) as caught, flavour.counting() as counter:
            warnings.simplefilter("always" if flavour.is_hp else "ignore")
            torch.autograd.backward(roots, cotangents)
        side.comms = flavour.count(counter)
        side.fallback = flavour.is_hp and _fell_back(caught)
        side.output = first.grad
        if first.grad is None:
            side.raised = RuntimeError("the first input got no gradient where plain autograd gives one")
    except Exception as exc:
        side.raised = exc
    return side


def _settle_grad(
    op: Callable[..., Any],
    leaves: list[Any],
    spec: Any,
    placement: str,
    flavour: _Flavour,
    every: bool,
    plain: _PlainGrad,
    tol: tuple[float, float],
    group: dist.ProcessGroup,
) -> tuple[str, str, _Side]:
    """(class, detail, backward side) of one side's gradient, agreed by every rank.

    The ranks agree on the forward's outcome before the backward runs, since
    the backward communicates and a rank whose forward raised would leave its
    peer waiting.
    """
    forward, first = _grad_forward(op, leaves, spec, placement, flavour, every)
    outcomes = agree(forward.shape_of_outcome(flavour.dtensor_type), group)
    if any(o != outcomes[0] for o in outcomes):
        detail = " | ".join(f"rank {r}: {_describe(o)}" for r, o in enumerate(outcomes))
        return "disagree", ("forward with grad: " + detail)[:600], _Side()
    if outcomes[0][0] != "returned":
        return (
            outcomes[0][0].replace("raised", "error"),
            f"forward with grad: {_describe(outcomes[0])}",
            _Side(),
        )
    backward = _grad_backward(forward, first, plain, flavour)
    kind, detail = _settle(backward, plain.grad, flavour.dtensor_type, tol, group)
    return kind, detail, backward


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
    with_grad: bool = True,
) -> CaseResult | None:
    """Run one case on plain tensors, hp DTensors and torch DTensors; None if the plain call raises.

    Every rank must call it with the same arguments (same seed). Without
    ``with_torch`` torch's side is not run (its class stays ""); without
    ``with_grad`` no gradient is checked (both grad classes stay ""). Raises
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
    hp = _flavour(hp_dtensor, mesh, is_hp=True)
    if reference is _RAISED:
        hp_side = _Side(no_reference=True)
    else:
        hp_side = _run_side(op, leaves, spec, placement, hp, every)
    result.hp, result.hp_detail = _settle(hp_side, reference, hp.dtensor_type, tol, group)
    if result.hp == "skip":
        return None
    result.hp_comms, result.fallback = hp_side.comms, hp_side.fallback
    if result.hp == "hang":
        raise SweepHang(result)
    plain = _plain_grad(op, leaves, spec) if with_grad and _grad_wanted(op, leaves) else None
    if plain is not None and result.hp == "ok":
        result.hp_grad, result.hp_grad_detail, back = _settle_grad(
            op, leaves, spec, placement, hp, every, plain, tol, group
        )
        result.hp_bwd_comms, result.bwd_fallback = back.comms, back.fallback
        if result.hp_grad == "hang":
            raise SweepHang(result)
    if not with_torch:
        return result
    theirs = _flavour(tdt, mesh.to_torch(), is_hp=False)
    torch_side = _run_side(op, leaves, spec, placement, theirs, every)
    result.torch, result.torch_detail = _settle(torch_side, reference, theirs.dtensor_type, tol, group)
    result.torch_comms = torch_side.comms
    if result.torch == "hang":
        raise SweepHang(result)
    if plain is not None and result.torch == "ok":
        result.torch_grad, result.torch_grad_detail, back = _settle_grad(
            op, leaves, spec, placement, theirs, every, plain, tol, group
        )
        result.torch_bwd_comms = back.comms
        if result.torch_grad == "hang":
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
    with_grad: bool | Callable[[str, str], bool] = True,
) -> tuple[list[CaseResult], list[str]]:
    """Run every case of ``ops`` (minus random ops and ``deny``); returns (results, skipped op notes).

    ``with_grad`` checks gradients on every case, none, or those for which
    ``with_grad(op key, placement)`` is true (a cheaper subset for CI).

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
            grad = with_grad(key, placement) if callable(with_grad) else with_grad
            result = run_case(
                op,
                sample,
                placement,
                mesh,
                group,
                key=key,
                index=index,
                tol=tol,
                with_torch=with_torch,
                with_grad=grad,
            )
            if result is not None:
                results.append(result)
                if on_result is not None:
                    on_result(result)
    return results, skipped


def summarize(results: Sequence[CaseResult]) -> dict[str, Any]:
    """The figures of the table and of the last JSON line (the backward's under keys of their own)."""
    both_ok = [r for r in results if r.placement.startswith("S(") and r.hp == "ok" and r.torch == "ok"]
    hp_only = sorted({r.op for r in both_ok if r.hp_comms > 0 and r.torch_comms == 0})
    grads_ok = [
        r for r in results if r.placement.startswith("S(") and r.hp_grad == "ok" and r.torch_grad == "ok"
    ]
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
        "grad_cases": sum(bool(r.hp_grad or r.torch_grad) for r in results),
        "hp_grad": {k: sum(r.hp_grad == k for r in results) for k in KINDS},
        "torch_grad": {k: sum(r.torch_grad == k for r in results) for k in KINDS},
        "hp_bwd_fallback_cases": sum(r.bwd_fallback for r in results),
        "ops_bwd_fallback": sorted({r.op for r in results if r.bwd_fallback}),
        "shard_both_grad_ok": len(grads_ok),
        "shard_hp_bwd_communicates": sum(r.hp_bwd_comms > 0 for r in grads_ok),
        "shard_torch_bwd_communicates": sum(r.torch_bwd_comms > 0 for r in grads_ok),
        "ops_hp_bwd_communicates_torch_not": sorted(
            {r.op for r in grads_ok if r.hp_bwd_comms > 0 and r.torch_bwd_comms == 0}
        ),
        "ops_hp_grad_wrong": sorted(
            {r.op for r in results if r.hp_grad in ("wrong", "disagree", "not_dtensor")}
        ),
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
    lines.append(f"backward: {summary['grad_cases']} cases with a gradient checked")
    lines.append(f"{'grad class':<12} {'hp':>6} {'torch':>6}")
    lines += [f"{k:<12} {summary['hp_grad'][k]:>6} {summary['torch_grad'][k]:>6}" for k in KINDS]
    lines.append(
        f"hp backward cases through the fallback: {summary['hp_bwd_fallback_cases']}; ops: "
        + (", ".join(summary["ops_bwd_fallback"]) or "none")
    )
    lines.append(
        f"Shard cases with both gradients ok: {summary['shard_both_grad_ok']}; hp's backward communicates in "
        f"{summary['shard_hp_bwd_communicates']}, torch's in {summary['shard_torch_bwd_communicates']}"
    )
    lines.append(
        "ops where hp's backward communicates and torch's does not: "
        + (", ".join(summary["ops_hp_bwd_communicates_torch_not"]) or "none")
    )
    lines.append("ops with a wrong hp gradient: " + (", ".join(summary["ops_hp_grad_wrong"]) or "none"))
    return "\n".join(lines)


def failures(results: Sequence[CaseResult], op_names: dict[str, str]) -> dict[str, list[CaseResult]]:
    """Per op key, the hp cases CI rejects: any class but ok, except a NotImplementedError naming the op.

    The gradient is judged alike (unchecked counts as passing). ``op_names``
    maps an op key to the names its error may use (the OpInfo name's last part).
    """
    bad: dict[str, list[CaseResult]] = {}
    for r in results:
        name = op_names.get(r.op, r.op)
        forward_ok = r.hp == "ok" or (r.hp == "error" and _names_op(r.hp_detail, name))
        grad_ok = r.hp_grad in ("", "ok") or (r.hp_grad == "error" and _names_op(r.hp_grad_detail, name))
        if not (forward_ok and grad_ok):
            bad.setdefault(r.op, []).append(r)
    return bad


def _names_op(detail: str, name: str) -> bool:
    if not detail.startswith("NotImplementedError"):
        return False
    return "aten." in detail or name.split(".")[-1] in detail


def counts_by_kind(results: Sequence[CaseResult]) -> Counter[str]:
    """hp classes of ``results``, for short messages."""
    return Counter(r.hp for r in results)

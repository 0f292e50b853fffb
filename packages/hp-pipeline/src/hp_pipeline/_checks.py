"""Up-front argument checks shared by the public entry points, before anything runs.

Each helper raises a ``TypeError`` or ``ValueError`` that names the argument,
the value it saw and what to pass instead, before the caller changes any
state or any rank communicates. They run once per call of a constructor or a
pass, never per compute step.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from hp_pipeline.costs import StepCosts

__all__: list[str] = []


def type_name(value: object) -> str:
    """The type of ``value`` as an error message writes it."""
    return type(value).__name__


def check_bool(where: str, name: str, value: object) -> None:
    """A flag must be a real bool: ``"no"`` and ``0`` would otherwise read as a silent choice."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name}={value!r} is a {type_name(value)}, not a bool; pass True or False")


def check_int(where: str, name: str, value: object, *, least: int, allow_none: bool = False) -> None:
    """An int ``>= least`` (bool refused: ``True`` is not a count)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        none = " or None" if allow_none else ""
        raise TypeError(
            f"{where}: {name}={value!r} is a {type_name(value)}, not an int; pass an int >= {least}{none}"
        )
    if value < least:
        raise ValueError(f"{where}: {name}={value!r} is below {least}; pass an int >= {least}")


def check_positive_number(where: str, name: str, value: object) -> None:
    """A real number > 0 (a timeout)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name}={value!r} is a {type_name(value)}, not a number; pass seconds > 0")
    if not float(value) > 0:
        raise ValueError(f"{where}: {name}={value!r} must be > 0 (seconds); pass e.g. {name}=10.0")


def check_callable(where: str, name: str, value: object, example: str, *, allow_none: bool = True) -> None:
    """A function (or None where allowed): a string such as ``"mse"`` is refused at once, not mid-step."""
    if value is None and allow_none:
        return
    if not callable(value):
        raise TypeError(
            f"{where}: {name}={value!r} is a {type_name(value)}, not a callable; pass e.g. {example}"
        )


def check_chunk_specs(where: str, args_spec: object, kwargs_spec: object) -> None:
    """``args_chunk_spec`` a sequence, ``kwargs_chunk_spec`` a str-keyed mapping, of specs or None."""
    from hp_pipeline.microbatch import TensorChunkSpec, _Replicate, as_chunk_spec

    fix = "TensorChunkSpec(dim) (ours or torch's), REPLICATE or None (the default)"

    def check_entry(label: str, spec: object) -> None:
        if spec is not None and not isinstance(as_chunk_spec(spec), (TensorChunkSpec, _Replicate)):
            raise TypeError(f"{where}: {label} is {spec!r} ({type_name(spec)}); each entry must be {fix}")

    if args_spec is not None:
        if not isinstance(args_spec, Sequence) or isinstance(args_spec, (str, bytes)):
            raise TypeError(
                f"{where}: args_chunk_spec={args_spec!r} is a {type_name(args_spec)}, not a sequence; "
                f"pass one spec per positional argument of step(), e.g. args_chunk_spec=[TensorChunkSpec(0)]"
            )
        for i, spec in enumerate(args_spec):
            check_entry(f"args_chunk_spec[{i}]", spec)
    if kwargs_spec is not None:
        if not isinstance(kwargs_spec, Mapping):
            raise TypeError(
                f"{where}: kwargs_chunk_spec={kwargs_spec!r} is a {type_name(kwargs_spec)}, not a mapping; "
                "pass a dict from keyword name to spec, e.g. kwargs_chunk_spec={'mask': REPLICATE}"
            )
        for key, spec in kwargs_spec.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where}: kwargs_chunk_spec has the key {key!r} ({type_name(key)}); keys are the "
                    "names of step()'s keyword arguments (str)"
                )
            check_entry(f"kwargs_chunk_spec[{key!r}]", spec)


def check_merge_spec(where: str, spec: object) -> None:
    """``output_merge_spec``: an int dim, ``None``, or torch's structure of specs ([Note: merge specs]).

    Walked once at construction, so a typo fails when the schedule is built,
    not after a whole step on the last stage's rank.
    """
    from hp_pipeline.microbatch import TensorChunkSpec, _is_torch_reducer, _Replicate, as_chunk_spec

    def is_dim(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def walk(label: str, value: object) -> None:
        if isinstance(value, (tuple, list)):
            for i, part in enumerate(value):
                walk(f"{label}[{i}]", part)
            return
        if isinstance(value, dict):
            for key, part in value.items():
                walk(f"{label}[{key!r}]", part)
            return
        leaf = as_chunk_spec(value)
        if leaf is None or is_dim(leaf) or isinstance(leaf, (TensorChunkSpec, _Replicate)):
            return
        if _is_torch_reducer(leaf):
            return
        raise TypeError(
            f"{where}: {label}={value!r} is a {type_name(value)}, not a merge spec; pass an int dim "
            "(every tensor of the output concatenated along it), None (dim 0), or torch's form: a "
            "tuple/list/dict with one leaf per tensor of the last stage's output, each TensorChunkSpec(dim) "
            "(ours or torch's), an int dim, REPLICATE or None (the same value from every micro-batch), "
            "e.g. (TensorChunkSpec(0), TensorChunkSpec(1))"
        )

    walk("output_merge_spec", spec)


def check_options(where: str, options: Mapping[str, Any], valid: Collection[str]) -> None:
    """Unknown keyword options, listed with the valid ones (Python's own error names only the first)."""
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(
            f"{where} got unknown keyword option(s) {unknown}; the valid options are {sorted(valid)}"
        )


def check_order_mapping(where: str, order: object) -> None:
    """An order is ``rank -> steps``: a list of lists (or ``None``) is refused with the fix."""
    if not isinstance(order, Mapping):
        raise TypeError(
            f"{where}: order is a {type_name(order)}, not a mapping; pass a dict rank -> list of MetaStep, "
            "e.g. build_1f1b_order(p, m) or {0: [MetaStep(0, MetaStepType.FWD, 0)]}"
        )
    for rank, steps in order.items():
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence):
            raise TypeError(
                f"{where}: rank {rank!r}'s steps are a {type_name(steps)} ({steps!r}), not a list of "
                "MetaStep; parse text with MetaStep.parse or read_order_csv"
            )


def check_costs(where: str, costs: object) -> None:
    """``costs`` must be a :class:`StepCosts` (or None): a plain dict would silently mean nothing."""
    if costs is not None and not isinstance(costs, StepCosts):
        raise TypeError(
            f"{where}: costs={costs!r} is a {type_name(costs)}, not a StepCosts; pass e.g. "
            "StepCosts(forward=1, backward=2) or StepCosts(by_code={'F': 1}), or None for the defaults"
        )


# [Note: schedule agreement]
# Ranks that build different schedules (another class, ``n_microbatches``,
# ``num_stages``, a ``loss_fn`` on some ranks only, ...) run orders whose
# transfers do not pair up: they hang in the first transfer that has no
# partner or, worse, pair transfers of different micro-batches. Construction
# does not communicate (placement is checked against this rank's own stages),
# and a collective there would make every constructor one, which torch's are
# not. A fingerprint in the first step's transfer headers would reach only the
# downstream neighbour, and with different orders the first transfer two ranks
# meet may already differ. So the first step starts with hp_core's agreement
# ([Note: cross-rank agreement] in hp_core.agreement) over the pipeline group,
# before any transfer: a 64-byte digest of ``fingerprint()``, once per schedule
# (``_agreed``); every rank's settings are exchanged only when they differ, and
# then every rank raises the same error before computing or sending anything.
# ``ScheduleMPipe``, whose construction broadcasts the tower, agrees there,
# before the broadcast.


def describe_fingerprints(fingerprints: list[Mapping[str, Any]], ranks: list[int]) -> str:
    """Every rank's schedule settings as ``rank R: Name(key=value, ...)`` for the agreement error."""

    def one(fingerprint: Mapping[str, Any]) -> str:
        rest = ", ".join(f"{k}={v!r}" for k, v in fingerprint.items() if k != "schedule")
        return f"{fingerprint.get('schedule', '?')}({rest})"

    rows = "; ".join(f"rank {rank}: {one(f)}" for rank, f in zip(ranks, fingerprints, strict=True))
    return f"the ranks of the pipeline built different schedules ({rows})"


def check_loss_kwargs(loss_kwargs: object) -> None:
    """``loss_kwargs`` is splatted into ``loss_fn``: a mapping with str keys, or None."""
    if loss_kwargs is None:
        return
    if not isinstance(loss_kwargs, Mapping):
        raise TypeError(
            f"step(loss_kwargs=...) takes a dict of keyword arguments for loss_fn, got a "
            f"{type(loss_kwargs).__name__} ({loss_kwargs!r}); pass e.g. loss_kwargs={{'reduction': 'sum'}}"
        )
    bad = [key for key in loss_kwargs if not isinstance(key, str)]
    if bad:
        raise TypeError(
            f"step(loss_kwargs=...) has the keys {bad}, which are not str; its keys are the names of "
            "loss_fn's keyword arguments"
        )

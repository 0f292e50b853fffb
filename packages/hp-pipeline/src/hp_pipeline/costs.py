"""How long each kind of step takes (:class:`StepCosts`), for the simulator and the passes that time orders.

A leaf module (it imports nothing of the package at run time), so the argument
checks, the simulator and ``insert_comms`` can all name it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hp_pipeline.kinds import MetaStepType

__all__ = ["StepCosts"]


@dataclass(frozen=True)
class StepCosts:
    """How long each kind of step takes, in any unit (all values become Fractions).

    The defaults model a backward that costs twice the forward, split evenly
    into input and weight gradients, with free communication.

    Attributes:
        forward: ``F``.
        backward: a full ``B``.
        backward_input: ``I``.
        backward_weight: ``W``.
        comm: latency from a SEND (or, in a compute-only order, from the
            producing step) to the data being usable on the other rank.
        data_load, unshard, reshard, reduce_grad: the remaining local steps.
        preprocess_forward, preprocess_backward, preprocess_reduce: the costs
            MPipe's kinds ``PF``, ``PB`` and ``REDUCE_P`` declare they take (the
            tower's forward, backward and gradient reduction).
        overlap_f_b: the time of an ``OVERLAP_F_B`` whose halves share the
            device at once (DualPipe's ``F&B``: two streams on an
            accelerator). The pair then starts when the inputs of both halves
            are there and both halves' results leave at its end. ``None``
            (the default) times the pair the way hp-pipeline's executor runs
            it, one half after the other ([Note: timing model]).
        by_code: costs by step code (``{"SWAP_OUT": 2}``) that take precedence
            over what a kind declares: how a plug-in kind is timed differently in
            one run ([Note: step-kind registry] in :mod:`hp_pipeline.kinds`).
    """

    forward: Fraction | float = 1
    backward: Fraction | float = 2
    backward_input: Fraction | float = 1
    backward_weight: Fraction | float = 1
    comm: Fraction | float = 0
    data_load: Fraction | float = 0
    unshard: Fraction | float = 0
    reshard: Fraction | float = 0
    reduce_grad: Fraction | float = 0
    preprocess_forward: Fraction | float = 1
    preprocess_backward: Fraction | float = 2
    preprocess_reduce: Fraction | float = 0
    overlap_f_b: Fraction | float | None = None
    by_code: Mapping[str, Fraction | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for spec in fields(self):
            if spec.name == "by_code" or (spec.name == "overlap_f_b" and self.overlap_f_b is None):
                continue
            object.__setattr__(self, spec.name, _cost(f"StepCosts.{spec.name}", getattr(self, spec.name)))
        if not isinstance(self.by_code, Mapping):
            raise TypeError(f"StepCosts.by_code must map step codes to numbers, got {self.by_code!r}")
        exact = {code: _cost(f"StepCosts.by_code[{code!r}]", value) for code, value in self.by_code.items()}
        object.__setattr__(self, "by_code", exact)

    def __hash__(self) -> int:
        values = tuple(getattr(self, spec.name) for spec in fields(self) if spec.name != "by_code")
        return hash((values, tuple(sorted(self.by_code.items()))))

    def of(self, step_type: MetaStepType) -> Fraction:
        """The cost of a ``step_type`` step: ``by_code``, else what its kind declares (0 for SEND/RECV)."""
        if step_type.code in self.by_code:
            return Fraction(self.by_code[step_type.code])
        if step_type.is_comm:
            return Fraction(0)
        declared = step_type.spec.cost
        if isinstance(declared, str):
            return Fraction(getattr(self, declared))
        if callable(declared):
            return _cost(f"the cost of {step_type.name}", declared(self))
        return Fraction(declared)


def _cost(what: str, value: object) -> Fraction:
    """``value`` as an exact, non-negative Fraction, or an error naming ``what``."""
    try:
        exact = Fraction(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {value!r}") from None
    if exact < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return exact

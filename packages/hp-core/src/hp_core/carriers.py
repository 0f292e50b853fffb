"""Which dtypes each backend carries, and how hp_core carries the others.

Backends take a fixed set of dtypes, and not the same set for moving data
(all-gather, all-to-all, broadcast) as for reducing it. gloo refuses
``int16`` and the unsigned types wider than a byte for every collective
("Invalid scalar type", raised asynchronously, so the peers hang or fail
later); NCCL has no ``int16`` and does not reduce float8; HCCL does not
reduce ``uint8``. A user holding such a tensor expects the collective to
work as it does for ``float32``, so :mod:`hp_core.collectives` asks this
module for a *carrier* before issuing anything.

How a carrier is chosen: [Note: dtype carriers] (above :class:`Carrier`);
where the tables come from: [Note: backend dtype tables].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["Carrier", "DtypeRules", "carrier_for", "dtype_rules_for", "register_dtype_rules"]

_FP8 = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_BASIC_INTS = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64})
_UNSIGNED = frozenset({torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool})
_SIGNED_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_OF_WIDTH = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
# Same-width stand-ins for moves, integers first (plain bit patterns), then floats.
_MOVE_PREFERENCE = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


@dataclass(frozen=True)
class DtypeRules:
    """The dtypes one backend moves and reduces natively (``None``: every dtype)."""

    backend: str
    move: frozenset[torch.dtype] | None = None
    reduce: frozenset[torch.dtype] | None = None
    no_reduce_for: Mapping[str, frozenset[torch.dtype]] = field(default_factory=dict)

    def moves(self, dtype: torch.dtype) -> bool:
        return self.move is None or dtype in self.move

    def reduces(self, dtype: torch.dtype, op: str) -> bool:
        if self.reduce is not None and dtype not in self.reduce:
            return False
        return dtype not in self.no_reduce_for.get(op, frozenset())


# [Note: backend dtype tables]
# Sources: gloo measured on torch 2.13 (2 ranks, every collective x dtype);
# NCCL from ``ncclDataType_t`` and ProcessGroupNCCL ("Float8 dtypes are not
# currently supported for NCCL reductions"); HCCL from ``HcclDataType`` and
# the HcclAllReduce reference (no ``uint8`` reduction, no ``int16`` or
# ``bfloat16`` product). These are the rules hp-testing's ``nccl-emu`` and
# ``hccl-emu`` enforce.
_GLOO = frozenset({*_BASIC_INTS, *_FLOATS, torch.bool})
_NCCL_MOVE = frozenset({*_BASIC_INTS, *_FLOATS, torch.bool, *_FP8})
_HCCL_MOVE = frozenset({*_BASIC_INTS, torch.int16, *_FLOATS, torch.bool})

_TABLE: dict[str, DtypeRules] = {
    "gloo": DtypeRules("gloo", _GLOO, _GLOO),
    "nccl": DtypeRules("nccl", _NCCL_MOVE, _NCCL_MOVE - _FP8),
    "hccl": DtypeRules(
        "hccl",
        _HCCL_MOVE,
        _HCCL_MOVE - {torch.uint8},
        {"product": frozenset({torch.int16, torch.bfloat16})},
    ),
}


def dtype_rules_for(backend: str) -> DtypeRules:
    """The dtype rules of ``backend``; unknown backends are assumed to carry every dtype."""
    key = backend.lower()
    return _TABLE.get(key) or DtypeRules(key)


def register_dtype_rules(rules: DtypeRules) -> DtypeRules | None:
    """Add or replace a backend's dtype rules (for out-of-tree backends); returns the old entry."""
    if not isinstance(rules, DtypeRules):
        raise TypeError(f"register_dtype_rules expects DtypeRules, got {type(rules).__name__}.")
    key = rules.backend.lower()
    previous = _TABLE.get(key)
    _TABLE[key] = rules
    return previous


# [Note: dtype carriers]
# A carrier is the dtype that travels in place of the tensor's own, chosen so
# the result is bit-for-bit what a backend supporting the dtype would give:
#
# * Moving data never looks at values, so any dtype of the same width carries
#   it as a *view* of the same memory: no copy, no conversion (``int16`` moves
#   on gloo as ``float16`` bits).
# * A sum or product of integers is arithmetic modulo ``2**bits``, which a
#   same-width integer of the other signedness computes identically (a view),
#   and which a wider integer computes modulo a multiple of ``2**bits``, so the
#   cast back truncates to the same value (a widened copy). ``max`` / ``min``
#   need the order kept: a wider integer that holds every value (a copy), or,
#   for the widest unsigned type, the signed type of the same width with the
#   sign bit flipped, which maps unsigned order onto signed order.
# * Floats a backend cannot reduce (float8, HCCL's ``bfloat16`` product) are
#   reduced in ``float32`` and rounded once on the way back.
# * A ``bool`` sum is a logical or (as ``a + b`` is for bool tensors), so it
#   runs as ``max``: gloo's own bool sum stores the byte 2 in a bool.
# * Complex tensors reach the backend as their real view (torch does that
#   itself); only sum-like reductions are defined on them.
#
# A dtype a backend carries natively gets no carrier: nothing is viewed or
# copied. Backends missing from the table (out-of-tree ones) are assumed to
# carry everything; :func:`register_dtype_rules` adds their rules.
@dataclass(frozen=True)
class Carrier:
    """How one tensor crosses a backend in place of its own dtype ([Note: dtype carriers])."""

    dtype: torch.dtype  # the dtype on the wire
    op: str | None = None  # the reduce op on the wire (None: the caller's)
    view: bool = True  # a view of the same memory (same width) rather than a converted copy
    flip: bool = False  # unsigned order carried as signed: the sign bit is flipped both ways

    @property
    def shares_memory(self) -> bool:
        """Whether the travelling tensor is the caller's memory (nothing to copy back)."""
        return self.view and not self.flip

    def there(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as it travels: a view, or a converted copy."""
        if self.flip:
            signed = tensor.view(self.dtype)
            return signed.bitwise_xor(torch.iinfo(self.dtype).min)
        if self.view:
            return tensor.view(self.dtype)
        return tensor.to(self.dtype)

    def back(self, wire: torch.Tensor, tensor: torch.Tensor) -> None:
        """Write the travelled values into ``tensor`` (nothing to do for a view)."""
        if self.flip:
            tensor.view(self.dtype).copy_(wire.bitwise_xor_(torch.iinfo(self.dtype).min))
        elif not self.view:
            tensor.copy_(wire)


def _width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _move_carrier(fn: str, rules: DtypeRules, dtype: torch.dtype) -> Carrier:
    width = _width(dtype)
    for candidate in _MOVE_PREFERENCE:
        if _width(candidate) == width and rules.moves(candidate):
            return Carrier(candidate)
    raise ValueError(
        f"{fn}(): backend {rules.backend!r} cannot move dtype {dtype} and has no {width}-byte dtype to "
        "carry its bits; cast the tensor to a dtype the backend supports first."
    )


def _reduce_carrier(fn: str, rules: DtypeRules, dtype: torch.dtype, op: str) -> Carrier:
    if dtype == torch.bool:
        # sum / max are a logical or, product / min a logical and; the bytes stay 0 or 1.
        wire_op = "max" if op in ("sum", "max") else "min"
        for candidate in (torch.bool, torch.uint8, torch.int8):
            if rules.reduces(candidate, wire_op):
                return Carrier(candidate, wire_op)
    elif _integral(dtype):
        width = _width(dtype)
        if op in ("sum", "product"):  # modular arithmetic: either signedness of the same width
            for same_width in (_SIGNED_OF_WIDTH.get(width), _UNSIGNED_OF_WIDTH.get(width)):
                if same_width is not None and rules.reduces(same_width, op):
                    return Carrier(same_width)
        unsigned = dtype in _UNSIGNED
        for wider in (2, 4, 8):
            if wider <= width:
                continue
            candidates = [_SIGNED_OF_WIDTH[wider]] + ([_UNSIGNED_OF_WIDTH[wider]] if unsigned else [])
            for candidate in candidates:
                if rules.reduces(candidate, op):
                    return Carrier(candidate, view=False)
        signed = _SIGNED_OF_WIDTH.get(width)
        if unsigned and signed is not None and rules.reduces(signed, op):
            return Carrier(signed, view=False, flip=True)
    else:
        for candidate in (torch.float32, torch.float64):
            if _width(candidate) >= _width(dtype) and rules.reduces(candidate, op):
                return Carrier(candidate, view=False)
    raise ValueError(
        f"{fn}(): backend {rules.backend!r} cannot reduce dtype {dtype} with op={op!r}, and no dtype it "
        "reduces holds every value exactly; cast the tensor to a dtype the backend reduces first."
    )


def carrier_for(fn: str, backend: str, dtype: torch.dtype, op: str | None = None) -> Carrier | None:
    """The carrier of ``dtype`` on ``backend`` for a move (``op=None``) or a reduction; ``None`` if native.

    Raises a ``ValueError`` naming the dtype and the fix when nothing can carry
    it exactly (a complex max, say).
    """
    if dtype.is_complex:
        if op is not None and op not in ("sum", "avg", "premul_sum"):
            raise ValueError(
                f"{fn}(): op={op!r} is not defined on complex dtype {dtype}; use op='sum' (or reduce the "
                "real and imaginary parts yourself)."
            )
        real = dtype.to_real()  # torch hands the backend the real view
        rules = dtype_rules_for(backend)
        if rules.moves(real) if op is None else rules.reduces(real, op):
            return None
        raise ValueError(
            f"{fn}(): backend {backend!r} cannot carry complex dtype {dtype} (its real dtype {real} is not "
            "one the backend supports here); split it into real and imaginary parts of a supported dtype."
        )
    rules = dtype_rules_for(backend)
    if op is None:
        return None if rules.moves(dtype) else _move_carrier(fn, rules, dtype)
    if (dtype == torch.bool and op == "sum") or not rules.reduces(dtype, op):
        return _reduce_carrier(fn, rules, dtype, op)
    return None

"""Every collective carries every dtype exactly, whatever the backend supports ([Note: dtype carriers]).

Each rank builds every rank's input from a seed, so the expected result is a
plain single-process computation: Python integers wrapped to the dtype's
range for integer reductions (exact, overflow included), float64 rounded
once to the dtype for float sums.
"""

from __future__ import annotations

import hp_core
import pytest
import torch
from hp_core.carriers import Carrier, DtypeRules, carrier_for, dtype_rules_for, register_dtype_rules

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.int32]
DTYPES = [*INTS, torch.bool, torch.float16, torch.bfloat16, *FP8, torch.complex64]
WORLD = 2


def _bits(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() * 8


def _wrap(value: int, dtype: torch.dtype) -> int:
    bits = _bits(dtype)
    if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return value % (1 << bits)
    half = 1 << (bits - 1)
    return (value + half) % (1 << bits) - half


def _values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: extremes of the dtype (overflowing sums) and seeded values."""
    g = torch.Generator().manual_seed(100 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(dtype)
    bits = _bits(dtype)
    low, high = (0, 1 << bits) if dtype in _UNSIGNED else (-(1 << (bits - 1)), 1 << (bits - 1))
    ints = [int(v) for v in torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)]
    ints = [low + (v % (high - low)) for v in ints]
    ints[:2] = [high - 1, low]  # the largest and smallest values meet across ranks
    if dtype == torch.uint64:  # torch builds uint64 tensors from int64 bit patterns
        return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in ints]).view(torch.uint64)
    return torch.tensor(ints, dtype=torch.int64).to(dtype)


_UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def _as_ints(t: torch.Tensor) -> list[int]:
    if t.dtype == torch.uint64:
        return [v + (1 << 64) if v < 0 else v for v in t.view(torch.int64).tolist()]
    return [int(v) for v in t.to(torch.int64).tolist()]


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """The single-process reference of a reduction over the ranks' tensors."""
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(tensors).to(torch.int64)
        combined = stacked.amax(0) if op in ("sum", "max") else stacked.amin(0)
        return combined.bool()
    if dtype.is_floating_point or dtype.is_complex:
        wide = torch.stack([t.to(torch.complex128 if dtype.is_complex else torch.float64) for t in tensors])
        result = {"sum": wide.sum(0), "max": wide.amax(0) if not dtype.is_complex else None}[op]
        return result.to(dtype)
    columns = zip(*[_as_ints(t) for t in tensors], strict=True)
    fold = {"sum": sum, "max": max, "min": min, "product": lambda c: _product(c)}[op]
    wrapped = [_wrap(fold(list(c)), dtype) for c in columns]
    if dtype == torch.uint64:
        return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in wrapped]).view(torch.uint64)
    return torch.tensor(wrapped, dtype=torch.int64).to(dtype)


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    # Compare bits: fp8 and wide unsigned types lack torch.equal, and a bool must hold the byte 0 or 1.
    if actual.dtype in FP8 or actual.dtype in (torch.bool, torch.uint16, torch.uint32, torch.uint64):
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
        assert torch.equal(actual.view(width), expected.view(width)), (actual, expected)
    else:
        assert torch.equal(actual, expected), (actual, expected)


def _ops(dtype: torch.dtype) -> list[str]:
    if dtype.is_complex:
        return ["sum"]
    if dtype.is_floating_point:
        return ["sum", "max"]
    return ["sum", "max", "min", "product"]


# hccl-emu runs HCCL's rules over gloo, which cannot move int16 (an HCCL type): its cases for the
# dtypes carried as int16 under HCCL would test the harness, not hp_core, so they are left out.
_OVER_GLOO_INT16 = {torch.int16, torch.uint16, torch.uint8}
CASES = [
    pytest.param(
        backend,
        dtype,
        marks=pytest.mark.distributed(world_size=WORLD, backend=backend),
        id=f"{backend}-{dtype}",
    )
    for backend in ("gloo", "nccl-emu", "hccl-emu")
    for dtype in DTYPES
    if not (backend == "hccl-emu" and dtype in _OVER_GLOO_INT16)
]


@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_every_collective_carries_dtype(rank, backend, dtype):
    inputs = [_values(r, 6, dtype) for r in range(WORLD)]
    mine = inputs[rank]

    # all-gather, even and uneven
    gathered = hp_core.all_gather_into_tensor(torch.empty(12, dtype=dtype), mine.clone())
    _same(gathered, torch.cat(inputs))
    sizes = [5, 3]
    uneven = hp_core.all_gather_into_tensor(
        torch.empty(8, dtype=dtype), mine[: sizes[rank]].clone(), input_sizes=sizes
    )
    _same(uneven, torch.cat([inputs[r][: sizes[r]] for r in range(WORLD)]))

    # all-to-all: chunk j of rank i lands in chunk i of rank j
    exchanged = hp_core.all_to_all_single(torch.empty(6, dtype=dtype), mine.clone())
    _same(exchanged, torch.cat([inputs[r].chunk(WORLD)[rank] for r in range(WORLD)]))

    # broadcast from group rank 1
    shared = hp_core.broadcast(mine.clone(), group_src=1)
    _same(shared, inputs[1])

    for op in _ops(dtype):
        expected = _reduce(inputs, op)
        reduced = hp_core.all_reduce(mine.clone(), op)
        _same(reduced, expected)
        source = mine.clone()
        scattered = hp_core.reduce_scatter_tensor(torch.empty(3, dtype=dtype), source, op)
        _same(scattered, expected.chunk(WORLD)[rank])
        _same(source, mine)  # the input of a reduce-scatter is never modified
        work = hp_core.all_reduce(mine.clone(), op, async_op=True)
        _same(work.wait(), expected)


@pytest.mark.distributed(world_size=WORLD)
def test_complex_max_is_refused_before_communicating(rank):
    value = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"op='max' is not defined on complex dtype torch.complex64"):
        hp_core.all_reduce(value, "max")
    assert hp_core.all_reduce(value).tolist() == [2 + 0j, 2 + 0j]  # the group still works


def test_native_dtypes_get_no_carrier():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.uint8):
        for op in (None, "sum", "max", "min", "product"):
            assert carrier_for("f", "gloo", dtype, op) is None
    assert carrier_for("f", "nccl", torch.float8_e4m3fn) is None  # NCCL moves fp8 bytes itself
    assert carrier_for("f", "some-new-backend", torch.int16, "sum") is None


def test_carriers_follow_each_backend_rules():
    # moves: a same-width view, never a copy
    assert carrier_for("f", "gloo", torch.int16) == Carrier(torch.float16)
    assert carrier_for("f", "gloo", torch.uint64) == Carrier(torch.int64)
    assert carrier_for("f", "gloo", torch.float8_e5m2) == Carrier(torch.uint8)
    assert carrier_for("f", "nccl", torch.int16) == Carrier(torch.float16)
    # modular arithmetic: same width of the other signedness is a view
    assert carrier_for("f", "gloo", torch.uint32, "sum") == Carrier(torch.int32)
    assert carrier_for("f", "hccl", torch.uint8, "sum") == Carrier(torch.int8)
    # order: widen, or flip the sign bit of the widest
    assert carrier_for("f", "gloo", torch.int16, "max") == Carrier(torch.int32, view=False)
    assert carrier_for("f", "gloo", torch.uint32, "min") == Carrier(torch.int64, view=False)
    assert carrier_for("f", "gloo", torch.uint64, "max") == Carrier(torch.int64, view=False, flip=True)
    assert carrier_for("f", "hccl", torch.uint8, "max") == Carrier(torch.int16, view=False)
    assert carrier_for("f", "nccl", torch.int16, "sum") == Carrier(torch.int32, view=False)
    # floats a backend cannot reduce: float32, rounded once on the way back
    assert carrier_for("f", "nccl", torch.float8_e4m3fn, "sum") == Carrier(torch.float32, view=False)
    assert carrier_for("f", "hccl", torch.bfloat16, "product") == Carrier(torch.float32, view=False)
    # bool: a sum is an or
    assert carrier_for("f", "gloo", torch.bool, "sum") == Carrier(torch.bool, "max")
    assert carrier_for("f", "gloo", torch.bool, "product") is None


def test_registered_rules_and_clear_errors():
    previous = register_dtype_rules(
        DtypeRules("tiny", frozenset({torch.float32}), frozenset({torch.float32}))
    )
    try:
        with pytest.raises(ValueError, match=r"backend 'tiny' cannot move dtype torch.int8 .* 1-byte"):
            carrier_for("all_gather_into_tensor", "tiny", torch.int8)
        with pytest.raises(ValueError, match=r"cannot reduce dtype torch.int64 with op='max'"):
            carrier_for("all_reduce", "tiny", torch.int64, "max")
        assert dtype_rules_for("TINY").backend == "tiny"
    finally:
        assert previous is None
        register_dtype_rules(DtypeRules("tiny"))

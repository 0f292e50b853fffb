"""Every bad call to hp_core's public API is a clear error, on every rank, that changes nothing.

Each case is one bad call. The test checks that the message names the
observed value and the fix, that every rank raised the same kind of error
(gathered afterwards, which also proves no rank is left inside a collective),
and that nothing changed: no process group was created and the tensors
handed in are untouched. Cases whose arguments differ between ranks are the
ones that used to build inconsistent meshes silently or hang; they are caught
by the agreement gather of [Note: cross-rank agreement] in ``hp_core.agreement``.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hp_core
import pytest
import torch
from hp_core import DeviceMesh, P2POp, init_device_mesh
from hp_core.mesh import cached_groups


@dataclass(frozen=True)
class Bad:
    """One bad call: ``call(rank, mesh, tensor)`` must raise ``error`` naming ``observed`` and ``fix``."""

    name: str
    call: Callable[[int, DeviceMesh, torch.Tensor], Any]
    error: type[BaseException]
    observed: str  # regex: the value the caller passed
    fix: str  # regex: what to do instead


def _wait_with_int_timeout(rank: int, mesh: DeviceMesh, t: torch.Tensor) -> None:
    work = hp_core.all_reduce(torch.ones(1), async_op=True)
    try:
        work.wait(timeout=5)  # type: ignore[arg-type]
    finally:
        work.wait()  # the collective itself was fine: finish it so the ranks stay in step


CASES = [
    # -- init_device_mesh and the DeviceMesh constructor
    Bad(
        "device_type not a str",
        lambda r, m, t: init_device_mesh(0, (2,)),
        TypeError,
        r"got 0",
        r"a str such as 'cpu'",
    ),
    Bad(
        "unknown device type",
        lambda r, m, t: init_device_mesh("tpu", (2,)),
        hp_core.PlatformError,
        r"'tpu'",
        r"known device types are .*set_platform",
    ),
    Bad(
        "shape product != world",
        lambda r, m, t: init_device_mesh("cpu", (3,)),
        ValueError,
        r"mesh_shape=\(3,\) holds 3 ranks",
        r"product is 2, e\.g\. \(2,\)",
    ),
    Bad(
        "shape of floats",
        lambda r, m, t: init_device_mesh("cpu", (2.0,)),
        ValueError,
        r"mesh_shape=\(2\.0,\)",
        r"positive ints, e\.g\. \(2, 4\)",
    ),
    Bad(
        "too many names",
        lambda r, m, t: init_device_mesh("cpu", (2,), mesh_dim_names=("a", "b")),
        ValueError,
        r"\('a', 'b'\) has 2 name",
        r"exactly one name per dim",
    ),
    Bad(
        "duplicate names",
        lambda r, m, t: init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "a")),
        ValueError,
        r"repeats \['a'\]",
        r"its own name",
    ),
    Bad(
        "name not a str",
        lambda r, m, t: init_device_mesh("cpu", (2,), mesh_dim_names=(1,)),
        TypeError,
        r"\(1,\)",
        r"non-empty strings",
    ),
    Bad(
        "names differ across ranks",
        lambda r, m, t: init_device_mesh("cpu", (2,), mesh_dim_names=("a",) if r == 0 else ("b",)),
        ValueError,
        r"rank 0: mesh_dim_names=\('a',\); rank 1: mesh_dim_names=\('b',\)",
        r"on every rank with the same",
    ),
    Bad(
        "shape differs across ranks",
        lambda r, m, t: init_device_mesh("cpu", (2,) if r == 0 else (1, 2)),
        ValueError,
        r"rank 0: mesh_shape=\(2,\); rank 1: mesh_shape=\(1, 2\)",
        r"on every rank with the same",
    ),
    Bad(
        "bad value on one rank only",
        lambda r, m, t: init_device_mesh("cpu", (2,) if r == 0 else (3,)),
        ValueError,
        r"rank 1: mesh_shape=\(3,\)",
        r"on every rank with the same",
    ),
    Bad(
        "DeviceMesh ranks differ across ranks",
        lambda r, m, t: DeviceMesh("cpu", [0, 1] if r == 0 else [1, 0]),
        ValueError,
        r"rank 0: mesh=\(0, 1\); rank 1: mesh=\(1, 0\)",
        r"same device type, rank tensor",
    ),
    Bad(
        "DeviceMesh of strings",
        lambda r, m, t: DeviceMesh("cpu", [["a", "b"]]),
        TypeError,
        r"\[\['a', 'b'\]\]",
        r"e\.g\. DeviceMesh\('cpu', \[\[0, 1\]",
    ),
    # -- DeviceMesh indexing, slicing, flattening, groups, ranks, sizes
    Bad(
        "unknown dim name", lambda r, m, t: m["x"], KeyError, r"\['x'\]", r"this mesh has dims \('dp', 'tp'\)"
    ),
    Bad("index by int", lambda r, m, t: m[0], TypeError, r"got 0", r"mesh\['dp'\]"),
    Bad(
        "names out of order",
        lambda r, m, t: m["tp", "dp"],
        ValueError,
        r"\('tp', 'dp'\)",
        r"use mesh\[\('dp', 'tp'\)\]",
    ),
    Bad(
        "get_group dim out of range",
        lambda r, m, t: m.get_group(5),
        IndexError,
        r"dim=5",
        r"index in \[-2, 1\] or a name in \('dp', 'tp'\)",
    ),
    Bad(
        "get_group(None) on 2-D",
        lambda r, m, t: m.get_group(),
        ValueError,
        r"this mesh has 2 dims \('dp', 'tp'\)",
        r"pass the dim",
    ),
    Bad(
        "get_local_rank unknown name",
        lambda r, m, t: m.get_local_rank("x"),
        KeyError,
        r"'x'",
        r"dims are \('dp', 'tp'\)",
    ),
    Bad("size(float)", lambda r, m, t: m.size(1.5), TypeError, r"float 1\.5", r"index in \[-2, 1\]"),
    Bad("flatten(int)", lambda r, m, t: m.flatten(3), TypeError, r"got 3", r"non-empty string or None"),
    Bad(
        "flatten name differs across ranks",
        lambda r, m, t: m.flatten("f17a" if r == 0 else "f17b"),
        ValueError,
        r"rank 0: name='f17a'; rank 1: name='f17b'",
        r"call flatten on every rank",
    ),
    # -- collectives
    Bad(
        "all_reduce(list)",
        lambda r, m, t: hp_core.all_reduce([1.0]),
        TypeError,
        r"list \[1\.0\]",
        r"torch\.as_tensor",
    ),
    Bad(
        "all_reduce(Work)",
        lambda r, m, t: hp_core.all_reduce(hp_core.barrier(async_op=True)),
        TypeError,
        r"a pending Work handle",
        r"call \.wait\(\) on it first",
    ),
    Bad(
        "async_op not a bool",
        lambda r, m, t: hp_core.all_reduce(t, async_op="yes"),
        TypeError,
        r"str 'yes'",
        r"True or False",
    ),
    Bad(
        "barrier async_op not a bool",
        lambda r, m, t: hp_core.barrier(async_op=1),
        TypeError,
        r"int 1",
        r"True or False",
    ),
    Bad(
        "group a str",
        lambda r, m, t: hp_core.all_reduce(t, group="dp"),
        TypeError,
        r"str 'dp'",
        r"mesh\.get_group\('dp'\)",
    ),
    Bad(
        "group a 2-D mesh",
        lambda r, m, t: hp_core.all_reduce(t, group=m),
        ValueError,
        r"2-D mesh",
        r"1-D slice such as mesh\['dp'\]",
    ),
    Bad(
        "unknown reduce op",
        lambda r, m, t: hp_core.all_reduce(t, "mean"),
        ValueError,
        r"'mean'",
        r"use one of \['sum', 'avg'",
    ),
    Bad(
        "avg of ints",
        lambda r, m, t: hp_core.all_reduce(torch.ones(2, dtype=torch.int64), "avg"),
        ValueError,
        r"torch\.int64",
        r"use op='sum' and divide",
    ),
    Bad(
        "gather dtype mismatch",
        lambda r, m, t: hp_core.all_gather_into_tensor(torch.empty(8, dtype=torch.float64), t),
        ValueError,
        r"torch\.float32 but output_tensor has dtype torch\.float64",
        r"cast one of them",
    ),
    Bad(
        "input_sizes too short",
        lambda r, m, t: hp_core.all_gather_into_tensor(torch.empty(8), t, input_sizes=[4]),
        ValueError,
        r"1 entries \[4\] but the group has 2",
        r"one size per rank",
    ),
    Bad(
        "reduce_scatter sizes",
        lambda r, m, t: hp_core.reduce_scatter_tensor(torch.empty(3), t),
        ValueError,
        r"output's 3 \(shape \(3,\)\)",
        r"size output as input\.numel\(\) // 2",
    ),
    Bad(
        "all_to_all splits length",
        lambda r, m, t: hp_core.all_to_all_single(torch.empty(4), t, [1, 3, 0]),
        ValueError,
        r"3 entries \[1, 3, 0\]",
        r"one size per rank",
    ),
    Bad(
        "broadcast src outside",
        lambda r, m, t: hp_core.broadcast(t, src=5),
        ValueError,
        r"src=5",
        r"global ranks are \[0, 1\]; pass one of those",
    ),
    Bad(
        "broadcast without source",
        lambda r, m, t: hp_core.broadcast(t),
        ValueError,
        r"src=None, group_src=None",
        r"exactly one of src",
    ),
    Bad(
        "Work.wait(int timeout)",
        _wait_with_int_timeout,
        TypeError,
        r"got 5 \(int\)",
        r"datetime\.timedelta\(seconds=5\)",
    ),
    # -- point to point
    Bad(
        "isend to self",
        lambda r, m, t: hp_core.isend(t, dst=r),
        ValueError,
        r"dst=\d is this rank itself",
        r"Copy the tensor locally",
    ),
    Bad(
        "irecv from outside",
        lambda r, m, t: hp_core.irecv(t, src=7),
        ValueError,
        r"src=7",
        r"pass one of those",
    ),
    Bad(
        "send tag a str", lambda r, m, t: hp_core.isend(t, 1 - r, tag="a"), TypeError, r"'a'", r"e\.g\. tag=0"
    ),
    Bad(
        "P2POp bad op",
        lambda r, m, t: P2POp("send2", t, 1 - r),
        ValueError,
        r"op='send2'",
        r"use 'isend' or 'irecv'",
    ),
    Bad(
        "P2POp peer a str",
        lambda r, m, t: P2POp("isend", t, "1"),
        TypeError,
        r"'1'",
        r"an int \(a global rank\)",
    ),
    Bad(
        "empty batch",
        lambda r, m, t: hp_core.batch_isend_irecv([]),
        ValueError,
        r"the op list is empty",
        r"at least one P2POp",
    ),
    Bad(
        "recv_object from self",
        lambda r, m, t: hp_core.recv_object(r),
        ValueError,
        r"src=\d is this rank itself",
        r"Copy the tensor locally",
    ),
]


BY_NAME = {case.name: case for case in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("name", list(BY_NAME))  # by name: the ranks receive picklable parameters
def test_bad_call_is_a_clear_error_on_every_rank(rank: int, world_size: int, name: str) -> None:
    case = BY_NAME[name]
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    tensor = torch.ones(4)
    groups_before = len(cached_groups())
    with pytest.raises(case.error) as caught:
        case.call(rank, mesh, tensor)
    message = str(caught.value)
    assert re.search(case.observed, message), f"the observed value is not named: {message}"
    assert re.search(case.fix, message), f"the fix is not named: {message}"
    # Nothing changed: no group was created, the tensor handed in is untouched.
    assert len(cached_groups()) == groups_before
    assert torch.equal(tensor, torch.ones(4))
    # Every rank raised the same kind of error, and none is stuck in a collective.
    assert hp_core.all_gather_object(type(caught.value).__name__) == [case.error.__name__] * world_size


@pytest.mark.distributed(world_size=2)
def test_good_calls_still_work_after_the_checks(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    again = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    assert again == mesh and mesh.flatten("f17ok") is mesh.flatten("f17ok")
    work = hp_core.all_reduce(torch.ones(2), async_op=True)
    assert work.wait(timeout=datetime.timedelta(seconds=60)).tolist() == [2.0, 2.0]
    got = hp_core.batch_isend_irecv(
        [
            P2POp("isend", torch.full((1,), float(rank)), 1 - rank, tag=3),
            P2POp("irecv", torch.empty(1), 1 - rank, tag=3),
        ]
    ).wait()
    assert got[1].item() == 1 - rank


class _FakeHandle:
    """An accelerator handle whose runtime state the test controls."""

    is_accelerator = True
    tensor_device_type = "cuda"

    def __init__(self) -> None:
        self.set_calls = 0

    def set_device(self) -> None:
        self.set_calls += 1


@pytest.mark.parametrize(
    ("backend", "runtime_started", "expected_calls"),
    [
        ("nccl", False, 1),  # nobody chose a device: follow LOCAL_RANK, as torch's init_device_mesh does
        ("nccl", True, 0),  # the user chose one: never override it
        ("gloo", False, 0),  # gloo stages objects on the CPU
    ],
)
def test_agreement_picks_the_local_rank_device_only_when_none_was_chosen(
    monkeypatch: pytest.MonkeyPatch, backend: str, runtime_started: bool, expected_calls: int
) -> None:
    import types

    from hp_core import _checks

    handle = _FakeHandle()
    monkeypatch.setattr(_checks.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(_checks, "get_platform", lambda: types.SimpleNamespace(handle=handle))
    monkeypatch.setattr(
        _checks.torch,
        "get_device_module",
        lambda kind: types.SimpleNamespace(is_initialized=lambda: runtime_started),
    )
    _checks.object_device_ready()
    assert handle.set_calls == expected_calls

"""Local mode keeps rank-independent caches shared and hands the turn over in rank order.

A module global declared with ``hp_core.share_across_ranks`` is one object on
every rank of a local world (the others stay per rank); hp_dtensor's output
meta cache is such a global, so a 8-rank world runs each op's meta once, not
once per rank, with the same values and gradients as one process. The turn
passes to the next rank in rank order that can go on, so a run's interleaving
is always the same.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_dtensor import DTensor, Replicate, Shard
from hp_dtensor.ops import dispatch
from hp_testing.local import run_local

PROBE = """
import hp_core

CACHE = {}
MINE = {}
hp_core.share_across_ranks(__name__, "CACHE")
"""


def test_a_declared_global_is_one_object_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shared_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "shared_probe", raising=False)
    import shared_probe  # imported before the ranks copy their state, as hp's packages are

    def body(rank: int) -> tuple[list[int], list[int]]:
        shared_probe.CACHE[rank] = rank
        shared_probe.MINE[rank] = rank
        hp_core.barrier()  # every rank writes before any reads
        return sorted(shared_probe.CACHE), sorted(shared_probe.MINE)

    results = run_local(body, 4, state_packages=["shared_probe"])
    assert [shared for shared, _ in results] == [[0, 1, 2, 3]] * 4
    assert [mine for _, mine in results] == [[0], [1], [2], [3]]
    assert sorted(shared_probe.CACHE) == [0, 1, 2, 3]  # the process's own object
    assert hp_core.shared_across_ranks("shared_probe") == frozenset({"CACHE"})


@pytest.mark.parametrize(
    ("args", "error", "says"),
    [
        ((None, "CACHE"), TypeError, "got None"),
        (("shared_probe",), ValueError, "got []"),
        (("shared_probe", "not a name"), ValueError, "got ['not a name']"),
    ],
)
def test_bad_declarations_name_the_value_and_the_fix(args: tuple[Any, ...], error: type, says: str) -> None:
    with pytest.raises(error) as raised:
        hp_core.share_across_ranks(*args)
    assert says in str(raised.value) and "share_across_ranks(__name__" in str(raised.value)


def test_the_output_meta_of_an_op_runs_on_one_rank_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 ranks, tp = 4 on each of 2 dp rows: the first rank computes every output meta, the rest reuse it."""
    runs = {rank: 0 for rank in range(8)}
    to_meta = dispatch.to_meta

    def counted(value: Any) -> Any:
        runs[dist.get_rank()] += 1
        return to_meta(value)

    monkeypatch.setattr(dispatch, "to_meta", counted)
    dispatch.clear_caches()  # cold: an earlier test may have met these shapes
    torch.manual_seed(0)
    x_full = torch.randn(5, 12, dtype=torch.float64)
    w_full = torch.randn(12, 20, dtype=torch.float64)
    out_ref = torch.relu(x_full @ w_full) * 3.0
    x_ref, w_ref = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    (torch.relu(x_ref @ w_ref) * 3.0).pow(2).sum().backward()

    def body(rank: int) -> dict[str, Any]:
        mesh = hp_core.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))["tp"]
        piece = w_full.chunk(4, dim=1)[mesh.get_local_rank()]
        w = DTensor.from_local(piece.clone(), mesh, [Shard(1)]).requires_grad_()
        x = DTensor.from_local(x_full.clone(), mesh, [Replicate()]).requires_grad_()
        before = runs[rank]
        out = torch.relu(x @ w) * 3.0  # no communication: every meta is met before the first switch
        met = runs[rank] - before
        hp_core.barrier()
        out.pow(2).sum().backward()
        return {
            "met": met,
            "out": out.full_tensor(),
            "w_grad": w.grad.full_tensor(),
            "x_grad": x.grad.full_tensor(),
        }

    results = run_local(body, 8)
    met = sorted(r["met"] for r in results)
    assert met[-1] > 0 and met[:-1] == [0] * 7, f"meta runs per rank: {[r['met'] for r in results]}"
    for r in results:
        torch.testing.assert_close(r["out"], out_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(r["w_grad"], w_ref.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(r["x_grad"], x_ref.grad, rtol=1e-12, atol=1e-12)


def test_the_turn_passes_in_rank_order() -> None:
    """Each rank that blocks hands the turn to the next rank after it (wrapping) that can go on."""
    trace: list[tuple[int, int]] = []  # a closure's list: one object for every rank

    def body(rank: int) -> None:
        pairs = dist.new_group([0, 1]), dist.new_group([2, 3])
        for step in range(3):
            trace.append((step, rank))
            dist.barrier(group=pairs[rank // 2])

    run_local(body, 4)
    first = list(trace)
    # step 0: 0 waits for 1; 1 completes the pair and goes on to step 1, waits; 2 (never ran) starts
    # and waits for 3; 3 completes, goes on, waits; 0 is next after 3; and so on.
    assert first == [
        (0, 0), (0, 1), (1, 1), (0, 2), (0, 3), (1, 3),
        (1, 0), (2, 0), (2, 1), (1, 2), (2, 2), (2, 3),
    ]  # fmt: skip
    trace.clear()
    run_local(body, 4)
    assert trace == first

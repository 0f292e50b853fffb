"""Local mode: the same test bodies on the process pool and on every rank in one process.

Each distributed body below runs under ``mode="process"`` and ``mode="local"``
at world 8 and checks its results against plain single-process tensors
computed in the body, so both modes passing means both give the reference's
values (and gradients). World 64 runs in local mode only, with
``HP_COMPOSITION=full``. The last tests plant mistakes and check the errors.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import hp_core
import pytest
import torch
import torch.distributed as dist
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Partial,
    Replicate,
    RowwiseParallel,
    Shard,
    distribute_tensor,
    parallelize_module,
)
from hp_testing import DeviceMeshFactory, record_collectives
from hp_testing.local import LocalHangError, LocalModeFailed, run_local, run_local_outcomes
from torch import nn

FULL = os.environ.get("HP_COMPOSITION") == "full"


def _worlds() -> list[Any]:
    """(world, mode) cases: both modes at 8; local at 64 when HP_COMPOSITION=full."""
    cases = [
        pytest.param(8, marks=pytest.mark.distributed(world_size=8, mode="process"), id="process-8"),
        pytest.param(8, marks=pytest.mark.distributed(world_size=8, mode="local"), id="local-8"),
    ]
    if FULL:
        cases.append(
            pytest.param(64, marks=pytest.mark.distributed(world_size=64, mode="local"), id="local-64")
        )
    return cases


def _rank_input(rank: int, n: int = 3) -> torch.Tensor:
    """What rank ``rank`` contributes: integer-valued, so every reduction order gives the same float."""
    return torch.arange(n, dtype=torch.float64) + 10.0 * rank


@pytest.mark.parametrize("world", _worlds())
def test_collectives_and_mesh_same_in_both_modes(world: int, rank: int, world_size: int) -> None:
    assert world_size == world and dist.get_rank() == rank
    everyone = [_rank_input(r) for r in range(world)]
    with record_collectives() as log:
        t = _rank_input(rank)
        hp_core.all_reduce(t)
        torch.testing.assert_close(t, torch.stack(everyone).sum(0), rtol=0, atol=0)
        t = _rank_input(rank)
        hp_core.all_reduce(t, op="max")
        torch.testing.assert_close(t, everyone[-1], rtol=0, atol=0)
        t = _rank_input(rank)
        hp_core.all_reduce(t, op="avg")
        torch.testing.assert_close(t, torch.stack(everyone).mean(0))

        out = torch.empty(world * 3, dtype=torch.float64)
        hp_core.all_gather_into_tensor(out, _rank_input(rank))
        torch.testing.assert_close(out, torch.cat(everyone), rtol=0, atol=0)
        sizes = [r % 3 + 1 for r in range(world)]  # uneven: padded, gathered once, sliced
        uneven = torch.empty(sum(sizes), dtype=torch.float64)
        hp_core.all_gather_into_tensor(uneven, _rank_input(rank, sizes[rank]), input_sizes=sizes)
        torch.testing.assert_close(uneven, torch.cat([_rank_input(r, sizes[r]) for r in range(world)]))

        big = [_rank_input(r, world * 2) for r in range(world)]
        chunk = torch.empty(2, dtype=torch.float64)
        work = hp_core.reduce_scatter_tensor(chunk, big[rank], async_op=True)
        torch.testing.assert_close(work.wait(), torch.stack(big).sum(0)[2 * rank : 2 * rank + 2])

        # all_to_all with uneven splits: rank r sends (r + j) % 2 + 1 rows to rank j.
        def split(src: int, dst: int) -> int:
            return (src + dst) % 2 + 1

        send = [torch.full((sum(split(r, j) for j in range(world)),), float(r)) for r in range(world)]
        recv = torch.empty(sum(split(j, rank) for j in range(world)))
        hp_core.all_to_all_single(
            recv,
            send[rank],
            [split(j, rank) for j in range(world)],
            [split(rank, j) for j in range(world)],
        )
        expected = torch.cat([torch.full((split(j, rank),), float(j)) for j in range(world)])
        torch.testing.assert_close(recv, expected, rtol=0, atol=0)

        b = _rank_input(rank)
        hp_core.broadcast(b, src=world - 1)
        torch.testing.assert_close(b, everyone[-1], rtol=0, atol=0)
        hp_core.barrier()
    assert log.count("all_reduce") == 3 and log.count("broadcast") == 1
    assert log.nbytes("all_gather_into_tensor") == 8 * (world * 3 + sum(sizes))  # output bytes

    assert hp_core.all_gather_object({"rank": rank}) == [{"rank": r} for r in range(world)]
    assert hp_core.broadcast_object(f"from {rank}", src=1) == "from 1"

    mesh = hp_core.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    half = world // 2
    coordinate = mesh.get_coordinate()
    assert coordinate is not None and tuple(coordinate) == (rank // half, rank % half)
    assert mesh.get_local_rank("tp") == rank % half
    tp_members = [rank // half * half + i for i in range(half)]
    assert dist.get_process_group_ranks(mesh.get_group("tp")) == tp_members
    dp_members = [rank % half, rank % half + half]
    with record_collectives() as log:
        t = _rank_input(rank)
        hp_core.all_reduce(t, group=mesh["tp"])
        torch.testing.assert_close(t, torch.stack([everyone[r] for r in tp_members]).sum(0), rtol=0, atol=0)
        t = _rank_input(rank)
        hp_core.all_reduce(t, group=mesh["dp"])
        torch.testing.assert_close(t, everyone[dp_members[0]] + everyone[dp_members[1]], rtol=0, atol=0)
    assert [r.group_ranks for r in log] == [tuple(tp_members), tuple(dp_members)]
    # a rank's process state is its own: every rank's RNG starts where the others' do (a shared
    # generator would hand the ranks consecutive draws), and RANK is the rank's own
    draws = torch.empty(world, 2)
    hp_core.all_gather_into_tensor(draws, torch.rand(1, 2))
    assert all(torch.equal(row, draws[0]) for row in draws)
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world)
    print(f"rank {rank} done")


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, dtype=torch.float64)
        self.down = nn.Linear(hidden, dim, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("world", _worlds())
def test_dtensor_redistribution_and_tp_mlp_same_in_both_modes(
    world: int, rank: int, device_mesh_factory: DeviceMeshFactory
) -> None:
    torch.manual_seed(0)
    full = torch.randn(world + 5, 6, dtype=torch.float64)  # uneven rows over the world
    mesh = device_mesh_factory((world,), ("tp",))
    rows = distribute_tensor(full, mesh, [Shard(0)])
    torch.testing.assert_close(rows.full_tensor(), full, rtol=0, atol=0)
    cols = rows.redistribute(mesh, [Shard(1)])
    assert cols.placements == (Shard(1),)
    torch.testing.assert_close(cols.full_tensor(), full, rtol=0, atol=0)
    rep = cols.redistribute(mesh, [Replicate()])
    torch.testing.assert_close(rep.to_local(), full, rtol=0, atol=0)
    partial = DTensor.from_local(full * (rank + 1), mesh, [Partial("sum")])
    summed = partial.redistribute(mesh, [Shard(0)]).full_tensor()
    torch.testing.assert_close(summed, full * (world * (world + 1) / 2))

    grid = device_mesh_factory((2, world // 2), ("dp", "tp"))
    both = distribute_tensor(full, grid, [Shard(0), Shard(1)])
    moved = both.redistribute(grid, [Replicate(), Shard(0)])
    torch.testing.assert_close(moved.full_tensor(), full, rtol=0, atol=0)

    # TP MLP forward/backward against the single-process model
    torch.manual_seed(1)
    dim, hidden = 8, 2 * world
    model = _MLP(dim, hidden)
    ref = _MLP(dim, hidden)
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(3, 4, dim, dtype=torch.float64)
    out = model(x)
    ref_out = ref(x)
    torch.testing.assert_close(out.full_tensor() if isinstance(out, DTensor) else out, ref_out)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p, DTensor), name
        assert isinstance(p.grad, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=name)


# -- errors ---------------------------------------------------------------------------------------------


def test_disagreeing_collectives_fail_every_rank_of_the_group_with_each_ranks_call() -> None:
    def body(rank: int) -> None:
        t = torch.ones(4 if rank != 2 else 5)
        hp_core.all_reduce(t)

    with pytest.raises(LocalModeFailed) as failure:
        run_local(body, 4)
    text = str(failure.value)
    assert [o.rank for o in failure.value.outcomes if not o.ok] == [0, 1, 2, 3]
    assert "the ranks disagree in collective #1 on group [0, 1, 2, 3]" in text
    assert "rank 1: all_reduce(float32(4,), sum); rank 2: all_reduce(float32(5,), sum)" in text


def test_a_rank_skipping_a_collective_is_reported_at_once_naming_every_wait() -> None:
    def body(rank: int) -> None:
        if rank == 1:
            return  # forgot the all_reduce its peers issue
        hp_core.all_reduce(torch.ones(2))

    outcomes = run_local_outcomes(body, 3)
    assert [o.ok for o in outcomes] == [False, True, False]
    assert isinstance(outcomes[0].exception, LocalHangError)
    text = outcomes[0].error
    assert "rank 0 waits in all_reduce(float32(2,), sum) (collective #1 on group [0, 1, 2])" in text
    assert "rank 2 waits in all_reduce" in text and "rank 1 returned (ended)" in text


def test_unmatched_point_to_point_order_is_reported() -> None:
    def body(rank: int) -> None:
        if rank == 0:
            dist.send(torch.ones(2), dst=1)
            dist.send(torch.ones(3), dst=1)
        else:
            big = torch.empty(3)
            dist.recv(big, src=0)  # receives the first send (2 elements): a mismatch

    outcomes = run_local_outcomes(body, 2)
    assert not outcomes[1].ok
    assert "rank 0 send(float32(2,)) to rank 1 vs rank 1 recv(float32(3,)) from rank 0" in outcomes[1].error


def test_state_of_the_calling_process_is_untouched() -> None:
    before = (torch.get_rng_state().clone(), torch.get_default_dtype(), os.environ.get("RANK"))

    def body(rank: int) -> int:
        torch.manual_seed(rank)
        torch.set_default_dtype(torch.float64)
        hp_core.barrier()
        return torch.get_default_dtype().itemsize

    assert run_local(body, 4) == [8, 8, 8, 8]
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (torch.get_default_dtype(), os.environ.get("RANK")) == before[1:]
    assert not dist.is_initialized()


def test_a_module_first_imported_by_a_rank_still_has_per_rank_globals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "local_probe.py").write_text("SEEN = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def body(rank: int) -> list[int]:
        import local_probe  # first imported here, by the first rank to run

        local_probe.SEEN.append(rank)
        hp_core.barrier()  # every rank imports and appends before any reads
        return sorted(local_probe.SEEN)  # the order the ranks ran in is up to the OS

    assert run_local(body, 4, state_packages=["local_probe"]) == [[0], [1], [2], [3]]
    monkeypatch.delitem(sys.modules, "local_probe")
    assert run_local(body, 4) == [[0, 1, 2, 3]] * 4  # not named: one module, shared as by threads


def test_a_global_bound_under_two_names_stays_one_object_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # hp_dtensor.ops.pointwise registers rules into dispatch's RULES through its own name for it;
    # split per (module, name), a rule registered on first use was missing where dispatch looks
    (tmp_path / "alias_probe").mkdir()
    (tmp_path / "alias_probe" / "__init__.py").write_text("TABLE = {}\n")
    (tmp_path / "alias_probe" / "late.py").write_text("from alias_probe import TABLE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import alias_probe

    monkeypatch.setitem(sys.modules, "alias_probe", alias_probe)

    def body(rank: int) -> list[int]:
        import hp_dtensor.ops.dispatch as dispatch
        import hp_dtensor.ops.pointwise as pointwise

        assert pointwise.RULES is dispatch.RULES
        import alias_probe.late  # first imported by a rank, binding the package's TABLE

        assert alias_probe.late.TABLE is alias_probe.TABLE
        alias_probe.late.TABLE[rank] = rank
        hp_core.barrier()
        return sorted(alias_probe.TABLE)

    assert run_local(body, 3, state_packages=["alias_probe"]) == [[0], [1], [2]]
    monkeypatch.delitem(sys.modules, "alias_probe.late")


@pytest.mark.parametrize("world", _worlds())
def test_p2p_receives_match_by_tag_as_on_gloo(world: int, rank: int) -> None:
    # hp_pipeline's failure vote posts its receives early on a tag of its own (gloo semantics)
    peer = rank ^ 1
    if rank % 2 == 0:
        sent = [
            dist.isend(torch.full((2,), 1.0), peer, tag=7),
            dist.isend(torch.full((3,), 2.0), peer, tag=0),
        ]
        for work in sent:
            assert work is not None
            work.wait()
    else:
        late, early = torch.empty(2), torch.empty(3)
        works = [dist.irecv(early, peer, tag=0), dist.irecv(late, peer, tag=7)]
        for work in works:
            assert work is not None
            work.wait()
        torch.testing.assert_close(early, torch.full((3,), 2.0), rtol=0, atol=0)
        torch.testing.assert_close(late, torch.full((2,), 1.0), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ("strict=True", "strict=True (async hazards)"),
        ("faults=[faults.fail(rank=1, at=0)]", "faults=[...] (fault injection)"),
    ],
)
def test_concurrency_features_in_local_mode_name_the_process_mode(
    pytester: pytest.Pytester, arguments: str, named: str
) -> None:
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            f"""
            import pytest
            from hp_testing import faults

            @pytest.mark.distributed(world_size=2, mode="local", {arguments})
            def test_body(rank):
                pass
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert f"mode='local' runs the ranks one at a time in one process and cannot honour {named}" in text
    assert "use the multi-process mode for it: @pytest.mark.distributed(world_size=N, mode='process'" in text


def test_a_marker_timeout_is_accepted_in_local_mode(pytester: pytest.Pytester) -> None:
    """Suites whose markers carry ``timeout=`` run under local mode unchanged (no timeout needed there)."""
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import pytest
            import torch
            import torch.distributed as dist

            @pytest.mark.distributed(world_size=2, mode="local", timeout=120)
            def test_body(rank):
                t = torch.ones(1)
                dist.all_reduce(t)
                assert t.item() == 2.0
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_local_marker_reports_each_failing_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import pytest

            @pytest.mark.distributed(world_size=3, mode="local")
            def test_body(rank):
                print(f"hello from {rank}")
                assert rank != 2, "planted"
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "distributed test on 3 rank(s) over hplocal (local mode): failed on rank(s) [2]" in text
    assert "AssertionError: planted" in text and "hello from 1" in text


# -- hp-run --local -------------------------------------------------------------------------------------

SCRIPT = """
import sys
import hp_core
import torch
import torch.distributed as dist

hp_core.init_distributed()
t = torch.tensor([float(dist.get_rank())])
hp_core.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():g} args {sys.argv[1:]}")
if "fail" in sys.argv and dist.get_rank() == 5:
    sys.exit(7)
"""


def test_hp_run_local_runs_a_script_on_every_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hp_testing.launcher import main

    main_before = sys.modules["__main__"]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["--local", "-n", "8", str(script), "--lr", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[rank{r}]: rank {r} of 8: sum 28 args ['--lr', '3']" for r in range(8)]
    assert main(["--local", "-n", "8", str(script), "fail"]) == 7
    assert "[hp-run] rank 5 failed with exit code 7 (local mode)" in capsys.readouterr().err
    # the caller's __main__ is back (multiprocessing re-runs it in every child it spawns)
    assert sys.modules["__main__"] is main_before


PLANTED_BAND = """
import hp_core
import torch
import torch.distributed as dist

hp_core.init_distributed()
t = torch.ones(2, dtype=torch.int32)
dist.all_reduce(t, op=dist.ReduceOp.BAND)  # gloo has it; NCCL does not
print("ok")
"""


def test_hp_run_local_emulate_applies_the_backends_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hp-run --local --emulate nccl``: NCCL's rules hold in local mode too; gloo's plain run passes."""
    from hp_testing.launcher import main

    script = tmp_path / "band.py"
    script.write_text(PLANTED_BAND)
    assert main(["--local", "-n", "4", str(script)]) == 0
    capsys.readouterr()
    assert main(["--local", "-n", "4", "--emulate", "nccl", str(script)]) != 0
    err = capsys.readouterr().err
    assert "BAND" in err or "band" in err, err


@pytest.mark.parametrize(("flags", "named"), [(["--strict"], "--strict (async hazards)")])
def test_hp_run_local_refuses_concurrency_features_naming_the_process_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    from hp_testing.launcher import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with pytest.raises(SystemExit) as exit_:
        main(["--local", "-n", "4", *flags, str(script)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--local: {named}" in err
    assert f"use the multi-process mode instead: hp-run -n 4 {' '.join(flags)} {script}" in err

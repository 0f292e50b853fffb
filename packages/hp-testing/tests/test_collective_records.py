"""record_collectives: every hp_core collective of a block, with its group and payload, on each rank."""

from __future__ import annotations

import hp_core
import hp_core.collectives as hc
import pytest
import torch
import torch.distributed as dist
from hp_testing import CollectiveRecord, record_collectives


@pytest.mark.parametrize(
    "backend_name",
    [
        pytest.param(b, marks=pytest.mark.distributed(world_size=4, backend=b), id=b)
        for b in ("gloo", "nccl-emu", "hccl-emu")
    ],
)
def test_records_name_group_payload_and_async(rank: int, backend_name: str) -> None:
    pair = [0, 1] if rank < 2 else [2, 3]
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in ([0, 1], [2, 3])}
    mesh = hp_core.init_device_mesh("cpu", (4,))
    originals = {name: getattr(hc, name) for name in ("all_reduce", "broadcast", "reduce_scatter_tensor")}

    with record_collectives() as outer:
        hc.all_reduce(torch.ones(10))  # float32, the world
        gathered = torch.empty(6, dtype=torch.float64)
        hc.all_gather_into_tensor(
            gathered, torch.full((3,), float(rank), dtype=torch.float64), groups[tuple(pair)]
        )
        with record_collectives() as inner:
            from hp_core import all_reduce  # the package's name for it is recorded too

            all_reduce(torch.ones(3, dtype=torch.float64), "sum", groups[tuple(pair)])
            out = torch.empty(2)
            work = hc.reduce_scatter_tensor(out, torch.ones(8), group=mesh, async_op=True)
        work.wait()
        hc.broadcast(torch.zeros(5, dtype=torch.int64), src=0)
        with pytest.raises(ValueError):  # a bad call is not issued, so not recorded
            hc.all_reduce(torch.ones(4), "no-such-op")

    world = (0, 1, 2, 3)
    assert list(outer) == [
        CollectiveRecord("all_reduce", world, 40, torch.float32, False),
        CollectiveRecord("all_gather_into_tensor", tuple(pair), 48, torch.float64, False),
        CollectiveRecord("all_reduce", tuple(pair), 24, torch.float64, False),
        CollectiveRecord("reduce_scatter_tensor", world, 32, torch.float32, True),
        CollectiveRecord("broadcast", world, 40, torch.int64, False),
    ]
    assert [r.name for r in inner] == ["all_reduce", "reduce_scatter_tensor"]
    assert gathered.tolist() == [float(pair[0])] * 3 + [float(pair[1])] * 3  # the real call ran
    assert out.tolist() == [4.0, 4.0]
    assert outer.counts() == {
        "all_reduce": 2,
        "all_gather_into_tensor": 1,
        "reduce_scatter_tensor": 1,
        "broadcast": 1,
    }
    assert outer.count("all_reduce") == 2
    assert outer.count("all_reduce", group_ranks=pair) == 1
    assert outer.nbytes("all_reduce") == 64
    assert outer.nbytes() == 40 + 48 + 24 + 32 + 40
    assert outer[1].group_ranks == tuple(pair)
    with pytest.raises(ValueError, match="'all_gather' is not a recorded collective"):
        outer.count("all_gather")

    # Restored on exit: the functions are the originals again and nothing more is recorded.
    assert all(getattr(hc, name) is fn and getattr(hp_core, name) is fn for name, fn in originals.items())
    hc.all_reduce(torch.ones(2))
    assert len(outer) == 5


@pytest.mark.distributed(world_size=2)
def test_restored_when_the_block_raises_and_clear_starts_over(rank: int) -> None:
    original = hc.all_gather_into_tensor
    with pytest.raises(RuntimeError, match="planted"):
        with record_collectives() as log:
            hc.all_gather_into_tensor(torch.empty(4), torch.ones(2))
            assert hc.all_gather_into_tensor is not original
            raise RuntimeError("planted")
    assert hc.all_gather_into_tensor is original and hp_core.all_gather_into_tensor is original
    assert log.count() == 1

    with record_collectives() as log:
        hc.all_reduce(torch.ones(2))
        log.clear()
        hc.all_to_all_single(torch.empty(4), torch.ones(4))
    assert [(r.name, r.nbytes) for r in log] == [("all_to_all_single", 16)]

"""record_collectives records hp_core's point-to-point transfers apart from the collectives' totals."""

from __future__ import annotations

import hp_core
import hp_core.p2p as hp2p
import pytest
import torch
from hp_testing.collectives import P2PRecord, record_collectives


@pytest.mark.parametrize(
    "backend_name",
    [
        pytest.param(b, marks=pytest.mark.distributed(world_size=2, backend=b), id=b)
        for b in ("gloo", "nccl-emu")
    ],
)
def test_p2p_records_name_peer_bytes_and_batches(rank: int, backend_name: str) -> None:
    peer = 1 - rank
    world = (0, 1)
    originals = {
        name: getattr(hp2p, name) for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv")
    }
    with record_collectives() as log:
        if rank == 0:
            hp_core.send(torch.ones(3), 1)  # posts hp_core's isend inside: recorded once, as a send
            got = hp_core.recv(torch.empty(2, dtype=torch.float64), 1)
        else:
            got = hp_core.recv(torch.empty(3), 0)
            hp_core.send(torch.full((2,), 2.0, dtype=torch.float64), 0)
        hp_core.all_reduce(torch.ones(4))
        # the hp_core functions themselves as a batch item's op, read while the block records
        out = torch.empty(5)
        hp_core.batch_isend_irecv(
            [
                hp_core.P2POp(hp_core.isend, torch.full((5,), float(rank)), peer),
                hp_core.P2POp("irecv", out, peer),
            ]
        ).wait()
        with record_collectives() as inner:
            hp_core.irecv(torch.empty(1), peer).wait() if rank else hp_core.isend(torch.ones(1), peer).wait()
    assert out.tolist() == [float(peer)] * 5 and got.numel() == (2 if rank == 0 else 3)
    sent, received = (3 * 4, 2 * 8) if rank == 0 else (2 * 8, 3 * 4)
    assert log.p2p()[:2] == [
        P2PRecord("send" if rank == 0 else "recv", peer, world, 12, torch.float32),
        P2PRecord("recv" if rank == 0 else "send", peer, world, 16, torch.float64),
    ]
    assert [(r.name, r.batch) for r in log.p2p()[2:4]] == [("isend", 0), ("irecv", 0)]
    assert log.p2p_batches() == 1
    assert log.p2p_count() == 5 and log.p2p_count(peer=peer) == 5 and log.p2p_count(peer=rank) == 0
    assert log.p2p_nbytes("sent") == sent + 20 + (4 if rank == 0 else 0)
    assert log.p2p_nbytes("received") == received + 20 + (4 if rank == 1 else 0)
    assert inner.p2p_count("isend" if rank == 0 else "irecv") == 1 and inner.p2p_count() == 1
    # the collectives' totals are unchanged by the transfers
    assert len(log) == 1 and log.count() == 1 and log.nbytes() == 16 and log.counts() == {"all_reduce": 1}
    with pytest.raises(ValueError, match="'all_gather' is not a recorded point-to-point name"):
        log.p2p("all_gather")
    log.clear()
    assert log.p2p_count() == 0 and log.p2p_batches() == 0
    # restored on exit
    assert all(getattr(hp2p, n) is fn and getattr(hp_core, n) is fn for n, fn in originals.items())


@pytest.mark.distributed(world_size=2)
def test_p2p_that_raises_is_not_recorded(rank: int) -> None:
    with record_collectives() as log:
        with pytest.raises(ValueError, match="this rank itself"):
            hp_core.isend(torch.ones(2), rank)
    assert log.p2p_count() == 0

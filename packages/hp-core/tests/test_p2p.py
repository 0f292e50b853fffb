"""Point-to-point transfers of tensors and objects, and the mistakes caught before they hang."""

from __future__ import annotations

import hp_core
import pytest
import torch
from hp_core import P2POp


def on_ranks(*sizes: int) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "n", [pytest.param(s, marks=pytest.mark.distributed(world_size=s), id=f"{s}ranks") for s in sizes]
    )


@on_ranks(2, 4)
def test_blocking_send_recv_ring(rank, world_size, n):
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    outgoing = torch.full((3,), float(rank))
    incoming = torch.empty(3)
    # Even ranks send first, odd ranks receive first: blocking calls cannot deadlock.
    if rank % 2 == 0:
        hp_core.send(outgoing, nxt)
        assert hp_core.recv(incoming, prev) is incoming
    else:
        hp_core.recv(incoming, prev)
        hp_core.send(outgoing, nxt)
    assert incoming.tolist() == [float(prev)] * 3


@on_ranks(2, 4)
def test_isend_irecv_both_directions(rank, world_size, n):
    # Pairs (0,1), (2,3): each rank sends to and receives from its partner. The
    # even rank sends first and the odd one receives first, the order that
    # cannot deadlock where send and receive block (NCCL, HCCL).
    partner = rank ^ 1
    incoming = torch.empty(2, dtype=torch.int64)
    send = lambda: hp_core.isend(torch.tensor([rank, 7]), partner, tag=1)  # noqa: E731
    recv = lambda: hp_core.irecv(incoming, partner, tag=1)  # noqa: E731
    works = [send(), recv()] if rank % 2 == 0 else [recv(), send()]
    results = [w.wait() for w in works]
    received = results[1] if rank % 2 == 0 else results[0]
    assert received is incoming  # irecv's handle yields the receive buffer
    assert incoming.tolist() == [partner, 7]


@on_ranks(2, 4)
def test_batch_isend_irecv_ring(rank, world_size, n):
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    received = torch.empty(2, 2)
    work = hp_core.batch_isend_irecv(
        [
            P2POp("isend", torch.full((2, 2), float(rank)), nxt),
            P2POp(hp_core.irecv, received, prev),
        ]
    )
    tensors = work.wait()
    assert tensors[1] is received
    assert torch.equal(received, torch.full((2, 2), float(prev)))


@pytest.mark.distributed(world_size=2)
def test_objects_between_two_ranks(rank, world_size):
    if rank == 0:
        hp_core.send_object({"shape": (2, 3), "dtype": "float32"}, dst=1)
        assert hp_core.recv_object(src=1) == ["reply", 1]
    else:
        assert hp_core.recv_object(src=0) == {"shape": (2, 3), "dtype": "float32"}
        hp_core.send_object(["reply", 1], dst=0)


@pytest.mark.distributed(world_size=2)
def test_p2p_errors(rank, world_size):
    with pytest.raises(ValueError, match=rf"dst={rank} is this rank itself.*Copy the tensor locally"):
        hp_core.send(torch.ones(1), rank)
    with pytest.raises(ValueError, match=r"src=2 is not in the group, whose global ranks are \[0, 1\]"):
        hp_core.irecv(torch.ones(1), 2)
    with pytest.raises(ValueError, match=r"tensor is not contiguous \(shape \(2,\), stride \(2,\)\)"):
        hp_core.isend(torch.ones(2, 2)[:, 0], 1 - rank)
    with pytest.raises(TypeError, match="dst must be an int"):
        hp_core.send_object("x", dst="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the op list is empty"):
        hp_core.batch_isend_irecv([])
    with pytest.raises(ValueError, match=r"P2POp: op='broadcast' is not a transfer; use 'isend' or 'irecv'"):
        hp_core.batch_isend_irecv([P2POp("broadcast", torch.ones(1), 1 - rank)])
    with pytest.raises(TypeError, match=r"item 0 is a tuple, not an hp_core P2POp"):
        hp_core.batch_isend_irecv([("isend", torch.ones(1), 1)])  # type: ignore[list-item]
    # Nothing was sent, so a real exchange still pairs up.
    got = hp_core.batch_isend_irecv(
        [
            P2POp("isend", torch.tensor([rank]), 1 - rank),
            P2POp("irecv", torch.empty(1, dtype=torch.int64), 1 - rank),
        ]
    ).wait()
    assert got[1].tolist() == [1 - rank]


@pytest.mark.distributed(world_size=4)
def test_p2p_within_a_mesh_group(rank, world_size):
    mesh = hp_core.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    partner = rank ^ 1  # the other rank of this row
    received = torch.empty(1, dtype=torch.int64)
    # Even ranks send first, odd ranks receive first: safe where p2p blocks.
    send = lambda: hp_core.isend(torch.tensor([rank]), partner, tp)  # noqa: E731
    recv = lambda: hp_core.irecv(received, partner, tp)  # noqa: E731
    for work in [send(), recv()] if rank % 2 == 0 else [recv(), send()]:
        work.wait()
    assert received.tolist() == [partner]
    other_row = (rank + 2) % 4
    with pytest.raises(ValueError, match=rf"dst={other_row} is not in the group, whose global ranks are"):
        hp_core.isend(torch.ones(1), other_row, tp)
    dp = mesh.get_group("dp")
    with pytest.raises(
        ValueError, match=r"item 1 uses group .* but item 0 uses .* a batch must use one group"
    ):
        hp_core.batch_isend_irecv(
            [P2POp("isend", torch.ones(1), partner, tp), P2POp("isend", torch.ones(1), other_row, dp)]
        )

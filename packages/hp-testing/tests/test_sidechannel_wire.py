"""The checks' store values are JSON, and a value someone else wrote runs nothing.

The TCPStore the checks share listens on every interface, so any host that
reaches its port can write the keys the ranks read. Each test here forges
such a value (a pickle whose unpickling would create a file, and values that
are not pickles at all) under a key a rank reads, and checks that reading it
creates no file and raises a ``ForeignValueError`` naming the key, rather than
running the payload, crashing obscurely or hanging the peers.
"""

from __future__ import annotations

import datetime
import itertools
import pickle
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from hp_testing import _sidechannel
from hp_testing._calls import Call

_PREFIXES = itertools.count()


class _CreatesFile:
    """Unpickling this calls ``open(path, "w")``: the file's existence proves the pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def store() -> Iterator[Any]:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    yield server


def _collective() -> Call:
    return Call(
        name="all_reduce",
        kind="collective",
        group=None,
        group_ranks=(0, 1),
        group_name="g",
        key=("all_reduce", 4, "torch.float32", "sum", None),
        shown="all_reduce(tensor 4 torch.float32, op SUM)",
        site="test_x.py:1 in test_x",
    )


def _send() -> Call:
    return Call(
        name="isend",
        kind="p2p",
        group=None,
        group_ranks=(0, 1),
        group_name="g",
        peer=1,
        key=("isend", 2, "torch.float32"),
        shown="isend(2 torch.float32 to rank 1)",
        site="test_x.py:2 in test_x",
    )


def _p2p(channel: _sidechannel.SideChannel) -> None:
    channel.p2p_wait(channel.p2p_issue(_send()))


# (the key rank 1 "wrote", as rank 0's channel sees it; what rank 0 does that reads it)
READS: dict[str, tuple[str, Callable[[_sidechannel.SideChannel], object]]] = {
    "fingerprint": ("c/g/0/1", lambda ch: ch.collective(_collective())),
    "status": ("status/1", lambda ch: ch.collective(_collective())),
    "done-while-waiting": ("done/1", lambda ch: ch.collective(_collective())),
    "blocked": ("blocked/1", lambda ch: ch.collective(_collective())),
    "p2p-other-end": ("r/g/0/1/0", _p2p),
    "done-at-end": ("done/1", lambda ch: ch.finish()),
}

FORGED: dict[str, Callable[[Path], bytes]] = {
    "pickle": lambda marker: pickle.dumps(_CreatesFile(str(marker))),
    "json-wrong-shape": lambda _: b'{"hp": "status", "kind": "failed", "text": ["not", "text"]}',
    "json-array": lambda _: b'["died", "the process exited with code 0"]',
    "not-utf8": lambda _: b"\xff\xfe\x00junk",
    "deep-nesting": lambda _: b"[" * 200_000,
}


@pytest.mark.parametrize("forged", FORGED)
@pytest.mark.parametrize("read", READS)
def test_a_forged_value_runs_nothing_and_names_its_key(
    store: Any, tmp_path: Path, read: str, forged: str
) -> None:
    key, action = READS[read]
    marker = tmp_path / "pickle-was-run"
    prefix = f"forged-{next(_PREFIXES)}"
    dist.PrefixStore(prefix + "/", store).set(key, FORGED[forged](marker))
    channel = _sidechannel.SideChannel(store, prefix, 0, 2, stream_ordered=True)
    with pytest.raises(Exception) as caught:
        action(channel)
    assert not marker.exists(), f"reading {key!r} unpickled the forged value and ran its code"
    assert isinstance(caught.value, _sidechannel.ForeignValueError), caught.value
    message = str(caught.value)
    assert f"the store value under '{prefix}/{key}' is not a" in message
    assert "nothing of the value was run or unpickled" in message


def test_every_record_survives_the_round_trip() -> None:
    from hp_testing._wire import Blocked, Done, Fingerprint, P2PEnd, Status, decode, encode

    records = [
        Fingerprint(["all_to_all_single", "torch.float32", [3, 4]], "a2a(...)", "x.py:1", ([1, 2], [2, 1])),
        Fingerprint(["barrier"], "barrier()", "x.py:2"),
        P2PEnd(["isend", 2, "torch.float32"], "isend(...)", "x.py:3", pos=4, dropped=True, tag=7),
        Status("died", "the process exited with code 77"),
        Done({"0": (3, "all_reduce(...) at x.py:4")}, {("0", 0, 1): 2, ("0#tag3", 1, 0): 1}),
        Blocked([("c/0/1/1", 1), ("r/0/1/0/0", 1)], "all_reduce(...)", "x.py:5"),
        Blocked(),
    ]
    for record in records:
        assert decode(encode(record), "k", type(record)) == record


def test_a_record_of_another_kind_is_refused() -> None:
    from hp_testing._wire import Done, Status, decode, encode

    with pytest.raises(_sidechannel.ForeignValueError, match="its 'hp' tag is 'done', not 'status'"):
        decode(encode(Done()), "status/1", Status)


def test_a_forged_status_fails_one_test_and_the_pool_goes_on(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    marker = tmp_path / "pickle-was-run"
    body = f"""
    import pickle, time
    import pytest, torch, torch.distributed as dist
    from hp_testing.emulation import active_layer

    class CreatesFile:
        def __reduce__(self):
            return (open, ({str(marker)!r}, "w"))

    @pytest.mark.distributed(world_size=2)
    def test_forged(rank):
        if rank == 1:  # as a host on the network would: write rank 1's status key
            active_layer().channel.store.set("status/1", pickle.dumps(CreatesFile()))
            time.sleep(3)
        else:
            dist.all_reduce(torch.ones(1))  # waits for rank 1, reads its status key

    @pytest.mark.distributed(world_size=2)
    def test_after(rank):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
    """
    pytester.makepyfile(test_inner=textwrap.dedent(body))
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert not marker.exists(), "a rank unpickled the forged status and ran its code"
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*rank 0 failed*", "*ForeignValueError: the store value under '*/status/1' is not a status record*"]
    )

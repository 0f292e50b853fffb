"""Entry point of one ``hp-run --emulate nccl|hccl`` rank: install the layer, then run the script.

The user's script runs unchanged (``runpy``, as ``python script.py`` would):
``hp_core.init_distributed()`` sees the emulated platform and asks for
``nccl``, which the layer maps to gloo; collectives and p2p go through the
same rules and cross-rank checks as in the pytest harness. The checks use
their own client of the rendezvous store, created after the script
initialised its process group.
"""

from __future__ import annotations

import datetime
import os
import runpy
import sys
import traceback
from types import TracebackType
from typing import Any


def _channel_factory() -> Any:
    import torch.distributed as dist

    from hp_testing._sidechannel import SideChannel
    from hp_testing.emulation import active_layer

    layer = active_layer()
    if layer is None or not dist.is_initialized():
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=300),
    )
    prefix = f"hp-check/hp-run-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    return SideChannel(
        store,
        prefix,
        dist.get_rank(),
        dist.get_world_size(),
        stream_ordered=layer.profile.stream_ordered_p2p,
        tags=layer.profile.p2p_tags,
    )


def main(argv: list[str]) -> None:
    profile, checks, *rest = argv
    from hp_testing.emulation import install

    layer = install(profile, checks=checks == "checks")
    layer.channel_factory = _channel_factory
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        layer.post_failure("".join(traceback.format_exception(kind, exc, tb)))
        previous(kind, exc, tb)

    sys.excepthook = excepthook
    if rest and rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

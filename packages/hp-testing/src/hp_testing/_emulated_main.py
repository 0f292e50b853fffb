"""Entry point of one ``hp-run --emulate nccl|hccl`` (or ``--strict``) rank: the layer, then the script.

The user's script runs unchanged (``runpy``, as ``python script.py`` would):
``hp_core.init_distributed()`` sees the emulated platform and asks for
``nccl``, which the layer maps to gloo; collectives and p2p go through the
same rules and cross-rank checks as in the pytest harness. The checks use
their own client of the rendezvous store, created after the script
initialised its process group.

Strict mode is the layer's own (``Layer.strict``, as for the marker's
``strict=True``): a read of a pending async call's output, or a write to
its input, raises where it happens, naming both lines, and once the script
has ended normally, async work it never waited is reported and the rank exits 1.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from types import TracebackType
from typing import Any

from hp_testing._rank_main import run_and_exit, run_script


def channel_prefix() -> str:
    """The store prefix of the checks in an ``hp-run`` run (the launcher posts rank exits under it)."""
    return f"hp-check/hp-run-{os.environ.get('TORCHELASTIC_RUN_ID', 'hp-run')}"


def _channel_factory() -> Any:
    import torch.distributed as dist

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
    return layer.new_channel(store, channel_prefix(), dist.get_rank(), dist.get_world_size())


def main(argv: list[str]) -> None:
    """``argv``: profile name, ``checks``/``no-checks``, ``strict``/``no-strict``, then the target."""
    profile, checks, strict, *rest = argv
    from hp_testing.emulation import install

    layer = install(profile, checks=checks == "checks", strict=strict == "strict")
    layer.channel_factory = _channel_factory
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        layer.post_failure("".join(traceback.format_exception(kind, exc, tb)))
        previous(kind, exc, tb)

    sys.excepthook = excepthook

    def body() -> None:
        try:
            run_script(rest)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise  # the script failed: its own status stands
        if layer.strict:
            _report_unwaited(layer)

    run_and_exit(body)  # [Note: a rank ends without interpreter finalization]


def _report_unwaited(layer: Any) -> None:
    """Exit 1 naming every never-waited async call; the message (with call sites) is the whole report.

    A traceback would show only the harness: the script's frames are gone by now.
    """
    from hp_testing._hazards import AsyncHazardError

    try:
        layer.check_unwaited()
    except AsyncHazardError as exc:
        text = f"{type(exc).__name__}: {exc}"
        layer.post_failure(text)
        sys.stderr.write(f"rank {os.environ.get('RANK', '?')}: {text}\n")  # one write: lines stay together
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])

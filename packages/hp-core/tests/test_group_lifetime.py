"""The default group dies at ``destroy_process_group()``, not at interpreter exit.

torch.distributed.nn.functional binds ``group.WORLD`` into ten functions' default
arguments when it is first imported, and the first torch.optim optimizer imports it
(through torch._dynamo). Imported after the default group exists, those defaults
keep the group, and gloo's worker threads, alive into interpreter finalization,
where a worker dropping its last work aborts the process about one run in ten
("terminate called without an active exception"). hp_core imports the module
before any group can exist; this runs the sequence a training script runs, in a
fresh interpreter, and checks that nothing keeps the group.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    import torch
    import hp_core
    import torch.distributed as dist

    hp_core.init_distributed("gloo")
    group = dist.group.WORLD
    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # imports torch.distributed.nn.functional
    import torch.distributed.nn.functional as fn

    held = [d for f in vars(fn).values() for d in (getattr(f, "__defaults__", None) or ()) if d is group]
    assert not held, f"{len(held)} defaults of torch.distributed.nn.functional hold the default group"
    probe = weakref.ref(group)
    del group
    dist.destroy_process_group()
    gc.collect()
    assert probe() is None, "the default group outlived destroy_process_group()"
    print("group freed")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_default_group_is_freed_at_destroy() -> None:
    port = str(_free_port())
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "group freed" in result.stdout

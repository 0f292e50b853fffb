"""The pool's own lifecycle: keys that never repeat, and a start that failed is tried again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hp_testing import PoolError, WorkerPool
from hp_testing import pool as pool_module
from hp_testing._worker import Task


def test_pool_keys_never_repeat_even_when_memory_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every pool of a process shares one store; a later pool that got an earlier pool's key read
    # the dead ranks' addresses there. Pretend every object lives at the same address.
    monkeypatch.setattr(pool_module, "id", lambda obj: 0x1234, raising=False)
    keys = {WorkerPool(2)._key for _ in range(3)}
    assert len(keys) == 3, keys


def test_a_pool_that_failed_to_start_starts_again_for_the_next_task(tmp_path: Path) -> None:
    body = tmp_path / "pool_body.py"
    body.write_text(
        "import torch, torch.distributed as dist\n\n"
        "def body(rank):\n"
        "    t = torch.ones(1) * (rank + 1)\n"
        "    dist.all_reduce(t)\n"
        "    assert t.item() == 3.0\n"
    )
    task = Task(
        nodeid="pool_body.py::body",
        module_name="pool_body",
        module_file=str(body),
        class_name=None,
        function_name="body",
        kwargs={"rank": None},
        sys_path=[str(tmp_path), *sys.path],
    )
    pool = WorkerPool(2)
    pool.start()
    try:
        with pytest.raises(PoolError, match=r"ranks \[0, 1\] did not join within 0 s"):
            pool.wait_ready(timeout_s=0.0)
        outcome = pool.run(task, timeout_s=120.0)  # forks the ranks again instead of failing
        assert outcome.ok, outcome
        outcome = pool.run(task, timeout_s=120.0)
        assert outcome.ok, outcome
    finally:
        pool.shutdown()

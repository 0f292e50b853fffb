"""torch's test classes and local mode: refused with the reason, or run on processes with one warning.

Local mode runs every rank as a thread of one process; torch's classes are
written for a process per rank. An inner pytest session under
``HP_TEST_MODE=local`` holds a class marked ``mode='local'`` (an error that says
why and what to do) and two plain classes (pooled as processes, one warning).
"""

from __future__ import annotations

import pytest

# Imported here, before the inner session: pytester forgets the modules an inner session imported,
# and torch's harness cannot be imported twice in one process (it registers torch libraries).
import torch.testing._internal.common_distributed  # noqa: F401

CLASSES = """
import os
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TwoRanks(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_all_reduce(self):
        dist.init_process_group(
            "gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=self.world_size
        )
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 3.0)
        # A rank of its own: not the pytest process (local mode would run it there).
        self.assertNotEqual(os.getpid(), {pytest_pid})


class AlsoTwoRanks(TwoRanks):
    pass


@pytest.mark.distributed(mode="local")
class MarkedLocal(TwoRanks):
    pass
"""


def test_torch_classes_say_why_they_do_not_run_in_local_mode(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setenv("HP_TEST_MODE", "local")
    pytester.makepyfile(test_classes=CLASSES.replace("{pytest_pid}", str(os.getpid())))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()

    # The marker: an error that says why and what to do instead.
    failing = out.split("MarkedLocal.test_all_reduce _")[1].split("\n____")[0]
    for words in (
        "@pytest.mark.distributed(mode='local') on a torch test class",
        "torch's test classes run each rank as a process (a TestCase per rank, self.rank, "
        "init_process_group on a file store, c10d state per process), and local mode's ranks "
        "share one process",
        "drop mode= from the marker",
        "mode='local') taking the rank / device_mesh_factory fixtures",
    ):
        assert words in " ".join(failing.split()), failing

    # The environment variable: the classes run on the process pool, and the run says so once.
    assert out.count("$HP_TEST_MODE=local does not apply to torch test classes") == 1, out
    result.stdout.fnmatch_lines(
        [
            "*$HP_TEST_MODE=local does not apply to torch test classes*a TestCase per rank*"
            "they run on hp-testing's process pool anyway*",
        ]
    )
    result.stdout.fnmatch_lines(["*hp-testing: 2 torch test class(es) ran on pooled ranks*"])

"""The early forkserver: not started when the session will pool torch's test classes.

[Note: no early forkserver for torch's test classes] in ``hp_testing._prestart``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hp_testing._prestart import session_pools_torch_classes

#: An inner conftest that records whether a forkserver ran by the time pytest configures.
CONFTEST = """
import os
from multiprocessing import forkserver


def pytest_configure(config):
    started = forkserver._forkserver._forkserver_pid is not None
    print(f"EARLY FORKSERVER: {started}", flush=True)
    os._exit(0)  # the answer is in: skip collection (the forkserver ends with this process)
"""

TORCH_CLASS = """
from torch.testing._internal.common_distributed import MultiProcessTestCase


class Nothing(MultiProcessTestCase):
    pass
"""

MARKED = """
def test_plain():
    pass
"""


def _early(pytester: pytest.Pytester, *args: str) -> bool:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    for line in result.outlines:
        if line.startswith("EARLY FORKSERVER: "):
            return line.endswith("True")
    raise AssertionError(result.stdout.str())


def test_no_early_forkserver_when_torch_classes_will_be_pooled(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    folder = pytester.mkpydir("suite")
    (folder / "test_torch.py").write_text(TORCH_CLASS)
    (folder / "test_plain.py").write_text(MARKED)
    # pool.preload forks the forkserver from pytest after collection; plain tests alone still
    # start it early (the command lines below, without a subprocess each).
    assert not _early(pytester, "suite")


def test_which_command_lines_pool_torch_classes(tmp_path: Path) -> None:
    (tmp_path / "test_dtensor.py").write_text(
        "from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase\n"
    )
    (tmp_path / "test_sub.py").write_text(
        "from mybase import Base\n\nclass T(MultiProcessTestCase):\n    pass\n"
    )
    (tmp_path / "test_mention.py").write_text("# MultiProcessTestCase is only named here\n")
    (tmp_path / "helper.py").write_text("import torch.testing._internal.common_distributed\n")
    for name in ("test_dtensor.py", "test_sub.py"):
        path = str(tmp_path / name)
        assert session_pools_torch_classes(["-q", path])
        assert session_pools_torch_classes([f"{path}::T::test_x"])
        assert not session_pools_torch_classes([path, "--hp-torch-testcases=torch"])
        assert not session_pools_torch_classes([path, "--hp-torch-testcases", "torch"])
    assert not session_pools_torch_classes([str(tmp_path / "test_mention.py")])
    assert not session_pools_torch_classes([str(tmp_path / "helper.py").replace("helper", "test_none")])
    assert not session_pools_torch_classes([str(tmp_path / "missing.py"), "-k", "x"])
    assert session_pools_torch_classes([str(tmp_path)])  # a folder: its test files
    (tmp_path / "test_dtensor.py").unlink()
    (tmp_path / "test_sub.py").unlink()
    assert not session_pools_torch_classes([str(tmp_path)])  # helper.py is no test file


#: Registered before the plugin's exit hook, so it runs after it: what interpreter teardown sees.
EXIT_CONFTEST = """
import atexit
import gc


def _report():
    print(f"FROZEN AT EXIT: {gc.get_freeze_count() > 0}", flush=True)


atexit.register(_report)
"""

EXIT_TESTS = """
import pytest

FINALIZED = {path!r}


class Cycle:
    def __init__(self):
        self.me = self

    def __del__(self):
        with open(FINALIZED, "w") as f:
            f.write("yes")


def test_leaves_cyclic_garbage():
    Cycle()


@pytest.mark.distributed(world_size=1)
def test_pooled(rank):
    assert rank == 0
"""


def test_a_session_that_pooled_ranks_leaves_without_sweeping_torchs_heap(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    # [Note: leaving without sweeping torch's heap] in hp_testing.plugin: teardown's collections
    # skip what the process froze at exit, and garbage the tests left is still finalized.
    finalized = tmp_path / "finalized.txt"
    pytester.makeconftest(EXIT_CONFTEST)
    pytester.makepyfile(test_exit=EXIT_TESTS.format(path=str(finalized)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert "FROZEN AT EXIT: True" in result.outlines, result.stdout.str()
    assert finalized.read_text() == "yes"

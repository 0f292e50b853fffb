"""hp-testing: run multi-process PyTorch tests on CPU, fast, and launch scripts locally.

The pytest plugin (``@pytest.mark.distributed(world_size=N)``) is registered
through the ``pytest11`` entry point; nothing here is needed at run time by
any other hp package.
"""

from hp_testing.__about__ import __version__
from hp_testing.fixtures import DeviceMeshFactory
from hp_testing.pool import Outcome, PoolError, WorkerPool

__all__ = ["DeviceMeshFactory", "Outcome", "PoolError", "WorkerPool", "__version__"]

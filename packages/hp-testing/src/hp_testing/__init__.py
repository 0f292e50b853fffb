"""hp-testing: run multi-process PyTorch tests on CPU, fast, and launch scripts locally.

The pytest plugin (``@pytest.mark.distributed(world_size=N)``) is registered
through the ``pytest11`` entry point; nothing here is needed at run time by
any other hp package.
"""

from hp_testing import faults
from hp_testing.__about__ import __version__
from hp_testing._hazards import AsyncHazardError
from hp_testing._sidechannel import (
    CollectiveMismatchError,
    DeadlockError,
    DroppedMessageError,
    P2PMismatchError,
    PeerFailedError,
    UnmatchedError,
)
from hp_testing.fixtures import DeviceMeshFactory
from hp_testing.pool import Outcome, PoolError, WorkerPool
from hp_testing.profiles import BackendRuleError

__all__ = [
    "AsyncHazardError",
    "BackendRuleError",
    "CollectiveMismatchError",
    "DeadlockError",
    "DeviceMeshFactory",
    "DroppedMessageError",
    "Outcome",
    "P2PMismatchError",
    "PeerFailedError",
    "PoolError",
    "UnmatchedError",
    "WorkerPool",
    "__version__",
    "faults",
]

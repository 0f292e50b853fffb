"""hp-testing: run multi-process PyTorch tests on CPU, fast, and launch scripts locally.

The pytest plugin (``@pytest.mark.distributed(world_size=N)``) is registered
through the ``pytest11`` entry point; nothing here is needed at run time by
any other hp package.
"""

from hp_testing import _prestart

_prestart.start_forkserver_early()  # before the imports below pull in torch

from hp_testing import faults  # noqa: E402
from hp_testing.__about__ import __version__  # noqa: E402
from hp_testing._hazards import AsyncHazardError  # noqa: E402
from hp_testing._sidechannel import (  # noqa: E402
    CollectiveMismatchError,
    DeadlockError,
    DroppedMessageError,
    P2PMismatchError,
    PeerFailedError,
    UnmatchedError,
)
from hp_testing.collectives import (  # noqa: E402
    CollectiveLog,
    CollectiveRecord,
    P2PRecord,
    record_collectives,
)
from hp_testing.fixtures import DeviceMeshFactory  # noqa: E402
from hp_testing.host_syncs import HostSync, HostSyncLog, count_host_syncs  # noqa: E402
from hp_testing.local import ConcurrencyNeededError, LocalHangError, LocalModeFailed, run_local  # noqa: E402
from hp_testing.pool import Outcome, PoolError, WorkerPool  # noqa: E402
from hp_testing.profiles import BackendRuleError  # noqa: E402

__all__ = [
    "AsyncHazardError",
    "BackendRuleError",
    "CollectiveLog",
    "CollectiveMismatchError",
    "CollectiveRecord",
    "ConcurrencyNeededError",
    "DeadlockError",
    "DeviceMeshFactory",
    "DroppedMessageError",
    "HostSync",
    "HostSyncLog",
    "LocalHangError",
    "LocalModeFailed",
    "Outcome",
    "P2PMismatchError",
    "P2PRecord",
    "PeerFailedError",
    "PoolError",
    "UnmatchedError",
    "WorkerPool",
    "__version__",
    "count_host_syncs",
    "faults",
    "record_collectives",
    "run_local",
]

"""hp_core: the platform seam, collectives with async handles, and a named n-D DeviceMesh.

Nothing happens at import: the platform is resolved when asked for, process
groups are created when a mesh needs them. See the package README for the
capability table of each communication backend.
"""

import os as _os

from hp_core.__about__ import __version__
from hp_core._checks import NotInitializedError
from hp_core.agreement import verify_across_ranks
from hp_core.capabilities import (
    BackendCapabilities,
    capabilities_for,
    get_capabilities,
    register_capabilities,
    set_backend_semantics,
    use_capabilities,
)
from hp_core.carriers import DtypeRules, carrier_for, register_dtype_rules
from hp_core.collectives import (
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object,
    reduce_scatter_tensor,
)
from hp_core.debug import (
    DebugLevel,
    collect_log_lines,
    get_debug_level,
    set_debug_level,
    set_debug_level_from_env,
)
from hp_core.device import CpuEvent, CpuStream, DeviceHandle, EventLike, StreamLike
from hp_core.distributed import (
    destroy_distributed,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)
from hp_core.logging import get_logger
from hp_core.mesh import DeviceMesh, StaleMeshError, clear_group_cache, init_device_mesh
from hp_core.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, recv_object, send, send_object
from hp_core.platform import (
    Platform,
    PlatformError,
    backend_for,
    detect_device_type,
    get_platform,
    set_platform,
    use_platform,
)
from hp_core.rank_shared import share_across_ranks, shared_across_ranks
from hp_core.work import Work

if _os.environ.get(
    "HP_DISTRIBUTED_DEBUG"
):  # only when asked: configures the hp loggers ([Note: debug levels])
    set_debug_level_from_env()

__all__ = [
    "BackendCapabilities",
    "CpuEvent",
    "CpuStream",
    "DebugLevel",
    "DeviceHandle",
    "DeviceMesh",
    "DtypeRules",
    "EventLike",
    "NotInitializedError",
    "P2POp",
    "Platform",
    "PlatformError",
    "StaleMeshError",
    "StreamLike",
    "Work",
    "__version__",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "backend_for",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object",
    "capabilities_for",
    "carrier_for",
    "clear_group_cache",
    "collect_log_lines",
    "destroy_distributed",
    "detect_device_type",
    "get_capabilities",
    "get_debug_level",
    "get_local_rank",
    "get_logger",
    "get_platform",
    "get_rank",
    "get_world_size",
    "init_device_mesh",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "recv",
    "recv_object",
    "reduce_scatter_tensor",
    "register_capabilities",
    "register_dtype_rules",
    "send",
    "send_object",
    "set_backend_semantics",
    "set_debug_level",
    "set_debug_level_from_env",
    "set_platform",
    "share_across_ranks",
    "shared_across_ranks",
    "use_capabilities",
    "use_platform",
    "verify_across_ranks",
]

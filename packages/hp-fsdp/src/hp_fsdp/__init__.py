"""hp_fsdp: ``fully_shard`` for FSDP (1-D mesh) and HSDP (2-D mesh) on hp_dtensor DTensors.

Apply :func:`fully_shard` bottom-up (each block, then the root); parameters
become :class:`hp_dtensor.DTensor` shards that any torch optimizer steps on,
and the modules gain the :class:`HSDPModule` control methods. See the
package README for what is supported and what is not.
"""

from hp_fsdp.__about__ import __version__
from hp_fsdp.api import FSDPModule, HSDPModule, UnshardHandle, fully_shard
from hp_fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "__version__",
    "fully_shard",
]

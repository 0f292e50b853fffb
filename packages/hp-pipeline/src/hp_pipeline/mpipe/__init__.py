"""MPipe: multimodal pipelines whose preprocess tower runs on the rank that owns each micro-batch.

* :mod:`~hp_pipeline.mpipe.ownership`: which rank owns which micro-batch;
* :mod:`~hp_pipeline.mpipe.order`: the MPipe order over one of the base orders in ``MPIPE_BASES``;
* :mod:`~hp_pipeline.mpipe.placement`: where each owner runs the tower's forward and backward;
* :mod:`~hp_pipeline.mpipe.runner`: how the MPipe steps run;
* :mod:`~hp_pipeline.mpipe.schedule`: :class:`ScheduleMPipe`;
* :mod:`~hp_pipeline.mpipe.sampler`: :class:`PPRankOwnedSampler`.
* :mod:`~hp_pipeline.mpipe.kinds`: MPipe's step kinds (registered by ``hp_pipeline._builtin_kinds``).
"""

from hp_pipeline.mpipe.kinds import MPIPE_GROUP, is_mpipe_kind
from hp_pipeline.mpipe.order import (
    MPIPE_BASES,
    MPipeBase,
    build_mpipe_order,
    mpipe_base_layout,
    mpipe_order,
    mpipe_receives_lead,
    strip_mpipe,
)
from hp_pipeline.mpipe.ownership import OverflowMode, mpipe_owned_micros, mpipe_owner
from hp_pipeline.mpipe.placement import PLACEMENT_COSTS, place_tower_backward, place_tower_forward
from hp_pipeline.mpipe.sampler import PPRankOwnedSampler
from hp_pipeline.mpipe.schedule import ScheduleMPipe

__all__ = [
    "MPIPE_BASES",
    "MPIPE_GROUP",
    "PLACEMENT_COSTS",
    "MPipeBase",
    "OverflowMode",
    "PPRankOwnedSampler",
    "ScheduleMPipe",
    "build_mpipe_order",
    "is_mpipe_kind",
    "mpipe_base_layout",
    "mpipe_order",
    "mpipe_owned_micros",
    "mpipe_owner",
    "mpipe_receives_lead",
    "place_tower_backward",
    "place_tower_forward",
    "strip_mpipe",
]

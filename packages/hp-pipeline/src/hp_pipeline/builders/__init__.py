"""Schedule builders: functions ``(num_ranks, n_microbatches, ...) -> Order``.

Each returns a compute-only order (``F``, ``B``, ``I``, ``W``, and DualPipeV's
``OVERLAP_F_B`` pairs); run
:func:`~hp_pipeline.insert_comms` to add the point-to-point steps. Schedule
classes take their ``.order`` from these functions, so the executor never
re-derives a schedule.
"""

from hp_pipeline.builders.dualpipev import build_dualpipev_order, dualpipev_min_microbatches
from hp_pipeline.builders.gpipe import build_gpipe_order
from hp_pipeline.builders.interleaved import build_interleaved_1f1b_order, interleaved_round_size
from hp_pipeline.builders.interleaved_zero_bubble import build_interleaved_zero_bubble_order
from hp_pipeline.builders.looped_bfs import build_looped_bfs_order
from hp_pipeline.builders.one_f_one_b import build_1f1b_order
from hp_pipeline.builders.placement import stage_to_rank, stages_on_rank
from hp_pipeline.builders.zbv import build_zbv_order
from hp_pipeline.builders.zero_bubble import build_zero_bubble_h1_order

__all__ = [
    "build_1f1b_order",
    "build_dualpipev_order",
    "build_gpipe_order",
    "build_interleaved_1f1b_order",
    "build_interleaved_zero_bubble_order",
    "build_looped_bfs_order",
    "build_zbv_order",
    "build_zero_bubble_h1_order",
    "dualpipev_min_microbatches",
    "interleaved_round_size",
    "stage_to_rank",
    "stages_on_rank",
]

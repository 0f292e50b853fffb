"""hp_pipeline: pipeline schedules as data, the passes over them, and the executor that runs them.

A schedule is an *order*: for each rank, the list of :class:`MetaStep` it runs.
Builders make compute-only orders; :func:`insert_comms` adds the point-to-point
steps; :func:`validate_order` proves an order complete and deadlock-free;
:func:`simulate` times it; :func:`render_order` draws it. Every step kind,
built-in or plug-in, is declared once with :func:`register_step_kind`. The schedule
classes (:class:`Schedule1F1B`, ...) run an order over :class:`PipelineStage`\\ s.
"""

# ruff: noqa: E402 - the registration below comes before the imports that need it.
from hp_pipeline import _builtin_kinds

# Every kind hp_pipeline ships, and its handler, is registered here, once and first: the
# modules imported below may name kinds at import (the builders' F, B, I, W).
_builtin_kinds.register_builtins()

from hp_pipeline.__about__ import __version__
from hp_pipeline._deps import Edge
from hp_pipeline.builders import (
    build_1f1b_order,
    build_dualpipev_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_interleaved_zero_bubble_order,
    build_looped_bfs_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    interleaved_round_size,
    stage_to_rank,
    stages_on_rank,
)
from hp_pipeline.comms import insert_comms
from hp_pipeline.errors import PipelineStepError, ScheduleError, StageFailure
from hp_pipeline.fsdp import ShardedModule, ShardedUnits, add_fsdp_steps, is_sharded_module, sharded_units
from hp_pipeline.grads import TiedGroup, clip_grad_norm_, global_grad_norm
from hp_pipeline.ir import (
    MetaStep,
    MetaStepType,
    Order,
    format_order,
    read_order_csv,
    write_order_csv,
)
from hp_pipeline.kinds import (
    StepKind,
    Transfer,
    register_step_handler,
    register_step_kind,
    step_kinds,
)
from hp_pipeline.microbatch import REPLICATE, TensorChunkSpec, merge_chunks, split_args_kwargs
from hp_pipeline.mpipe import (
    PPRankOwnedSampler,
    ScheduleMPipe,
    build_mpipe_order,
    mpipe_order,
    mpipe_owned_micros,
    mpipe_owner,
    strip_mpipe,
)
from hp_pipeline.render import render_order
from hp_pipeline.schedules import (
    PipelineSchedule,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBV,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
    get_schedule_class,
)
from hp_pipeline.simulate import SimulationResult, StepCosts, TimedStep, simulate
from hp_pipeline.stage import PipelineStage, TensorMeta
from hp_pipeline.swap import SwapError, SwapPolicy, SwapSession, SwapStats, attach_swap, insert_swaps
from hp_pipeline.validate import validate_order

__all__ = [
    "REPLICATE",
    "Edge",
    "MetaStep",
    "MetaStepType",
    "Order",
    "PPRankOwnedSampler",
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "PipelineStepError",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleMPipe",
    "ScheduleZBV",
    "ScheduleZBVZeroBubble",
    "ScheduleZeroBubble",
    "ShardedModule",
    "ShardedUnits",
    "SimulationResult",
    "StageFailure",
    "StepCosts",
    "StepKind",
    "SwapError",
    "SwapPolicy",
    "SwapSession",
    "SwapStats",
    "TensorChunkSpec",
    "TensorMeta",
    "TiedGroup",
    "TimedStep",
    "Transfer",
    "__version__",
    "add_fsdp_steps",
    "attach_swap",
    "build_1f1b_order",
    "build_dualpipev_order",
    "build_gpipe_order",
    "build_interleaved_1f1b_order",
    "build_interleaved_zero_bubble_order",
    "build_looped_bfs_order",
    "build_mpipe_order",
    "build_zbv_order",
    "build_zero_bubble_h1_order",
    "clip_grad_norm_",
    "format_order",
    "get_schedule_class",
    "global_grad_norm",
    "insert_comms",
    "insert_swaps",
    "interleaved_round_size",
    "is_sharded_module",
    "merge_chunks",
    "mpipe_order",
    "mpipe_owned_micros",
    "mpipe_owner",
    "read_order_csv",
    "register_step_handler",
    "register_step_kind",
    "render_order",
    "sharded_units",
    "simulate",
    "split_args_kwargs",
    "stage_to_rank",
    "stages_on_rank",
    "step_kinds",
    "strip_mpipe",
    "validate_order",
    "write_order_csv",
]

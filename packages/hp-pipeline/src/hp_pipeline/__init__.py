"""hp_pipeline: pipeline schedules as data, the passes over them, and (later) the executor.

A schedule is an *order*: for each rank, the list of :class:`MetaStep` it runs.
Builders make compute-only orders; :func:`insert_comms` adds the point-to-point
steps; :func:`validate_order` proves an order complete and deadlock-free;
:func:`simulate` times it; :func:`render_order` draws it.
"""

from hp_pipeline.__about__ import __version__
from hp_pipeline.builders import (
    build_1f1b_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    interleaved_round_size,
    stage_to_rank,
    stages_on_rank,
)
from hp_pipeline.comms import insert_comms
from hp_pipeline.errors import ScheduleError
from hp_pipeline.ir import (
    MetaStep,
    MetaStepType,
    Order,
    format_order,
    read_order_csv,
    write_order_csv,
)
from hp_pipeline.render import render_order
from hp_pipeline.simulate import SimulationResult, StepCosts, TimedStep, simulate
from hp_pipeline.validate import validate_order

__all__ = [
    "MetaStep",
    "MetaStepType",
    "Order",
    "ScheduleError",
    "SimulationResult",
    "StepCosts",
    "TimedStep",
    "__version__",
    "build_1f1b_order",
    "build_gpipe_order",
    "build_interleaved_1f1b_order",
    "build_zbv_order",
    "build_zero_bubble_h1_order",
    "format_order",
    "insert_comms",
    "interleaved_round_size",
    "read_order_csv",
    "render_order",
    "simulate",
    "stage_to_rank",
    "stages_on_rank",
    "validate_order",
    "write_order_csv",
]

"""Building a schedule, in three phases: check the arguments, build the whole order, make the runner.

:class:`hp_pipeline.PipelineSchedule`'s constructor calls them in
that order. Checking changes nothing and communicates nothing, so a bad
argument leaves the stages as they were; the order is the same on every rank;
the runner executes this rank's row of it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch.distributed as dist
from hp_core import get_logger

from hp_pipeline._checks import (
    check_bool,
    check_callable,
    check_chunk_specs,
    check_merge_spec,
    check_positive_number,
)
from hp_pipeline.builders import stages_on_rank
from hp_pipeline.executor import StepRunner
from hp_pipeline.fsdp import sharded_units
from hp_pipeline.ir import Order
from hp_pipeline.overlap import add_fsdp_steps_with_overlaps
from hp_pipeline.stage import PipelineStage
from hp_pipeline.swap import SwapPolicy, attach_swap, insert_swaps

__all__: list[str] = []

_log = get_logger("hp_pipeline")


class Schedule(Protocol):
    """What building reads of a schedule: its settings and its hooks.

    The hooks are [Note: schedule subclass hooks] in :mod:`hp_pipeline.schedules`.
    """

    _name: str
    _style: Any
    num_ranks: int
    group_rank: int

    @property
    def num_stages(self) -> int: ...

    def expected_num_stages(self, num_ranks: int, stages_per_rank: int) -> int: ...

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order: ...

    def add_comms(self, order: Order) -> Order: ...

    def make_runner(self, *, training: bool, abort_timeout: float) -> StepRunner: ...


# -- 1. checking ------------------------------------------------------------------------------


def check_keywords(
    name: str,
    *,
    loss_fn: Any,
    args_chunk_spec: Any,
    kwargs_chunk_spec: Any,
    output_merge_spec: Any,
    use_full_backward: Any,
    scale_grads: Any,
    backward_requires_autograd: Any,
    defer_pp_recv: Any,
    abort_timeout: Any,
    recv_lookahead: Any,
    swap_policy: Any,
) -> None:
    """Every keyword of the constructor, before any rank communicates or any attribute is set."""
    check_callable(name, "loss_fn", loss_fn, "loss_fn=torch.nn.functional.mse_loss")
    check_chunk_specs(name, args_chunk_spec, kwargs_chunk_spec)
    check_merge_spec(name, output_merge_spec)
    if use_full_backward is not None:
        warnings.warn(
            f"{name}: use_full_backward is deprecated in torch.distributed.pipelining and "
            "ignored, here as there; stop passing it",
            FutureWarning,
            stacklevel=4,
        )
    check_bool(name, "scale_grads", scale_grads)
    check_bool(name, "backward_requires_autograd", backward_requires_autograd)
    check_bool(name, "defer_pp_recv", defer_pp_recv)
    if defer_pp_recv:
        raise ValueError(
            f"{name}: defer_pp_recv=True (torch's option to post each receive as late as its "
            "consumer allows) is not supported; receives are posted by recv_lookahead here: pass "
            "recv_lookahead=1 to post each one a compute step ahead on gloo (NCCL and HCCL post at "
            "most one compute step ahead already, in list order), or leave defer_pp_recv out"
        )
    check_positive_number(name, "abort_timeout", abort_timeout)
    if recv_lookahead is not None and (
        isinstance(recv_lookahead, bool) or not isinstance(recv_lookahead, int) or recv_lookahead < 1
    ):
        raise ValueError(
            f"{name}: recv_lookahead must be None (post all of a step's receives when it starts) "
            f"or an int >= 1 (that many compute steps ahead), got {recv_lookahead!r}"
        )
    if swap_policy is not None and not isinstance(swap_policy, SwapPolicy):
        raise TypeError(
            f"{name}: swap_policy must be a SwapPolicy or None, got {type(swap_policy).__name__} "
            f"({swap_policy!r}); e.g. swap_policy=hp_pipeline.SwapPolicy(keep_newest=0)"
        )


def check_stages(
    name: str, stage_or_stages: PipelineStage | Sequence[PipelineStage], n_microbatches: Any
) -> list[PipelineStage]:
    """This rank's stages as a list, all on one process group, and ``n_microbatches`` an int >= 1."""
    stages = [stage_or_stages] if isinstance(stage_or_stages, PipelineStage) else list(stage_or_stages)
    if not stages or not all(isinstance(s, PipelineStage) for s in stages):
        raise TypeError(
            f"{name} needs PipelineStage objects, got "
            f"{[type(s).__name__ for s in stages] or 'nothing'}; wrap each of this rank's model "
            "chunks as PipelineStage(submodule, stage_index, num_stages)"
        )
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"{name}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
    if len({id(s.group) for s in stages}) != 1:
        named = {
            s.stage_index: "the default group"
            if s.group is None
            else f"group of ranks {dist.get_process_group_ranks(s.group)}"
            for s in stages
        }
        raise ValueError(
            f"{name}: all stages of a rank must use the same process group, got {named}; build "
            "every stage of the schedule with the same group= (the pipeline's group)"
        )
    return stages


def check_placement(schedule: Schedule, stages: list[PipelineStage]) -> None:
    """The stages' ``num_stages`` and indices match the schedule's placement on this rank."""
    name, p, style = schedule._name, schedule.num_ranks, schedule._style
    total = schedule.expected_num_stages(p, len(stages))
    counts = {s.num_stages for s in stages}
    if counts != {total}:
        raise ValueError(
            f"{name} over {p} ranks with {len(stages)} stage(s) per rank runs {total} stages, "
            f"but the stages say num_stages={sorted(counts)}; build them with num_stages={total}"
        )
    per_rank = total // p
    rank = schedule.group_rank
    want = stages_on_rank(rank, p, per_rank, style=style)
    have = sorted({s.stage_index for s in stages})
    if have != sorted(want) or len(have) != len(stages):
        raise ValueError(
            f"{name}: rank {rank} of {p} must host stages {sorted(want)} ({style} placement), got "
            f"{[s.stage_index for s in stages]}; build this rank's stages for "
            f"hp_pipeline.stages_on_rank({rank}, {p}, {per_rank}, style={style!r})"
        )


# -- 2. the whole order -----------------------------------------------------------------------


def build_whole_order(
    schedule: Schedule,
    stages: Mapping[int, PipelineStage],
    n_microbatches: int,
    *,
    training: bool,
    swap_policy: SwapPolicy | None,
) -> Order:
    """The builder's order, with FSDP steps (sharded stages), transfers and swaps added, as ``.order``.

    The same on every rank: it depends on the schedule's settings, which the
    first step checks across ranks, and on the stages being sharded, which
    [Note: FSDP protocol] assumes every rank does alike.
    """
    name, logs = schedule._name, _log.isEnabledFor(logging.DEBUG)
    order = schedule.build_order(schedule.num_ranks, n_microbatches)
    if logs:
        _log.debug(
            "%s: order built for %d ranks, %d micro-batches: %d compute steps",
            name,
            schedule.num_ranks,
            n_microbatches,
            _count(order),
        )
    units = {index: sharded_units(s.submod) for index, s in stages.items()}
    for index, stage_units in units.items():
        stage_units.check_covers_all(f"{name}: stage {index}")
    if any(units.values()):
        order = add_fsdp_steps_with_overlaps(order, range(schedule.num_stages))
        _log.debug("%s: FSDP steps added (the stage modules are sharded)", name)
    before = _count(order)
    order = schedule.add_comms(order)
    if logs:
        _log.debug("%s: comms inserted: %d transfer steps", name, _count(order) - before)
    if swap_policy is not None and training:
        order = insert_swaps(order, swap_policy)
        _log.debug("%s: activation swaps inserted (%r)", name, swap_policy)
    return order


def _count(order: Order) -> int:
    return sum(len(row) for row in order.values())


# -- 3. the runner ----------------------------------------------------------------------------


def build_runner(
    schedule: Schedule,
    *,
    training: bool,
    abort_timeout: float,
    recv_lookahead: int | None,
    swap_policy: SwapPolicy | None,
) -> tuple[StepRunner, Any]:
    """This rank's runner (the ``make_runner`` hook) and its swap state (None without a policy)."""
    runner = schedule.make_runner(training=training, abort_timeout=abort_timeout)
    swap = None if swap_policy is None else attach_swap(runner, swap_policy)
    runner.recv_lookahead = recv_lookahead
    _log.debug(
        "%s: runner %s for rank %d: %d steps",
        schedule._name,
        type(runner).__name__,
        schedule.group_rank,
        len(runner.steps),
    )
    return runner, swap

"""Argument checks and the micro-batch helpers the builders share."""

from __future__ import annotations

from hp_pipeline.ir import MetaStep, MetaStepType

F = MetaStepType.FWD
B = MetaStepType.BWD
I = MetaStepType.BWD_INPUT  # noqa: E741 - the torch-pipelining name of the step
W = MetaStepType.BWD_WEIGHT


def check_count(builder: str, name: str, value: object, hint: str) -> int:
    """``value`` as an int >= 1, or a ValueError naming the builder, the value and the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{builder}: {name} must be an int >= 1, got {value!r}; {hint}")
    return value


def check_ranks_and_micros(builder: str, num_ranks: object, n_microbatches: object) -> tuple[int, int]:
    p = check_count(builder, "num_ranks", num_ranks, "pass the pipeline-parallel group size")
    m = check_count(
        builder, "n_microbatches", n_microbatches, "split the batch into at least one micro-batch"
    )
    return p, m


def one_f_one_b_rank(
    rank_stage: int, warmup: int, n_microbatches: int, backward: MetaStepType = B
) -> list[MetaStep]:
    """``warmup`` forwards, then alternate forward / backward, then the remaining backwards."""
    m = n_microbatches
    steps = [MetaStep(i, F, rank_stage) for i in range(warmup)]
    for k in range(m - warmup):
        steps += [MetaStep(warmup + k, F, rank_stage), MetaStep(k, backward, rank_stage)]
    steps += [MetaStep(k, backward, rank_stage) for k in range(m - warmup, m)]
    return steps

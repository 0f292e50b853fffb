"""The composition matrix: the combinations users write, each against one process on the same data.

{FSDP, HSDP} x {per-block, per-stage, nested} wrapping x {no TP, TP inside the
blocks} x {no pipeline, GPipe, 1F1B, interleaved, ZB-H1, ZB-V, LoopedBFS,
InterleavedZeroBubble, DualPipeV} x {fp32, bf16
mixed precision} x {activation checkpointing off, on}, each on the smallest
mesh that holds it (``Case.mesh_dims``). By default a covering subset runs
(every value of every dimension, the pairs most likely to interact, and a few
cases with everything on); ``HP_COMPOSITION=full`` (``tox -e composition``)
runs the whole product. MPipe with FSDP is covered by hp-pipeline's
``test_mpipe_fsdp.py``, per stage and nested.

Every case, every step: the loss against the reference's, every gradient
(``p.grad`` present and equal to the reference's), every parameter after
SGD, and the data-parallel collectives against FSDP's figures: with a pipeline
one all-gather and one reduce-scatter per unit and step, whatever the number
of micro-batches ([Note: FSDP protocol] in ``hp_pipeline.fsdp``); without one
FSDP2's forward gather, backward gather (non-root units reshard after
forward) and reduce-scatter per unit; HSDP adds one all-reduce per unit.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

import hp_pipeline
import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from hp_dtensor import ColwiseParallel, DTensor, RowwiseParallel, parallelize_module
from hp_fsdp import MixedPrecisionPolicy, fully_shard
from hp_pipeline import PipelineStage, stages_on_rank
from hp_testing import record_collectives
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from composition_lib import (
    MICRO,
    PER_MICRO,
    SCHEDULES,
    STEPS,
    Case,
    Reference,
    build_stages,
    global_batch,
    loss_fn,
    named_pairs,
    param_units,
    tolerance,
)

PIPELINES: list[str | None] = [None, *SCHEDULES]


def _core_cases() -> list[Case]:
    """Every value of every dimension, and the pairs where the pieces meet."""
    cases = [Case(wrap=w, pipeline=p) for p in PIPELINES for w in ("block", "stage", "nested")]
    cases += [Case(tp=True, pipeline=p) for p in (None, "1f1b", "zbv")]
    cases += [Case(dp="hsdp", pipeline=p) for p in (None, "1f1b", "interleaved")]
    cases += [Case(bf16=True, pipeline=p) for p in (None, "1f1b", "zb-h1")]
    cases += [Case(ac=True, pipeline=p) for p in (None, "1f1b", "zbv")]
    cases += [Case(wrap="block", ac=True, pipeline="gpipe")]
    cases += [
        Case(tp=True, bf16=True, ac=True, pipeline="1f1b"),
        Case(dp="hsdp", wrap="block", tp=True, bf16=True, ac=True),
        Case(dp="hsdp", wrap="stage", bf16=True, ac=True, pipeline="zbv"),
    ]
    # compiled blocks: a pipeline stage whose blocks are compiled, under each kind of schedule
    cases += [Case(compile=True, pipeline=p) for p in PIPELINES]
    cases += [Case(wrap="block", bf16=True, ac=True, compile=True, pipeline="1f1b")]
    cases += [Case(tp=True, compile=True), Case(tp=True, compile=True, pipeline="zbv")]  # FSDP x TP compiled
    cases += [Case(dp="hsdp", compile=True)]
    return cases


def _full_cases() -> list[Case]:
    return [
        Case(dp, wrap, tp, pipeline, bf16, ac)
        for dp, wrap, tp, pipeline, bf16, ac in itertools.product(
            ("fsdp", "hsdp"),
            ("block", "stage", "nested"),
            (False, True),
            PIPELINES,
            (False, True),
            (False, True),
        )
    ]


CASES = _full_cases() if os.environ.get("HP_COMPOSITION") == "full" else _core_cases()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(actual: torch.Tensor, expected: torch.Tensor, case: Case, what: str) -> None:
    tol = tolerance(case)
    torch.testing.assert_close(
        actual.float(),
        expected.float(),
        rtol=tol.rtol,
        atol=tol.atol,
        msg=lambda m: f"{case.id}: {what}: {m}",
    )


def _wrap(stage: nn.Module, case: Case, dp_mesh: Any, tp_mesh: Any) -> None:
    """TP inside each block first, then ``fully_shard`` bottom-up as the case says."""
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if case.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in stage.blocks:  # type: ignore[union-attr]
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if case.wrap in ("block", "nested"):
            fully_shard(block, **kwargs)
    if case.wrap in ("stage", "nested"):
        fully_shard(stage, **kwargs)
    if case.compile:
        for block in stage.blocks:  # type: ignore[union-attr]
            block.compile(backend="aot_eager")


def _sum_over(value: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    for group in groups:
        dist.all_reduce(value, group=group)  # SUM: every backend has it
    return value


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=pytest.mark.distributed(world_size=c.world_size, timeout=240))
        for c in CASES
    ],
)
def test_composition_matches_single_process(
    rank: int, world_size: int, device_mesh_factory: Any, case: Case
) -> None:
    if case.compile:
        # The pooled ranks are reused: start from empty caches. DualPipeV's split backward needs
        # no switch from us ([Note: compiled split backward] in hp_pipeline._builtin_kinds).
        torch._dynamo.reset()
    shape, names = case.mesh_dims
    mesh = device_mesh_factory(shape, names)
    dp_names = ("rep", "dp") if case.dp == "hsdp" else ("dp",)
    dp_mesh = mesh[dp_names] if len(dp_names) > 1 else mesh["dp"]
    tp_mesh = mesh["tp"] if case.tp else None
    dp_groups = [mesh[n].get_group() for n in dp_names]
    replicas = 2 ** len(dp_names)
    replica = sum(mesh.get_local_rank(n) * 2 ** (len(dp_names) - 1 - i) for i, n in enumerate(dp_names))

    if case.pipeline is not None:
        cls_name, per_rank, style = SCHEDULES[case.pipeline]
        num_stages = 2 * per_rank
        local = stages_on_rank(mesh.get_local_rank("pp"), 2, per_rank, style=style)  # type: ignore[arg-type]
    else:
        num_stages, local = 2, [0, 1]
    stages = build_stages(case, num_stages)
    reference = Reference(stages, case.bf16)
    for s in local:
        _wrap(stages[s], case, dp_mesh, tp_mesh)

    runner: Any
    if case.pipeline is not None:
        pp_group = mesh["pp"].get_group()
        pipe = [PipelineStage(stages[s], s, num_stages, group=pp_group) for s in local]
        schedule_cls = getattr(hp_pipeline, cls_name)
        runner = schedule_cls(pipe if len(pipe) > 1 else pipe[0], MICRO, loss_fn)
    else:
        runner = nn.Sequential(*stages)
        fully_shard(runner, mesh=dp_mesh)  # the root, as FSDP2's recipe wraps it
    params = [p for s in local for p in stages[s].parameters()]
    assert params and all(isinstance(p, DTensor) for p in params), f"{case.id}: parameters are not sharded"
    opt = torch.optim.SGD(params, lr=reference.opt.param_groups[0]["lr"])

    batch = replicas * MICRO * PER_MICRO
    share = MICRO * PER_MICRO
    mine = slice(replica * share, (replica + 1) * share)
    has_first, has_last = 0 in local, num_stages - 1 in local
    units = sum(param_units(stages[s], case.wrap) for s in local)
    shard_ranks = tuple(dist.get_process_group_ranks(mesh["dp"].get_group()))
    rep_ranks = tuple(dist.get_process_group_ranks(mesh["rep"].get_group())) if case.dp == "hsdp" else None

    for step in range(STEPS):
        x, y = global_batch(step, batch)
        ref_loss = reference.step(x, y)
        loss: torch.Tensor | None = None
        # compiled blocks: nothing compiles again after the first step
        no_recompile = torch._dynamo.config.patch(error_on_recompile=case.compile and step > 0)
        with no_recompile, record_collectives() as log:
            if case.pipeline is not None:
                losses: list[torch.Tensor] = []
                runner.step(
                    *((x[mine],) if has_first else ()), target=y[mine] if has_last else None, losses=losses
                )
                if has_last:
                    loss = torch.stack(losses).mean().detach()
            else:
                loss = loss_fn(runner(x[mine]), y[mine])
                loss.backward()
                loss = loss.detach()

        # FSDP's collectives on the data-parallel groups ([Note: FSDP protocol] with a pipeline)
        gathers = units if case.pipeline is not None else 2 * units
        counts = {
            "all_gather": log.count("all_gather_into_tensor", group_ranks=shard_ranks),
            "reduce_scatter": log.count("reduce_scatter_tensor", group_ranks=shard_ranks),
            "all_reduce": 0 if rep_ranks is None else log.count("all_reduce", group_ranks=rep_ranks),
        }
        want = {
            "all_gather": gathers,
            "reduce_scatter": units,
            "all_reduce": 0 if rep_ranks is None else units,
        }
        assert counts == want, f"{case.id} step {step} rank {rank}: dp collectives {counts}, expected {want}"

        if loss is not None:
            total = _sum_over(loss.float().clone(), dp_groups)
            _close(total / replicas, ref_loss, case, f"step {step} loss")
        for s in local:
            for name, got, want_p in named_pairs(stages[s], reference.stage(s)):
                assert isinstance(got, DTensor), f"{case.id} step {step}: stage {s} {name} is not its shard"
                assert got.grad is not None, f"{case.id} step {step}: stage {s} {name} has no gradient"
                assert want_p.grad is not None
                _close(_full(got.grad), want_p.grad, case, f"step {step} stage {s} {name}.grad")
        opt.step()
        reference.opt.step()
        opt.zero_grad()
        for s in local:
            for name, got, want_p in named_pairs(stages[s], reference.stage(s)):
                _close(_full(got.detach()), want_p.detach(), case, f"step {step} stage {s} {name} after SGD")


@pytest.mark.distributed(world_size=4)
def test_parameters_outside_every_unit_are_refused(
    rank: int, world_size: int, device_mesh_factory: Any
) -> None:
    """Blocks wrapped but the stage's own layer not: a clear error at construction, not drifting replicas."""
    mesh = device_mesh_factory((2, 2), ("pp", "dp"))
    pp_rank = mesh.get_local_rank("pp")
    stages = build_stages(Case(wrap="nested"), 2)  # the stages have a ``head`` of their own
    for block in stages[pp_rank].blocks:
        fully_shard(block, mesh=mesh["dp"])
    stage = PipelineStage(stages[pp_rank], pp_rank, 2, group=mesh["pp"].get_group())
    with record_collectives() as log:
        with pytest.raises(
            ValueError, match=r"stage \d: parameters \['head.weight', 'head.bias'\] are outside"
        ):
            hp_pipeline.Schedule1F1B(stage, MICRO, loss_fn)
    assert len(log.of()) == 0, "nothing may communicate before the error"
    fully_shard(stages[pp_rank], mesh=mesh["dp"])  # the fix the message names
    hp_pipeline.Schedule1F1B(stage, MICRO, loss_fn)

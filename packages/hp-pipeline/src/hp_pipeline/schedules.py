"""The schedule classes: a builder's order plus the executor, behind torch-pipelining's interface.

Each class picks a builder and a placement ([Note: schedule classes] lists
them); everything else is shared. Details in the [Note]s below: schedule
subclass hooks, schedule signatures, eval steps.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hp_core import verify_across_ranks

from hp_pipeline._checks import (
    check_bool,
    check_loss_kwargs,
    check_options,
    describe_fingerprints,
)
from hp_pipeline._torch_api import check_eval_losses, check_losses, microbatch_inputs
from hp_pipeline.builders import (
    build_1f1b_order,
    build_dualpipev_order,
    build_gpipe_order,
    build_interleaved_1f1b_order,
    build_interleaved_zero_bubble_order,
    build_looped_bfs_order,
    build_zbv_order,
    build_zero_bubble_h1_order,
    dualpipev_min_microbatches,
    stage_to_rank,
)
from hp_pipeline.builders.placement import Style
from hp_pipeline.comms import insert_comms
from hp_pipeline.errors import StageFailure
from hp_pipeline.executor import StepRunner, raise_step_error
from hp_pipeline.grads import TiedGroup, clip_grad_norm_, sync_tied
from hp_pipeline.ir import MetaStep, Order
from hp_pipeline.kinds import MetaStepType
from hp_pipeline.microbatch import ChunkSpec, as_chunk_spec, merge_chunks
from hp_pipeline.schedule_build import (
    build_runner,
    build_whole_order,
    check_keywords,
    check_placement,
    check_stages,
)
from hp_pipeline.stage import PipelineStage
from hp_pipeline.swap import SwapPolicy, SwapStats

__all__ = [
    "PipelineSchedule",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBV",
    "ScheduleZBVZeroBubble",
    "ScheduleZeroBubble",
    "get_schedule_class",
]

# [Note: schedule classes]
# ================================  ===============================  =====================  ===========
# class                             builder                          stages per rank        placement
# ================================  ===============================  =====================  ===========
# ``ScheduleGPipe``                 ``build_gpipe_order``            1                      ``stage = rank``
# ``Schedule1F1B``                  ``build_1f1b_order``             1                      ``stage = rank``
# ``ScheduleZeroBubble``            ``build_zero_bubble_h1_order``   1                      ``stage = rank``
# ``ScheduleInterleaved1F1B``       ``build_interleaved_1f1b_order`` ``v >= 1`` (a list)    loop
# ``ScheduleLoopedBFS``             ``build_looped_bfs_order``       ``v >= 1`` (a list)    loop
# ``ScheduleInterleavedZeroBubble`` ``build_interleaved_zero_...``   ``v >= 1`` (a list)    loop
# ``ScheduleZBVZeroBubble``         ``build_zbv_order``              2 (a list)             V
# ``ScheduleDualPipeV``             ``build_dualpipev_order``        2 (a list)             V
# ================================  ===============================  =====================  ===========
#
# ``ScheduleZBV`` is another name of ``ScheduleZBVZeroBubble``. The first three
# derive from :class:`PipelineScheduleSingle`, the others from
# :class:`PipelineScheduleMulti`, as in torch.distributed.pipelining, and
# :func:`get_schedule_class` maps torch's schedule names to these classes.
#
# ``.order`` is the whole pipeline's order with communication (and, when the
# stage modules are sharded, FSDP steps) inserted; ``.step()`` runs this rank's
# row of it. Every rank of the pipeline calls ``step()``: the rank of stage 0
# with the batch, the rank of the last stage with ``target=`` (and ``losses=``),
# the others with neither.


LossFn = Callable[[Any, Any], torch.Tensor]


# [Note: schedule subclass hooks]
# A new schedule derives from :class:`PipelineScheduleSingle` or
# :class:`PipelineScheduleMulti` and overrides public hooks that the
# constructor calls in this order, never the private machinery around them:
#
# 1. ``expected_num_stages(num_ranks, stages_per_rank)``: the stage count the
#    stages must agree on (the two bases already give the usual answers);
# 2. ``build_order(num_ranks, n_microbatches)``: the compute-only order, the
#    one hook every schedule defines (a base class without it refuses to be
#    built);
# 3. ``add_comms(order)``: the communication pass (default ``insert_comms``);
# 4. ``make_runner(training=..., abort_timeout=...)``: the executor of this
#    rank's row (default a ``StepRunner``);
# 5. ``fingerprint()``: the settings every rank must share, checked once
#    across ranks before the first transfer ([Note: schedule agreement] in
#    :mod:`hp_pipeline._checks`); extend ``super().fingerprint()``.
#
# torch.distributed.pipelining has no public equivalent (its schedules
# override private methods), so the names are ours. ``ScheduleMPipe`` is built
# this way: it overrides all five.


# [Note: schedule signatures]
# A user coming from torch reads ``inspect.signature(Schedule1F1B)`` (or an
# IDE's tooltip) to see what a schedule takes, and torch's keywords differ by
# class: the single-stage classes take ``args_chunk_spec``,
# ``kwargs_chunk_spec``, ``output_merge_spec`` and ``scale_grads``;
# ``PipelineScheduleMulti`` adds ``use_full_backward`` and
# ``backward_requires_autograd``; the multi-stage schedules take
# ``backward_requires_autograd`` and ``defer_pp_recv`` instead of
# ``use_full_backward`` (and ``ScheduleLoopedBFS`` no chunk specs, which we take
# anyway). The keyword options are written out once, in
# :meth:`PipelineSchedule.__init__`, in torch's order followed by ours
# (``abort_timeout``, ``recv_lookahead``, ``swap_policy``). Each class names
# the ones it takes in ``_options``, and the constructors between (which take
# ``**options`` and check them with the list of valid ones, so a misspelt
# option is reported with every valid name, which Python's own error does not
# do) get a ``__signature__`` built from the two by ``__init_subclass__``: the
# constructor's own parameters, then its options in that one order. A class
# that inherits its constructor gets a copy of the function (the same code and
# closure, so ``super()`` behaves the same) to carry its own signature, so the
# parent's is left as it was. The options stay keyword-only, as they always
# were here (torch's can also be passed by position; a positional call past
# ``loss_fn`` gets Python's ``TypeError``).


# [Note: eval steps]
# torch's ``eval`` runs ``step`` with the schedule's backward switched off.
# Ours does the same with a second runner: ``make_runner(training=False)``
# over the same ``.order`` (the runner leaves out the training-only kinds: the
# backward steps, their transfers, ``REDUCE_GRAD`` and the swaps), with a
# context around each forward of the last stage that computes the loss under
# ``no_grad`` when a target was given, since a forward-only runner computes
# none. It is built on the first ``eval``. Shapes are learned per mode: a
# forward under ``no_grad`` gives outputs that require no gradient, so the
# metadata a training step learned (a gradient travels back) does not describe
# an eval step's transfers, and the other way round. Each mode keeps its own
# metadata on the stages (the eval mode's are swapped in for the step and
# back) and its own first step. A schedule built without ``loss_fn`` is
# forward-only already: its ``eval`` is its ``step``.


class PipelineSchedule:
    """Shared machinery of every schedule; use one of the subclasses.

    Args:
        stage_or_stages: this rank's :class:`PipelineStage` (or the list of them
            for the multi-stage schedules).
        n_microbatches: ``m``, how many pieces each batch is cut into.
        loss_fn: ``loss_fn(output, target) -> scalar`` applied on the last
            stage to each micro-batch. Without it the schedule runs forward
            only (no ``B``/``I``/``W`` steps); pass it on every rank.
        args_chunk_spec / kwargs_chunk_spec: how each argument of ``step`` is
            split (see :mod:`hp_pipeline.microbatch`); default: tensors along
            dim 0 (also inside tuples, lists and dicts), other values
            replicated. torch's ``TensorChunkSpec`` objects are taken as ours.
        output_merge_spec: how the last stage's per-micro-batch outputs are
            merged: an int dim along which every tensor is concatenated, or
            torch's form, a tuple/dict with a ``TensorChunkSpec`` (or
            ``REPLICATE``) per tensor of the output ([Note: merge specs] in
            :mod:`hp_pipeline.microbatch`); ``None`` (default) is dim 0.
        use_full_backward: ``PipelineScheduleMulti`` only, as in torch, where
            it is deprecated and ignored; so it is here (with a warning).
        scale_grads: scale gradients by ``1/m`` (seeded into each micro-batch's
            backward), so ``m`` micro-batches of a mean loss give the gradient of
            the whole batch's mean loss. ``False`` sums them.
        backward_requires_autograd: the multi-stage classes, as torch's. torch
            uses it to refuse a training ``step`` under ``torch.no_grad()``
            (its backward would find no graph). Ours turns autograd on for its
            forward and backward steps itself, so such a step trains all the
            same, with or without the flag; it is checked to be a bool.
        defer_pp_recv: the multi-stage classes, as torch's: post each receive
            as late as its consumer allows. Only ``False`` (torch's default) is
            taken: receives are posted by ``recv_lookahead`` here, and
            ``True`` raises, naming it.
        abort_timeout: seconds to wait for each pending handle when
            communication itself fails (see [Note: failures]).
        recv_lookahead: on gloo, how many compute steps ahead receives are
            posted; ``None`` (default) posts all of a step's receives when it
            starts, fastest but holding every receive buffer of the step
            ([Note: receive lookahead] in :mod:`hp_pipeline.executor`).
            Backends that coalesce batches (NCCL, HCCL) ignore it and post
            in list order, one batch per compute step ([Note: coalesced batches]).
        swap_policy: a :class:`~hp_pipeline.SwapPolicy` to move saved
            activations to host memory between each micro-batch's forward and
            its backward (``SWAP_OUT`` / ``SWAP_IN`` steps in ``.order``,
            [Note: swap policy] in :mod:`hp_pipeline.swap`); ``None`` (default)
            keeps them on the device. Checked against the pipeline and the
            platform before anything communicates; with it,
            :meth:`activation_memory` reports the rank's activation memory.
    """

    _style: Style = "loop"
    _name = "PipelineSchedule"
    _options: frozenset[str] = frozenset(
        (
            "args_chunk_spec",
            "kwargs_chunk_spec",
            "output_merge_spec",
            "scale_grads",
            "abort_timeout",
            "recv_lookahead",
            "swap_policy",
        )
    )
    """The keyword options this class takes ([Note: schedule signatures])."""

    def __init__(
        self,
        stage_or_stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        *,
        args_chunk_spec: Sequence[ChunkSpec | None] | None = None,
        kwargs_chunk_spec: Mapping[str, ChunkSpec | None] | None = None,
        output_merge_spec: int | Sequence[Any] | Mapping[Any, Any] | None = None,
        use_full_backward: bool | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        abort_timeout: float = 10.0,
        recv_lookahead: int | None = None,
        swap_policy: SwapPolicy | None = None,
    ) -> None:
        if type(self).build_order is PipelineSchedule.build_order:
            raise TypeError(
                f"{type(self).__name__} is a base class (get_schedule_class returns it, as torch's does, "
                "for issubclass checks); build a schedule such as Schedule1F1B or ScheduleInterleaved1F1B"
            )
        # 1. checking: every argument, before any rank communicates or any attribute is set
        check_keywords(
            self._name,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            use_full_backward=use_full_backward,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
            defer_pp_recv=defer_pp_recv,
            abort_timeout=abort_timeout,
            recv_lookahead=recv_lookahead,
            swap_policy=swap_policy,
        )
        stages = check_stages(self._name, stage_or_stages, n_microbatches)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None  # off for the length of an eval() ([Note: eval steps])
        # torch's spec objects become ours once, here, not on every step.
        self._args_chunk_spec: list[Any] | None = (
            None if args_chunk_spec is None else [as_chunk_spec(spec) for spec in args_chunk_spec]
        )
        self._kwargs_chunk_spec: dict[str, Any] | None = (
            None
            if kwargs_chunk_spec is None
            else {key: as_chunk_spec(spec) for key, spec in kwargs_chunk_spec.items()}
        )
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._backward_requires_autograd = backward_requires_autograd
        self._abort_timeout = abort_timeout
        self._recv_lookahead = recv_lookahead
        self.group: dist.ProcessGroup | None = stages[0].group
        self.num_ranks = dist.get_world_size(self.group)
        self.group_rank = dist.get_rank(self.group)
        self._global_ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        self._stages = {s.stage_index: s for s in sorted(stages, key=lambda s: s.stage_index)}
        check_placement(self, stages)
        if swap_policy is not None:
            swap_policy.check(self.num_stages)  # before any rank communicates
        # 2. the whole order, the same on every rank
        training = loss_fn is not None
        self.order: Order = build_whole_order(
            self, self._stages, n_microbatches, training=training, swap_policy=swap_policy
        )
        # 3. this rank's runner
        self._runner, self._swap = build_runner(
            self,
            training=training,
            abort_timeout=abort_timeout,
            recv_lookahead=recv_lookahead,
            swap_policy=swap_policy,
        )
        self._learned = False
        self._eval: _Mode | None = None  # the eval mode's runner and metadata, built on the first eval()
        self._agreed = False  # [Note: schedule agreement]
        self._tied: list[TiedGroup] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _show_options(cls)

    # -- construction -------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return next(iter(self._stages.values())).num_stages

    @property
    def stages(self) -> list[PipelineStage]:
        """This rank's stages, by stage index."""
        return list(self._stages.values())

    # -- subclass hooks ([Note: schedule subclass hooks]) ----------------------------

    def expected_num_stages(self, num_ranks: int, stages_per_rank: int) -> int:
        """How many stages the pipeline has when each of ``num_ranks`` ranks holds ``stages_per_rank``.

        The constructor checks every stage's ``num_stages`` against it. The
        default is one stage per rank (``num_ranks``); schedules that take a
        list of stages return ``num_ranks * stages_per_rank``.
        """
        return num_ranks

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        """The whole pipeline's compute-only order (rank -> steps); the one hook every schedule defines.

        Called once, by the constructor, on every rank, so it must give the
        same order everywhere. Communication (:meth:`add_comms`) and, for
        sharded stages, FSDP steps are added to what it returns.
        """
        raise NotImplementedError

    def add_comms(self, order: Order) -> Order:
        """``order`` with its point-to-point steps (default: :func:`~hp_pipeline.insert_comms`).

        Override to pass ``insert_comms`` more (MPipe's data stages, say); the
        result becomes ``.order``.
        """
        return insert_comms(order)

    def make_runner(self, *, training: bool, abort_timeout: float) -> StepRunner:
        """The executor of this rank's row of ``.order``: a :class:`~hp_pipeline.executor.StepRunner`.

        Override to return a subclass that runs the schedule's own step kinds
        or feeds stage 0 differently (the runner's public hooks, [Note: running
        a kind] in :mod:`hp_pipeline.kinds`). ``training`` is whether a
        ``loss_fn`` was given.
        """
        return StepRunner(
            self._stages,
            self.order[self.group_rank],
            self._peer_rank,
            self.group,
            training=training,
            abort_timeout=abort_timeout,
        )

    def _peer_rank(self, stage: int) -> int:
        return self._global_ranks[stage_to_rank(stage, self.num_ranks, style=self._style)]

    def fingerprint(self) -> dict[str, Any]:
        """What every rank of the pipeline must agree on for the orders' transfers to pair up.

        A subclass hook: a schedule with settings that shape the order adds
        them to ``super().fingerprint()``. Local choices (chunk specs, merge
        dim, ``recv_lookahead``, a swap policy, which only adds local steps)
        are left out: ranks may differ there.
        """
        return {
            "schedule": self._name,
            "n_microbatches": self._n_microbatches,
            "num_stages": self.num_stages,
            "ranks": self.num_ranks,
            "loss_fn": None if self._loss_fn is None else "given",
            "scale_grads": self.scale_grads,
        }

    def _agree_across_ranks(self) -> None:
        """Once per schedule: every rank raises if any rank built a different schedule.

        One digest exchange over the pipeline group before any point-to-point
        transfer ([Note: schedule agreement] in :mod:`hp_pipeline._checks`).
        """
        if not self._agreed:
            verify_across_ranks(
                self.fingerprint(),
                self.group,
                what=self._name,
                fix="their transfers would not pair up. Build the same schedule on every rank: the same "
                "class, n_microbatches, num_stages, loss_fn (given or not) and the options listed above",
                explain=describe_fingerprints,
            )
            self._agreed = True

    # -- running ------------------------------------------------------------------

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: Mapping[str, Any] | None = None,
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step over the whole batch; returns the merged output on the last stage's rank.

        Every rank of the pipeline calls it. ``args`` (stage 0's rank) and
        ``kwargs`` (every stage of the rank given them) are the model's inputs;
        ``target`` is split into micro-batches like them (the last stage's
        rank). Or, as torch's newest: ``arg_mbs`` / ``kwarg_mbs`` /
        ``target_mbs``, one entry per micro-batch, used as given ([Note:
        pre-split micro-batches] in :mod:`hp_pipeline._torch_api`). Per-micro-batch
        losses are appended to ``losses`` on the last stage's rank. As torch's:
        ``return_outputs=False`` returns ``None`` without merging the outputs,
        and ``loss_kwargs`` are passed to ``loss_fn`` as keyword arguments for
        every micro-batch, whole (a tensor in them is not split: per-sample
        values belong in ``target``). If any rank fails, every rank raises the
        same :class:`~hp_pipeline.PipelineStepError`.
        """
        pre_failure: StageFailure | None = None
        inputs: tuple[Any, Any, list[Any] | None] = (None, None, None)
        try:
            check_losses(losses)
            check_bool("step", "return_outputs", return_outputs)
            check_loss_kwargs(loss_kwargs)
            last = self.num_stages - 1 if self.num_stages - 1 in self._stages else None
            eval_losses = not self._has_backward and self._loss_fn is not None and losses is not None
            check_eval_losses(last if eval_losses else None, target, target_mbs)
            for stage in self._stages.values():
                stage._check_materialized()
            inputs = self._split_inputs(
                args, kwargs, target, "schedule.step(x)", (arg_mbs, kwarg_mbs, target_mbs)
            )
        except Exception as exc:
            pre_failure = _failure_outside_steps(exc)
        scale = 1.0 / self._n_microbatches if self.scale_grads else 1.0
        self._run_step(*inputs, scale, pre_failure, loss_kwargs=loss_kwargs)
        if self._tied and self._has_backward:
            sync_tied(self._tied, self._modules(), self._rank_of_stage(), self.group, values=False)
        return self._finish(losses, return_outputs=return_outputs)

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One forward-only step over the whole batch, as torch's ``eval``: no backward, no gradient.

        Every rank of the pipeline calls it, with :meth:`step`'s arguments
        (``return_outputs=`` and ``loss_kwargs=`` included). The last stage's
        rank gets the merged output; given ``target=`` there, each
        micro-batch's loss is computed as well, without a graph, and appended to
        ``losses``. No parameter gets a gradient, gradients accumulated by
        earlier steps are left as they are, and a training ``step`` may follow
        ([Note: eval steps]).
        """
        if type(self).step is not PipelineSchedule.step:
            raise NotImplementedError(
                f"{type(self).__name__} runs its own step(), which eval() cannot switch to forward only; "
                f"build the schedule with loss_fn=None for forward-only steps"
            )
        with self._eval_mode():
            mbs: dict[str, Any] = {"arg_mbs": arg_mbs, "kwarg_mbs": kwarg_mbs, "target_mbs": target_mbs}
            return self.step(*args, target=target, losses=losses, **mbs, **kwargs)

    @contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """The length of one eval step: the eval runner and metadata in, the training ones back after."""
        if self._loss_fn is None:  # forward-only already
            yield
            return
        if self._eval is None:
            runner = self.make_runner(training=False, abort_timeout=self._abort_timeout)
            runner.recv_lookahead = self._recv_lookahead
            runner.add_step_context([MetaStepType.FWD], _eval_loss)
            self._eval = _Mode(runner, False, {index: ({}, {}) for index in self._stages})
        training = self._install(self._eval)
        self._has_backward = False
        try:
            yield
        finally:
            self._eval = self._install(training)
            self._has_backward = True

    def _install(self, mode: _Mode) -> _Mode:
        """Make ``mode`` the runner, first-step flag and stage metadata in use; returns the one replaced."""
        replaced = _Mode(
            self._runner,
            self._learned,
            {index: (stage.inputs_meta, stage.outputs_meta) for index, stage in self._stages.items()},
        )
        self._runner, self._learned = mode.runner, mode.learned
        for index, stage in self._stages.items():
            stage.inputs_meta, stage.outputs_meta = mode.metas[index]
        return replaced

    def _split_inputs(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        example: str,
        mbs: tuple[Any, ...] = (),
    ) -> tuple[Any, Any, list[Any] | None]:
        """This rank's per-micro-batch inputs and targets, whole batch or pre-split (``mbs``), checked.

        See [Note: pre-split micro-batches] in :mod:`hp_pipeline._torch_api`.
        """
        arg_mbs, kwarg_mbs, target_mbs = mbs or (None, None, None)
        return microbatch_inputs(
            m=self._n_microbatches,
            holds_first=0 in self._stages,
            last_stage=self.num_stages - 1 if (self.num_stages - 1) in self._stages else None,
            needs_target=self._has_backward,
            args=args,
            kwargs=kwargs,
            target=target,
            arg_mbs=arg_mbs,
            kwarg_mbs=kwarg_mbs,
            target_mbs=target_mbs,
            args_chunk_spec=self._args_chunk_spec,
            kwargs_chunk_spec=self._kwargs_chunk_spec,
            example=example,
        )

    def _run_step(
        self,
        arg_mbs: Any,
        kwarg_mbs: Any,
        targets: list[Any] | None,
        scale: float,
        pre_failure: StageFailure | None,
        *,
        loss_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Run this rank's order, then agree with every rank on failures ([Note: failure vote])."""
        self._agree_across_ranks()  # the first step only: before any transfer, nothing run yet
        if self._swap is not None and self._has_backward:
            self._swap.begin_step()
        loss_fn = self._loss_fn
        if loss_fn is not None and loss_kwargs and pre_failure is None:  # (checked by then)
            loss_fn = functools.partial(loss_fn, **loss_kwargs)
        own = self._runner.run(
            arg_mbs,
            kwarg_mbs,
            targets,
            loss_fn,
            scale,
            first_step=not self._learned,
            pre_failure=pre_failure,
        )
        failures = self._runner.vote.close(own)
        if failures:
            raise_step_error(failures, own)
        self._learned = True

    def activation_memory(self) -> SwapStats | None:
        """This rank's saved-activation accounting for the last step, or ``None`` without a ``swap_policy``.

        Bytes of saved activations on the compute device (now and at the peak
        of the step), in host memory, and per micro-batch ([Note: activation
        accounting] in :mod:`hp_pipeline.swap`).
        """
        return None if self._swap is None else self._swap.stats()

    def _finish(self, losses: list[torch.Tensor] | None, *, return_outputs: bool = True) -> Any:
        last = self._stages.get(self.num_stages - 1)
        if last is None:
            return None
        if losses is not None and self._loss_fn is not None:
            losses.extend(last._last_losses[i] for i in range(self._n_microbatches))
        if not return_outputs:
            return None
        micro = [last._last_outputs[i] for i in range(self._n_microbatches)]
        return merge_chunks(micro, self._output_merge_spec)

    # -- tied weights and clipping -------------------------------------------------

    def _modules(self) -> dict[int, torch.nn.Module]:
        return {s: stage.submod for s, stage in self._stages.items()}

    def _rank_of_stage(self) -> dict[int, int]:
        return {s: self._peer_rank(s) for s in range(self.num_stages)}

    def tie_parameters(self, name: str, stages: Mapping[int, str], *, sync_values: bool = True) -> TiedGroup:
        """Declare a weight shared by several stages ([Note: tied parameters]).

        ``stages`` maps stage index -> the parameter's name in that stage's
        module, e.g. ``{0: "embed.weight", 3: "head.weight"}``. Call it on every
        rank, in the same order. After each training step the copies'
        gradients are summed; with ``sync_values`` the first stage's value is
        copied to the other copies now.
        """
        bad = sorted(s for s in stages if not 0 <= s < self.num_stages)
        if bad:
            raise ValueError(
                f"tie_parameters({name!r}): stages {bad} do not exist (0 .. {self.num_stages - 1})"
            )
        tie = TiedGroup(name, dict(stages))
        tie.local_params(self._modules())  # fail early on a wrong name
        self._tied.append(tie)
        if sync_values:
            sync_tied([tie], self._modules(), self._rank_of_stage(), self.group, values=True)
        return tie

    def parameters_for_norm(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, with each tied weight counted on its first owning stage only."""
        skip: set[int] = set()
        modules = self._modules()
        for tie in self._tied:
            first = min(tie.stages)
            for s, p in tie.local_params(modules).items():
                if s != first:
                    skip.add(id(p))
        seen: set[int] = set()
        params = []
        for stage in self._stages.values():
            for p in stage.submod.parameters():
                if id(p) not in skip and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip every stage's gradients by the pipeline's global norm ([Note: global norm]).

        Call it on every rank after ``step()``. Returns the global norm.
        """
        return clip_grad_norm_(
            self.parameters_for_norm(),
            max_norm,
            norm_type,
            group=self.group,
            error_if_nonfinite=error_if_nonfinite,
            also_scale=[p for stage in self._stages.values() for p in stage.submod.parameters()],
        )


SCHEDULE_OPTIONS: frozenset[str] = PipelineSchedule._options
"""The keyword options every schedule takes; an unknown one is listed with these ."""

_OPTION_PARAMETERS: dict[str, inspect.Parameter] = {
    name: param
    for name, param in inspect.signature(PipelineSchedule.__init__).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
}
"""Every keyword option, in the one order signatures show them ([Note: schedule signatures])."""


def _show_options(cls: type[PipelineSchedule]) -> None:
    """Give ``cls.__init__`` a signature naming ``cls``'s keyword options ([Note: schedule signatures])."""
    init: Any = cls.__dict__.get("__init__")
    if init is None:
        # Inherited: a function object of its own, so the parent keeps its signature.
        parent = cls.__init__
        init = types.FunctionType(
            parent.__code__, parent.__globals__, parent.__name__, parent.__defaults__, parent.__closure__
        )
        init.__kwdefaults__ = parent.__kwdefaults__
        init.__doc__ = parent.__doc__
        init.__module__ = parent.__module__
        init.__qualname__ = f"{cls.__qualname__}.__init__"
        init.__annotations__ = dict(parent.__annotations__)
        type.__setattr__(cls, "__init__", init)
    real = inspect.signature(init)  # a fresh function's own parameters: nothing set on it yet
    params = list(real.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        return
    named = {p.name for p in params}
    options = [p for name, p in _OPTION_PARAMETERS.items() if name in cls._options and name not in named]
    init.__signature__ = real.replace(parameters=[*params[:-1], *options])


@dataclass
class _Mode:
    """What a schedule swaps between its training and eval steps ([Note: eval steps])."""

    runner: StepRunner
    learned: bool
    metas: dict[int, tuple[dict[int, Any], dict[int, Any]]]  # stage -> (inputs_meta, outputs_meta)


def _eval_loss(runner: StepRunner, step: MetaStep) -> AbstractContextManager[None] | None:
    """Around an eval step's forward: the last stage's loss, when a target was given ([Note: eval steps])."""
    stage = runner.stages[step.stage_index]
    if not stage.is_last or runner.loss_fn is None or runner.targets is None:
        return None
    assert step.micro_index is not None
    return _loss_after_forward(runner, stage, step.micro_index)


@contextmanager
def _loss_after_forward(runner: StepRunner, stage: PipelineStage, micro: int) -> Iterator[None]:
    yield  # the forward; if it raises, no loss (the runner reports the forward's failure)
    with torch.no_grad():
        stage.compute_loss(micro, runner.loss_fn, runner.target_of(stage, micro))


def _failure_outside_steps(exc: Exception) -> StageFailure:
    import traceback

    return StageFailure(
        rank=dist.get_rank(),
        stage=None,
        step="",
        error=f"{type(exc).__name__}: {exc}",
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        exception=exc,
    )


class PipelineScheduleSingle(PipelineSchedule):
    """Base of the schedules with one stage per rank (stage ``r`` on rank ``r``), as torch's."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        **options: Any,
    ) -> None:
        check_options(self._name, options, self._options)
        if not isinstance(stage, PipelineStage):
            if isinstance(stage, Sequence) and len(stage) == 1:
                stage = stage[0]
            else:
                raise TypeError(
                    f"{self._name} runs one stage per rank; pass this rank's PipelineStage "
                    f"(PipelineStage(submodule, rank, num_ranks)), got {type(stage).__name__}"
                    + (
                        f" of {len(stage)} stages (use ScheduleInterleaved1F1B)"
                        if isinstance(stage, Sequence)
                        else ""
                    )
                )
        super().__init__(stage, n_microbatches, loss_fn, **options)


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards; ``m`` micro-batches of activations live at the turn."""

    _name = "ScheduleGPipe"

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        return build_gpipe_order(num_ranks, n_microbatches)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B (PipeDream-Flush): GPipe's bubble with at most ``p`` live micro-batches on stage 0."""

    _name = "Schedule1F1B"

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        return build_1f1b_order(num_ranks, n_microbatches)


class ScheduleZeroBubble(PipelineScheduleSingle):
    """ZB-H1: backward split into input and weight gradients; about a third of 1F1B's bubble."""

    _name = "ScheduleZeroBubble"

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        return build_zero_bubble_h1_order(num_ranks, n_microbatches)


class PipelineScheduleMulti(PipelineSchedule):
    """Base of the schedules that take a list of stages per rank, as torch's.

    A single :class:`PipelineStage` is taken as a list of one. Its keyword
    options are torch's ``PipelineScheduleMulti``'s; the schedules derived
    from it take the multi-stage schedules' (``_MULTI_OPTIONS``).
    """

    _options = SCHEDULE_OPTIONS | {"use_full_backward", "backward_requires_autograd"}

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        **options: Any,
    ) -> None:
        check_options(self._name, options, self._options)
        self._v = 1 if isinstance(stages, PipelineStage) else len(stages)
        super().__init__(stages, n_microbatches, loss_fn, **options)

    def expected_num_stages(self, num_ranks: int, stages_per_rank: int) -> int:
        """``num_ranks * stages_per_rank``: every rank holds the same number of stages."""
        return num_ranks * stages_per_rank


_MULTI_OPTIONS = SCHEDULE_OPTIONS | {"backward_requires_autograd", "defer_pp_recv"}
"""The keyword options of torch's multi-stage schedules (``use_full_backward`` is the base's only)."""


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B: ``v`` stages per rank (loop placement), a ``v``-fold smaller bubble."""

    _name = "ScheduleInterleaved1F1B"
    _options = _MULTI_OPTIONS

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        return build_interleaved_1f1b_order(num_ranks, n_microbatches, self._v)


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Looped BFS: ``v`` stages per rank (loop placement), each run over all micro-batches in turn.

    Interleaved 1F1B's bubble for ``m`` a multiple of ``p``, GPipe's activation
    memory ([Note: looped BFS] in :mod:`hp_pipeline.builders.looped_bfs`).
    """

    _name = "ScheduleLoopedBFS"
    _options = _MULTI_OPTIONS

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        return build_looped_bfs_order(num_ranks, n_microbatches, self._v)


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved zero bubble (ZB1P): interleaved placement, backward split into ``I`` and ``W``.

    See [Note: interleaved zero bubble] in
    :mod:`hp_pipeline.builders.interleaved_zero_bubble`; ``m`` as for
    :class:`ScheduleInterleaved1F1B`.
    """

    _name = "ScheduleInterleavedZeroBubble"
    _options = _MULTI_OPTIONS

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        return build_interleaved_zero_bubble_order(num_ranks, n_microbatches, self._v)


class _VSchedule(PipelineScheduleMulti):
    """Two stages per rank folded into a V: rank ``r`` holds stages ``r`` and ``2p-1-r``."""

    _style: Style = "v"
    _options = _MULTI_OPTIONS

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        **options: Any,
    ) -> None:
        if isinstance(stages, PipelineStage) or len(stages) != 2:
            count = 1 if isinstance(stages, PipelineStage) else len(stages)
            raise ValueError(
                f"{self._name} runs exactly 2 stages per rank (r and 2p-1-r), got {count}; pass "
                "[PipelineStage(chunk_a, r, 2 * p), PipelineStage(chunk_b, 2 * p - 1 - r, 2 * p)]"
            )
        super().__init__(stages, n_microbatches, loss_fn, **options)


class ScheduleZBVZeroBubble(_VSchedule):
    """ZB-V: two stages per rank in a V (rank ``r`` holds ``r`` and ``2p-1-r``), split backward."""

    _name = "ScheduleZBVZeroBubble"

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        return build_zbv_order(num_ranks, n_microbatches)


ScheduleZBV = ScheduleZBVZeroBubble
"""The name hp-pipeline used first for :class:`ScheduleZBVZeroBubble`; the same class."""


class ScheduleDualPipeV(_VSchedule):
    """DualPipeV: the V placement with overlapped forward/backward pairs (``OVERLAP_F_B``).

    See [Note: DualPipeV] in :mod:`hp_pipeline.builders.dualpipev` and, for how
    a pair runs, [Note: running overlapped steps] in :mod:`hp_pipeline.overlap`.
    Needs ``n_microbatches >= 2 * p`` (one per stage), as torch's.
    """

    _name = "ScheduleDualPipeV"

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        p, m = num_ranks, n_microbatches
        least = dualpipev_min_microbatches(p)
        if m < least:
            raise ValueError(
                f"ScheduleDualPipeV over {p} ranks runs {2 * p} stages and needs at least one "
                f"micro-batch per stage, got n_microbatches={m}; use n_microbatches >= {least}"
            )
        return build_dualpipev_order(p, m)


# torch.distributed.pipelining's names (get_schedule_class), then names of ours torch lacks.
_BY_NAME: dict[str, type[PipelineSchedule]] = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
    "ZeroBubble": ScheduleZeroBubble,
    "ZBV": ScheduleZBVZeroBubble,
}


def get_schedule_class(schedule_name: str) -> type[PipelineSchedule]:
    """The schedule class for a name, case-insensitive, as torch's ``get_schedule_class``.

    Every name torch accepts maps to our class of that name (``"1F1B"``,
    ``"Interleaved1F1B"``, ``"GPipe"``, ``"LoopedBFS"``,
    ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``, and the
    bases ``"PipelineScheduleSingle"`` / ``"PipelineScheduleMulti"``, which tell
    a caller how many stages per rank to build); ``"ZeroBubble"`` (ZB-H1) and
    ``"ZBV"`` name ours too. Other names raise a ValueError listing the valid ones.
    """
    if isinstance(schedule_name, str):
        for name, cls in _BY_NAME.items():
            if name.lower() == schedule_name.lower():
                return cls
    raise ValueError(
        f"unknown schedule name {schedule_name!r}; the valid names (case-insensitive) are {list(_BY_NAME)}"
    )

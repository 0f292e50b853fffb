"""The executor: run one rank's list of :class:`MetaStep` for one training step.

Details in the [Note]s below: posting and waiting, direct p2p, coalesced
batches, receive lookahead, first step, failures.
"""

from __future__ import annotations

import datetime
import logging
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.profiler as _profiler
import torch.distributed as dist
from hp_core import DebugLevel, capabilities_for, get_debug_level, get_logger

from hp_pipeline.boundary import grad_to_send, is_dtensor, local_of, rebuild
from hp_pipeline.errors import PipelineStepError, StageFailure
from hp_pipeline.fsdp import ShardedUnits, sharded_units
from hp_pipeline.ir import MetaStep, MetaStepType
from hp_pipeline.kinds import Transfer
from hp_pipeline.overlap import split_overlaps
from hp_pipeline.stage import PipelineStage, TensorMeta
from hp_pipeline.vote import FailureVote

_log = get_logger("hp_pipeline")

__all__ = ["BUILTIN_HANDLERS", "CommError", "StepRunner"]

T = MetaStepType
_OK = "ok"


@dataclass
class _Block:
    comms: list[MetaStep]
    action: MetaStep | None


def _blocks(steps: Sequence[MetaStep]) -> list[_Block]:
    blocks: list[_Block] = []
    pending: list[MetaStep] = []
    for step in steps:
        if step.type.is_comm:
            pending.append(step)
        else:
            blocks.append(_Block(pending, step))
            pending = []
    if pending:
        blocks.append(_Block(pending, None))
    return blocks


# [Note: coalesced batches]
# On NCCL and HCCL a ``batch_isend_irecv`` is one group (``ncclGroupStart`` /
# ``ncclGroupEnd``): its operations progress together, but the groups a rank
# issues run one after another on its stream, each until every operation in it
# has met its peer operation (NCCL user guide, "Point-to-point communication").
# So two ranks must meet their transfers to each other in the same order: if
# rank A posts its receive of ``y`` in an earlier group than its send of ``x``
# while rank B posts its receive of ``x`` in an earlier group than its send of
# ``y``, both groups wait forever. Posting the receives of the next block ahead
# of this block's sends (what gloo does, [Note: receive lookahead]) does exactly
# that whenever a block starts with a send and the next block holds a receive
# from the same peer (GPipe's last forward send and first gradient receive).
#
# The executor therefore posts a rank's transfers *in its list's order*, cut
# into one batch per compute step (:func:`_coalesced_batches`): batch ``k``
# holds what is left of block ``k``'s communication, then the receives that lead
# block ``k+1`` (up to its first send, whose payload compute ``k`` produces).
# Deadlock freedom: every list is a subsequence of one global sequence in which
# each SEND/RECV pair is one event ([Note: deadlock-free placement] in
# :mod:`hp_pipeline.comms`). Hoisting the leading receives of block ``k+1``
# above compute ``k`` keeps that true, because compute ``k`` is private to the
# rank and its results leave the rank only through later sends, so it can be
# moved after those receives in the global sequence. (An FSDP step is a
# collective over the stage's data-parallel replicas, which run the same order
# with the same batches in lockstep; it moves the same way on all of them.)
# Each batch is then a run of
# consecutive transfers of the rank's (rewritten) list with no compute inside,
# and the earliest unfinished event of the global sequence can always finish:
# both of its ranks have finished everything before it, every batch in front of
# its own on either rank holds only earlier events, and operations within a
# batch progress together. Waiting a receive waits its whole batch (one handle;
# on NCCL the consumer's stream waits for the group), which this argument
# already allows for. The price against gloo is lookahead: a receive is posted at
# most one compute step early.


def _coalesced_batches(blocks: Sequence[_Block]) -> list[list[MetaStep]]:
    """The ``batch_isend_irecv`` posted before each block's action on NCCL/HCCL.

    See [Note: coalesced batches]: batch ``k`` holds the communication of block
    ``k`` not posted yet, then the receives that *lead* block ``k+1`` (those
    before its first send), so the rank's transfers are posted exactly in
    list order, cut into batches.
    """
    batches: list[list[MetaStep]] = []
    carried = 0  # leading comms of the current block already posted with the previous batch
    for k, block in enumerate(blocks):
        batch = list(block.comms[carried:])
        carried = 0
        if block.action is not None and k + 1 < len(blocks):
            following = blocks[k + 1].comms
            while carried < len(following) and following[carried].type.is_recv:
                carried += 1
            batch.extend(following[:carried])
        batches.append(batch)
    return batches


# [Note: failures]
# A pipeline failure is hard to report well: when stage 2 raises, stage 3 is
# blocked in a receive that will never be matched and stage 1 in a receive of
# gradients, and a plain ``raise`` leaves them hanging until the process-group
# timeout, with the real error on one rank only. Instead:
#
# * an exception raised by *compute* (the module, ``loss_fn``, autograd, a
#   shape check) does not unwind the step. The rank records it and *drains*:
#   it keeps executing its list, skipping compute but posting every send and
#   receive, so no peer is ever left waiting. On the first step the failure
#   record travels in the headers, so downstream ranks stop computing too; on
#   later steps a draining rank sends zeros of the cached shapes (peers compute
#   on them, harmlessly, and their results are thrown away);
# * every handle is waited, then all ranks of the pipeline group exchange one
#   failure flag ([Note: failure vote] in :mod:`hp_pipeline.vote`: on gloo a
#   star of point-to-point flags whose receives are posted when the step starts,
#   elsewhere a one-element all-reduce on a side stream, which spares the host
#   a sync of the compute stream but not the wait for every rank's last
#   transfer: [Note: vote off the compute stream]); when any is set they gather
#   the failure records and every rank raises the same :class:`PipelineStepError`,
#   naming the rank, stage and step that failed and the original traceback.
#   The process group stays healthy, so the caller may catch it, fix the input
#   and step again;
# * an exception raised by *communication* (a peer died, a timeout) cannot be
#   drained around: the rank waits what it posted (with ``abort_timeout``),
#   then raises at once. Peers learn of it from their own broken connections or
#   timeouts.
#
# We chose in-band draining over a store-based side channel because it needs
# no polling of a store in the hot path, keeps working without a TCPStore (any
# launcher), and leaves the communicator usable; its cost is the vote per step (one hop after
# the last rank finishes, on gloo; on NCCL/HCCL a one-element all-reduce queued behind the
# step's last transfers). ``KeyboardInterrupt`` and other ``BaseException``\ s are
# not drained: they propagate at once.


class CommError(Exception):
    """Communication failed; the step cannot be drained (see [Note: failures]).

    A step handler raises it (``raise CommError(str(exc)) from exc``) when a
    transfer or collective it started fails; any other exception marks the
    step failed and the rank drains.
    """


StepContext = Callable[["StepRunner", MetaStep], "AbstractContextManager[Any] | None"]


class _Works:
    """Several torch work handles waited as one (each at most once)."""

    __slots__ = ("_handles",)

    def __init__(self, handles: Sequence[Any]) -> None:
        self._handles = [h for h in handles if h is not None]

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            if timeout is None:
                handle.wait()
            else:
                handle.wait(timeout)


# [Note: direct p2p]
# Later steps are the hot path, and hp-core's ``batch_isend_irecv`` re-checks
# per call what cannot change within a schedule: that the group is initialised
# and this rank is in it, that every peer is a rank of the group and not this
# rank, that every tensor is dense and contiguous. Here these hold once checked:
# the group and every peer of the rank's order are checked when the runner is
# built (``_check_p2p_setup``); receive buffers are our own ``torch.empty``; sent
# tensors are made contiguous (``_forward``, ``_send_tensors``) and outputs are
# checked dense in ``_forward``, where a failure drains like any compute error.
# So steps after the first call ``torch.distributed`` directly. On gloo each op
# is independent anyway (torch's ``batch_isend_irecv`` only loops), so the
# executor posts them one by one and keeps a handle per receive: waiting for an
# activation no longer also waits for the sends posted beside it, which on gloo
# complete only when the peer has posted the matching receive. Backends that
# coalesce (NCCL, HCCL) get one ``batch_isend_irecv`` per compute step
# ([Note: coalesced batches]). The first step, blocking and rare, keeps
# hp-core's checked wrappers.


def _check_p2p_setup(steps: Sequence[MetaStep], peer_rank: Callable[[int], int], pg: Any) -> None:
    """Once per schedule, the peer checks hp-core's p2p wrappers repeat per call ([Note: direct p2p])."""
    ranks = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    for step in steps:
        if not step.type.is_comm or step.peer_stage is None:
            continue
        peer = peer_rank(step.peer_stage)
        if peer == me or peer not in ranks:
            raise ValueError(
                f"step {step} of rank {me} would exchange with rank {peer}, which is "
                + ("this rank itself" if peer == me else f"not in the pipeline group {ranks}")
                + "; the stages' placement and the group do not match (build the stages with the "
                "pipeline's process group)"
            )


# [Note: posting and waiting]
# The rank's steps are cut into *blocks*: the communication steps between two
# compute steps, then the compute step. On gloo, right before compute step
# ``k`` the executor posts the sends of block ``k`` (their payloads were
# produced by earlier compute) and the receives of block ``k+L``, ``L`` compute
# steps ahead of where ``insert_comms`` put them (``L`` is the whole step unless
# bounded, see [Note: receive lookahead] and [Note: direct p2p]); backends that
# coalesce post in list order instead ([Note: coalesced batches]). A receive is
# waited only right before the compute step that consumes it, and waiting it
# waits nothing else (on gloo; its batch, elsewhere); sends are
# waited at the end of the step. This is deadlock-free for any order that passes
# ``validate_order``: every rank posts its communication in its list's order,
# its list is a subsequence of one global sequence in which each SEND/RECV pair
# is a single event, and so a rank blocked on a handle always waits for a peer
# that is blocked on something strictly earlier in that sequence; the chain
# ends at a rank that can progress.


# [Note: receive lookahead]
# On gloo a transfer is a rendezvous: the payload leaves only once the
# receiver has posted its receive. When the receive is posted first, the
# sender's ``isend`` writes the payload at once; when the send comes first, it
# announces itself, waits for the receiver's notice and the payload goes out
# from gloo's transport thread later, a round trip and two more wake-ups on the
# critical path, each costing milliseconds on a CPU the ranks share. So on
# gloo the executor posts receives ``recv_lookahead`` compute steps ahead
# (default: all of the step's receives when it starts, so every receive is
# posted before its send), each into its own buffer. Posting a receive never
# blocks, and receives from one peer are still posted in list order, so the
# argument of [Note: posting and waiting] is untouched. The price is memory: the
# buffers of the step's received activations and gradients all exist from the
# start (on stage ``s > 0`` of 1F1B: ``m`` inputs and ``m`` output gradients,
# each the size of one micro-batch's boundary tensors, where 1F1B otherwise holds
# ``p``); pass ``recv_lookahead=k`` to a schedule to bound it. Backends that
# coalesce ignore it: there a posted receive is a group that holds its stream
# until matched, and the sends queued behind it could not start
# ([Note: coalesced batches]).


# [Note: first step]
# The first step of a schedule also learns the tensor metadata ([Note: tensor
# metadata] in :mod:`hp_pipeline.stage`). It runs every transfer blocking, in
# list order, with a small header object ahead of the tensors: the list of
# :class:`~hp_pipeline.stage.TensorMeta` for activations, an "ok" for gradients,
# or a failure record. Later steps send tensors only.


class StepRunner:
    """Runs one rank's steps; one instance per schedule, reused across steps.

    Each step runs through its kind's handler ([Note: running a kind] in
    :mod:`hp_pipeline.kinds`); ``handlers`` overrides the registered handler
    of a kind for this runner only (how a schedule gives a built-in kind such as
    ``LOAD`` a meaning of its own). The public surface a handler may use:
    ``stages``, ``training``, ``draining``, ``scale``, ``loss_fn``, ``rank``,
    ``group``, ``first_step``, ``state`` (a dict for plug-ins' per-runner
    state), :meth:`take_recv`, :meth:`add_step_context`,
    :meth:`set_early_receives`, and the hooks a subclass overrides:
    :meth:`begin_step`, :meth:`forward_inputs`, :meth:`target_of`.
    """

    def __init__(
        self,
        stages: dict[int, PipelineStage],
        steps: Sequence[MetaStep],
        peer_rank: Callable[[int], int],
        group: dist.ProcessGroup | None,
        *,
        training: bool,
        abort_timeout: float = 10.0,
        handlers: Mapping[MetaStepType, Any] | None = None,
    ) -> None:
        self.stages = stages
        self.state: dict[str, Any] = {}
        self._units_of: dict[int, ShardedUnits] = {}  # per stage, found once ([Note: FSDP protocol])
        self.training = training
        # An OVERLAP_F_B runs as its forward, the forward's sends, then its backward
        # ([Note: running overlapped steps] in hp_pipeline.overlap).
        # Forward-only runs leave out the kinds declared training_only ([Note: step-kind registry]).
        self.steps = [s for s in split_overlaps(steps) if training or not s.type.training_only]
        self.blocks = _blocks(self.steps)
        self.peer_rank = peer_rank
        self.group = group
        self.abort_timeout = abort_timeout
        self.rank = dist.get_rank()
        pg = dist.group.WORLD if group is None else group
        _check_p2p_setup(self.steps, peer_rank, pg)
        # [Note: direct p2p]: gloo runs each op on its own; others coalesce a batch (NCCL needs it).
        # The backend whose rules apply: under NCCL/HCCL emulation gloo carries NCCL semantics.
        self._coalesce = capabilities_for(pg).backend != "gloo"
        self.vote = FailureVote(group, self._vote_device)
        self._bind_kinds(handlers or {})
        self._early: list[MetaStep] = []
        self._lean_blocks = self.blocks
        self._log_steps = False
        self._reset()

    # -- step kinds ([Note: running a kind]) -------------------------------------------

    def _bind_kinds(self, overrides: Mapping[MetaStepType, Any]) -> None:
        """Find every kind's handler once, so a missing one fails at construction, naming the fix."""
        kinds = {step.type: None for step in self.steps}
        self._handler: dict[MetaStepType, Any] = {}
        missing = []
        for kind in kinds:
            handler = overrides.get(kind, kind.spec.handler)
            if handler is None:
                missing.append(kind.name)
            self._handler[kind] = handler
        if missing:
            raise ValueError(
                f"no executor handler for the step kinds {missing} of this rank's order; attach one with "
                "hp_pipeline.register_step_handler(kind, handler) (or import the module that does), or "
                "pass handlers={kind: handler} to the runner"
            )
        self._contexts: dict[MetaStepType, list[StepContext]] = {}
        self._begins = [kind.spec.begin for kind in kinds if kind.spec.begin is not None]
        for kind in kinds:
            if kind.spec.around is not None:
                self.add_step_context([MetaStepType(code) for code in kind.spec.wraps], kind.spec.around)

    def add_step_context(self, kinds: Iterable[MetaStepType], factory: StepContext) -> None:
        """Run every step of ``kinds`` inside ``factory(runner, step)`` (a context manager, or ``None``).

        Contexts nest in the order they were added, around the kind's handler
        (for ``F``: the whole forward of that micro-batch, receive included). A
        kind declared with ``wraps``/``around`` adds its own when its steps are
        in the runner's list.
        """
        for kind in kinds:
            self._contexts.setdefault(kind, []).append(factory)

    def set_early_receives(self, steps: Sequence[MetaStep]) -> bool:
        """Post these receives of the list at the start of every step after the first, at once.

        Receives posted early never block, and on gloo each operation runs on
        its own, so this is safe when each of them precedes every other receive
        from the same peer rank in the list (the caller checks that: it knows
        why its receives lead). Backends that coalesce (NCCL, HCCL) keep the list
        order ([Note: coalesced batches]): returns ``False`` and changes nothing.
        """
        if self._coalesce or not steps:
            return False
        early = set(steps)
        self._early = list(steps)
        self._lean_blocks = _blocks([s for s in self.steps if s not in early])
        return True

    @property
    def first_step(self) -> bool:
        """Whether this is the schedule's first step (transfers blocking, shapes learned)."""
        return self._first_step

    def begin_step(self) -> None:
        """Called at the start of every step, after the per-step state is reset; override to add to it.

        The base runs the ``begin`` of every kind in the list.
        """
        for begin in self._begins:
            begin(self)

    def _vote_device(self) -> torch.device:
        return next(iter(self.stages.values())).device

    def _reset(self) -> None:
        self.failure: StageFailure | None = None  # this rank's own failure
        self.draining = False
        self._peer_failure: StageFailure | None = None  # a failure header received on the first step
        self._outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._recv_work: dict[tuple[T, int, int], Any] = {}
        self._recv_bufs: dict[tuple[T, int, int], list[torch.Tensor]] = {}
        self._send_work: list[Any] = []
        self._unsharded: dict[int, list[Any]] = {}  # stage -> gather handles to wait before computing

    # -- entry point ------------------------------------------------------------

    def run(
        self,
        arg_mbs: list[tuple[Any, ...]] | None,
        kwarg_mbs: list[dict[str, Any]] | None,
        targets: list[Any] | None,
        loss_fn: Any,
        scale: float,
        *,
        first_step: bool,
        pre_failure: StageFailure | None = None,
    ) -> StageFailure | None:
        """Run the steps; returns this rank's own failure (if any) after every handle is waited."""
        self.vote.open()  # [Note: failure vote]: its receives wait for the end of the step
        self._reset()
        # Each step's action at DETAIL ([Note: debug levels] in hp_core.debug), decided once per step.
        self._log_steps = get_debug_level() >= DebugLevel.DETAIL and _log.isEnabledFor(logging.DEBUG)
        self.arg_mbs, self.kwarg_mbs, self.targets = arg_mbs, kwarg_mbs, targets
        self.loss_fn, self.scale = loss_fn, scale
        if pre_failure is not None:
            self.failure, self.draining = pre_failure, True
        self._first_step = first_step
        refused = False
        if first_step and self.failure is None:
            try:
                self._check_units_match_steps()
            except ValueError as exc:
                self._fail(None, exc)
                self.draining = refused = True  # every rank learns it from the vote; nothing has run
        self.begin_step()
        for stage in self.stages.values():
            stage._begin_step()
            if not refused:  # (a refused stage has no RESHARD to restore its units' flags)
                self._prepare_sharded(stage)
        try:
            if first_step:
                self._run_blocking()
            else:
                self._run_overlapped()
        except CommError as exc:
            self._abort(exc)
        finally:
            for stage in self.stages.values():
                stage._clear()
        return self.failure

    # -- compute ------------------------------------------------------------------

    def _fail(self, step: MetaStep | None, exc: BaseException) -> None:
        if self.failure is None:
            stage = None if step is None else step.stage_index
            self.failure = StageFailure(
                rank=self.rank,
                stage=stage,
                step="" if step is None else str(step),
                error=f"{type(exc).__name__}: {exc}",
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                exception=exc,
            )
        self.draining = True

    def _check_units_match_steps(self) -> None:
        """Refuse stages wrapped after the order was built ([Note: units found at the first step]).

        [Note: units found at the first step]
        The schedule adds ``UNSHARD`` / ``REDUCE_GRAD`` / ``RESHARD`` for a stage
        whose module holds ``fully_shard`` units when it is built; the runner
        finds the units again here, at its first step. A stage wrapped in
        between (``fully_shard`` called after the schedule) has units but no
        such steps: the executor would turn off their gradient sync and never
        reduce, so nothing would train and no error would say so. Its
        parameters outside every unit are checked here for the same reason
        (the schedule could not check a stage that had no units yet).
        """
        with_steps = {s.stage_index for s in self.steps if s.type is MetaStepType.UNSHARD}
        for index in self.stages:
            units = self._units(index)
            if units and index not in with_steps:
                raise ValueError(
                    f"stage {index}'s module holds fully_shard units, but it had none when the schedule "
                    "was built, so the schedule has no steps that reduce their gradients and nothing "
                    "would train: call fully_shard on the stage module (and its blocks) before building "
                    "the PipelineStage and the schedule"
                )
            units.check_covers_all(f"stage {index}")

    def _units(self, stage_index: int) -> ShardedUnits:
        units = self._units_of.get(stage_index)
        if units is None:
            units = self._units_of[stage_index] = sharded_units(self.stages[stage_index].submod)
        return units

    def _prepare_sharded(self, stage: PipelineStage) -> None:
        """Step start of a sharded stage: no per-micro-batch reduce or reshard ([Note: FSDP protocol])."""
        units = self._units(stage.stage_index)
        if units:
            units.begin_step(self.training)

    def _act(self, step: MetaStep) -> None:
        """Run one step; under an active profiler it shows as ``PP:<step>`` (e.g. ``PP:0F1``), as in torch.

        The label's text is built only while profiling: this runs for every
        step of every schedule, so without a profiler (and without DETAIL logs)
        it costs two attribute reads.
        """
        if self._log_steps:
            _log.debug("PP step %s%s", step, " (draining)" if self.draining else "")
        if _profiler._is_profiler_enabled:
            with torch.profiler.record_function(f"PP:{step}"):
                self._act_step(step)
            return
        self._act_step(step)

    def _act_step(self, step: MetaStep) -> None:
        kind = step.type
        if self.draining and not kind.spec.runs_while_draining:
            return  # (FSDP steps and other collectives run on: their peers wait in them)
        try:
            if kind.is_compute:
                for handle in self._unsharded.pop(step.stage_index, ()):
                    handle.wait()
            contexts = self._contexts.get(kind)
            if contexts is None:
                self._handler[kind](self, step)
                return
            with ExitStack() as stack:
                for factory in contexts:
                    context = factory(self, step)
                    if context is not None:
                        stack.enter_context(context)
                self._handler[kind](self, step)
        except CommError:
            raise
        except Exception as exc:
            self._fail(step, exc)

    # -- hooks for subclasses ----------------------------------------------------------

    def forward_inputs(self, stage: PipelineStage, i: int) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        """The positional and keyword inputs of ``stage``'s forward of micro-batch ``i``.

        Stage 0 reads the step's inputs; another stage takes the previous stage's
        output, from this rank or from its ``RECV_F``. The keyword inputs given
        to this rank's ``step`` reach every stage's forward, as in torch
        ([Note: pre-split micro-batches] in :mod:`hp_pipeline._torch_api`).
        """
        s = stage.stage_index
        if stage.is_first:
            if self.arg_mbs is None or self.kwarg_mbs is None:
                raise RuntimeError(f"stage 0 runs on rank {self.rank} but step() received no inputs here")
            return self.arg_mbs[i], self.kwarg_mbs[i]
        kwargs = None if self.kwarg_mbs is None else self.kwarg_mbs[i]
        if (s - 1) in self.stages:
            stage.inputs_meta[i] = self.stages[s - 1].outputs_meta[i]
            return self._outputs.pop((s - 1, i)), kwargs
        return tuple(self._take_recv((T.FWD_RECV, s, i))), kwargs

    def target_of(self, stage: PipelineStage, i: int) -> Any:
        """The target the last stage's loss compares micro-batch ``i``'s output with."""
        if self.targets is None:
            raise ValueError(
                f"stage {stage.stage_index} is the last stage and the schedule has a loss_fn, but step() "
                "got no target on this rank; pass step(..., target=labels) here"
            )
        return self.targets[i]

    # -- the built-in kinds' work ---------------------------------------------------------

    def _forward(self, stage: PipelineStage, i: int) -> None:
        s = stage.stage_index
        args, kwargs = self.forward_inputs(stage, i)
        with torch.set_grad_enabled(self.training):
            outputs = stage.forward_one_chunk(i, args, kwargs, keep_for_backward=self.training)
            if stage.is_last:
                if self.training:
                    stage.compute_loss(i, self.loss_fn, self.target_of(stage, i))
                return
        metas = tuple(TensorMeta.of(t) for t in outputs)
        cached = stage.outputs_meta.get(i)
        if not self._learning and cached != metas:
            raise ValueError(
                f"stage {s} output of micro-batch {i} is {[str(m) for m in metas]} but the first step "
                f"produced {[str(m) for m in cached or ()]}; shapes and dtypes are fixed at the first "
                "step of a schedule (peers allocate receive buffers from them): keep the batch shape "
                "constant or build a new schedule"
            )
        for t in outputs:
            if t.layout is not torch.strided:
                raise ValueError(
                    f"stage {s} output of micro-batch {i} has layout {t.layout}; only dense (strided) "
                    "tensors can cross a stage boundary: return t.to_dense()"
                )
        stage.outputs_meta[i] = metas
        self._outputs[(s, i)] = tuple(t.contiguous() for t in outputs)

    def _fetch_output_grads(self, stage: PipelineStage, i: int) -> None:
        s = stage.stage_index
        if (s + 1) in self.stages:
            nxt = self.stages[s + 1]._micro[i]
            grads: list[torch.Tensor | None] = list(nxt.input_grads or ())
            nxt.input_grads = None
        else:
            grads = list(self._take_recv((T.BWD_RECV, s, i)))
        metas = stage.outputs_meta[i]
        outputs = stage._micro[i].outputs
        it = iter(grads)
        stage._micro[i].output_grads = tuple(
            _as_output_grad(next(it), m, out) if m.requires_grad else None
            for m, out in zip(metas, outputs, strict=True)
        )

    # -- payloads -----------------------------------------------------------------

    def _send_tensors(self, step: MetaStep) -> list[torch.Tensor]:
        return self._handler[step.type].payload(self, step)

    def _recv_metas(self, step: MetaStep, header: Any = None) -> list[TensorMeta]:
        return self._handler[step.type].metas(self, step, header)

    def take_recv(self, step: MetaStep) -> list[torch.Tensor]:
        """The tensors a receive step of this rank's list brought, waited for (each once)."""
        assert step.micro_index is not None, f"{step} names no micro-batch"
        return self._take_recv((step.type, step.stage_index, step.micro_index))

    def _take_recv(self, key: tuple[T, int, int]) -> list[torch.Tensor]:
        work = self._recv_work.pop(key, None)
        if work is not None:
            self._wait(work)
        return self._recv_bufs.pop(key)

    # -- communication ------------------------------------------------------------

    @property
    def _learning(self) -> bool:
        return self._first_step

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise CommError(str(exc)) from exc

    def _post(self, sends: Sequence[MetaStep], recvs: Sequence[MetaStep]) -> None:
        """Post these sends (their payloads) and receives (fresh buffers) of the list."""
        peer_rank = self.peer_rank
        out = [(t, peer_rank(step.peer_stage)) for step in sends for t in self._send_tensors(step)]  # type: ignore[arg-type]
        into = []
        for step in recvs:
            stage = self.stages[step.stage_index]
            bufs = [m.empty(stage.device) for m in self._recv_metas(step)]
            key = (step.type, step.stage_index, step.micro_index)
            self._recv_bufs[key] = bufs  # type: ignore[index]
            into.append((key, bufs, peer_rank(step.peer_stage)))  # type: ignore[arg-type]
        self._post_p2p(out, into)

    def _run_overlapped(self) -> None:
        """Later steps: posted one compute step early ([Note: posting and waiting])."""
        self._first_step = False
        blocks = self.blocks
        post = self._post
        if self._coalesce:
            # [Note: coalesced batches]: one batch per compute step, in list order.
            try:
                for block, batch in zip(blocks, _coalesced_batches(blocks), strict=True):
                    post([s for s in batch if s.type.is_send], [s for s in batch if s.type.is_recv])
                    if block.action is not None:
                        self._act(block.action)
            finally:
                self._drain_handles()
            return
        # [Note: receive lookahead], after the receives a runner posts first (set_early_receives).
        if self._early:
            blocks = self._lean_blocks
        ahead = self.recv_lookahead or len(blocks)
        try:
            post([], [*self._early, *(s for block in blocks[:ahead] for s in block.comms if s.type.is_recv)])
            for k, block in enumerate(blocks):
                following = blocks[k + ahead].comms if k + ahead < len(blocks) else []
                post([s for s in block.comms if s.type.is_send], [s for s in following if s.type.is_recv])
                if block.action is not None:
                    self._act(block.action)
        finally:
            self._drain_handles()

    def _post_p2p(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[Any, list[torch.Tensor], int]],
    ) -> None:
        """Start ``sends`` (tensor, peer) and ``recvs`` (key, buffers, peer); see [Note: direct p2p]."""
        group = self.group
        try:
            if self._coalesce:
                ops = [dist.P2POp(dist.irecv, b, peer, group) for _, bufs, peer in recvs for b in bufs]
                ops += [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
                if not ops:
                    return
                work = _Works(dist.batch_isend_irecv(ops))
                for key, _, _ in recvs:
                    self._recv_work[key] = work
                if sends:
                    self._send_work.append(work)
                return
            for key, bufs, peer in recvs:
                self._recv_work[key] = _Works([dist.irecv(b, peer, group=group) for b in bufs])
            for t, peer in sends:
                self._send_work.append(dist.isend(t, peer, group=group))
        except Exception as exc:
            raise CommError(str(exc)) from exc

    def _drain_handles(self) -> None:
        """Wait every posted handle (sends and receives nobody consumed)."""
        pending = self._send_work + list(self._recv_work.values())
        self._send_work, self._recv_work = [], {}
        errors = []
        for work in pending:
            try:
                work.wait()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise CommError(str(errors[0])) from errors[0]

    def _run_blocking(self) -> None:
        """The first step: every transfer blocking, with headers.

        See [Note: direct p2p] and [Note: first step].
        """
        self._first_step = True
        for block in self.blocks:
            for step in block.comms:
                if step.type.is_send:
                    self._blocking_send(step)
                else:
                    self._blocking_recv(step)
            if block.action is not None:
                self._act(block.action)

    def _blocking_send(self, step: MetaStep) -> None:
        from hp_core import send, send_object

        peer = self.peer_rank(step.peer_stage)  # type: ignore[arg-type]
        if self.draining:
            header: Any = self.failure if self.failure is not None else self._peer_failure
            try:
                send_object(_header_of(header), peer, self.group)
            except Exception as exc:
                raise CommError(str(exc)) from exc
            return
        tensors = self._send_tensors(step)
        transfer: Transfer = self._handler[step.type]
        header = _OK if transfer.header is None else transfer.header(self, step)
        try:
            send_object(header, peer, self.group)
            for t in tensors:
                send(t, peer, self.group)
        except Exception as exc:
            raise CommError(str(exc)) from exc

    def _blocking_recv(self, step: MetaStep) -> None:
        from hp_core import recv, recv_object

        peer = self.peer_rank(step.peer_stage)  # type: ignore[arg-type]
        s, i = step.stage_index, step.micro_index
        assert i is not None
        try:
            header = recv_object(peer, self.group)
        except Exception as exc:
            raise CommError(str(exc)) from exc
        if isinstance(header, StageFailure):
            if not self.draining:
                self._peer_failure = header
                self.draining = True
            return
        stage = self.stages[s]
        bufs = [m.empty(stage.device) for m in self._recv_metas(step, header)]
        try:
            for b in bufs:
                recv(b, peer, self.group)
        except Exception as exc:
            raise CommError(str(exc)) from exc
        self._recv_bufs[(step.type, s, i)] = bufs

    _first_step: bool = False
    arg_mbs: Any = None
    kwarg_mbs: Any = None
    targets: list[Any] | None = None
    loss_fn: Any = None
    scale: float = 1.0
    # [Note: receive lookahead]: None posts all of a step's receives at its start (gloo).
    recv_lookahead: int | None = None

    def _abort(self, exc: CommError) -> None:
        pending = self._send_work + list(self._recv_work.values())
        self._send_work, self._recv_work = [], {}
        for work in pending:
            try:
                work.wait(datetime.timedelta(seconds=self.abort_timeout))
            except Exception:  # best effort: the communicator is already broken
                pass
        cause = exc.__cause__ or exc
        raise PipelineStepError(
            f"pipeline communication failed on rank {self.rank}: {type(cause).__name__}: {cause}. "
            "The process group may be unusable; peers of this rank fail when their own "
            "communication breaks or times out.",
            [],
        ) from cause


def _header_of(failure: StageFailure | None) -> StageFailure:
    assert failure is not None
    return failure.portable()


def raise_step_error(failures: list[StageFailure], own: StageFailure | None) -> None:
    """Raise the same :class:`PipelineStepError` on every rank, chained to the local exception."""
    error = PipelineStepError.from_failures(failures)
    raise error from (own.exception if own is not None else None)


# -- the built-in kinds' handlers ([Note: running a kind] in hp_pipeline.kinds) ---------------


def _run_forward(runner: StepRunner, step: MetaStep) -> None:
    assert step.micro_index is not None
    runner._forward(runner.stages[step.stage_index], step.micro_index)


def _backward_pass(run: Callable[[PipelineStage, int, float], None], needs_output_grad: bool) -> Any:
    """The handler of a backward kind: fetch the output gradient (``B``/``I``), then ``run``."""

    def handler(runner: StepRunner, step: MetaStep) -> None:
        stage, i = runner.stages[step.stage_index], step.micro_index
        assert i is not None
        if needs_output_grad and not stage.is_last:
            runner._fetch_output_grads(stage, i)
        run(stage, i, runner.scale)

    return handler


def _fsdp_pass(run: Callable[[StepRunner, ShardedUnits, int], None]) -> Any:
    """The handler of an FSDP kind: ``run`` on the stage's sharded units, if it has any."""

    def handler(runner: StepRunner, step: MetaStep) -> None:
        units = runner._units(step.stage_index)
        if units:
            run(runner, units, step.stage_index)

    return handler


def _unshard(runner: StepRunner, units: ShardedUnits, stage: int) -> None:
    runner._unsharded[stage] = units.unshard()  # waited by the stage's next compute step


def _activation_payload(runner: StepRunner, step: MetaStep) -> list[torch.Tensor]:
    stage, i = runner.stages[step.stage_index], step.micro_index
    assert i is not None
    if not runner.draining:
        return [local_of(t).contiguous() for t in runner._outputs.pop((step.stage_index, i))]
    return [m.zeros(stage.device) for m in stage.outputs_meta[i]]


def _activation_metas(runner: StepRunner, step: MetaStep, header: Any) -> list[TensorMeta]:
    stage, i = runner.stages[step.stage_index], step.micro_index
    assert i is not None
    if header is not None:  # the first step: the sender's output metadata ([Note: first step])
        stage.inputs_meta[i] = tuple(header)
    return list(stage.inputs_meta[i])


def _grad_payload(runner: StepRunner, step: MetaStep) -> list[torch.Tensor]:
    stage, i = runner.stages[step.stage_index], step.micro_index
    assert i is not None
    metas = [m for m in stage.inputs_meta[i] if m.requires_grad]
    state = stage._micro.get(i)
    grads = None if (runner.draining or state is None) else state.input_grads
    if grads is None:
        return [m.zeros(stage.device) for m in metas]
    if state is not None:
        state.input_grads = None
    return [
        (m.zeros(stage.device) if g is None else grad_to_send(g, m.dtensor).contiguous())
        for g, m in zip(grads, metas, strict=True)
    ]


def _as_output_grad(grad: torch.Tensor | None, meta: TensorMeta, output: torch.Tensor) -> torch.Tensor | None:
    """A received gradient's shard as a DTensor like the output it seeds ([Note: DTensors across stages])."""
    if grad is None or meta.dtensor is None or is_dtensor(grad):
        return grad
    return rebuild(grad, meta.dtensor, output.device_mesh)  # type: ignore[attr-defined]


def _grad_metas(runner: StepRunner, step: MetaStep, header: Any) -> list[TensorMeta]:
    assert step.micro_index is not None
    return [m for m in runner.stages[step.stage_index].outputs_meta[step.micro_index] if m.requires_grad]


#: The built-in kinds' handlers by code, attached by ``hp_pipeline._builtin_kinds.register_builtins``.
BUILTIN_HANDLERS: tuple[tuple[str, Any], ...] = (
    ("F", _run_forward),
    ("B", _backward_pass(PipelineStage.backward_one_chunk, True)),
    ("I", _backward_pass(PipelineStage.backward_input, True)),
    ("W", _backward_pass(PipelineStage.backward_weight, False)),
    ("UNSHARD", _fsdp_pass(_unshard)),
    ("RESHARD", _fsdp_pass(lambda runner, units, _: units.reshard(runner.training))),
    ("REDUCE_GRAD", _fsdp_pass(lambda runner, units, _: units.reduce_grad())),
    (
        "SEND_F",
        Transfer(
            payload=_activation_payload,
            header=lambda r, s: r.stages[s.stage_index].outputs_meta[s.micro_index],
        ),
    ),
    ("RECV_F", Transfer(metas=_activation_metas)),
    ("SEND_B", Transfer(payload=_grad_payload)),
    ("RECV_B", Transfer(metas=_grad_metas)),
)

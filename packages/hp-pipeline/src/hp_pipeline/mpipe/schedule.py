"""``ScheduleMPipe``: a base schedule (1F1B, ZB-V, DualPipeV, ...) with the preprocess tower spread out.

See [Note: MPipe steps] (:mod:`hp_pipeline.mpipe.order`) for the order and
:mod:`hp_pipeline.mpipe.runner` for how each step runs.

Details: [Note: MPipe with data parallelism], [Note: token-normalised loss].
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_pipeline._checks import check_bool, check_loss_kwargs, check_options
from hp_pipeline._torch_api import as_process_group, tower_chunks
from hp_pipeline.comms import insert_comms
from hp_pipeline.errors import StageFailure
from hp_pipeline.executor import StepRunner
from hp_pipeline.grads import clip_grad_norm_, sync_tied
from hp_pipeline.ir import Order
from hp_pipeline.mpipe.order import MPIPE_BASES, build_mpipe_order, mpipe_base_layout, mpipe_base_schedules
from hp_pipeline.mpipe.ownership import OverflowMode, check_owns_data, mpipe_owned_micros
from hp_pipeline.mpipe.runner import MPipeRunner
from hp_pipeline.schedules import (
    SCHEDULE_OPTIONS,
    LossFn,
    PipelineSchedule,
    _failure_outside_steps,
)
from hp_pipeline.stage import PipelineStage

__all__ = ["ScheduleMPipe"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor-like tensor (``to_local``), else the tensor: elementwise ops act on it."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _check_mpipe_keywords(
    *,
    preprocess: object,
    overflow_mode: object,
    flags: Mapping[str, object],
    keys: Mapping[str, object],
    target_key: object,
    ignore_index: object,
    dp_group: object,
    options: Mapping[str, Any],
) -> None:
    """ScheduleMPipe's own keywords, checked before the base class builds anything ."""
    where = "ScheduleMPipe"
    check_options(where, options, SCHEDULE_OPTIONS)
    if not isinstance(preprocess, nn.Module):
        raise TypeError(
            f"{where}: preprocess must be an nn.Module, got {type(preprocess).__name__}; pass the "
            "preprocess tower (e.g. the vision encoder) as a module"
        )
    if overflow_mode not in ("full", "min"):
        raise ValueError(f"{where}: overflow_mode must be 'full' or 'min', got {overflow_mode!r}")
    for name, value in flags.items():
        check_bool(where, name, value)
    for name, value in keys.items():
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise TypeError(
                f"{where}: {name}={value!r} is a {type(value).__name__}, not a sequence of key names"
                + (
                    f"; pass a tuple, e.g. {name}=({value!r},)"
                    if isinstance(value, str)
                    else "; pass a tuple of str"
                )
            )
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: {name} holds {bad}, which are not str; name each key as a str")
    if not isinstance(target_key, str):
        raise TypeError(
            f"{where}: target_key={target_key!r} is a {type(target_key).__name__}, not a str; pass the "
            "key of the labels in each loaded micro-batch, e.g. target_key='labels'"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(
            f"{where}: ignore_index={ignore_index!r} is a {type(ignore_index).__name__}, not an int; pass "
            "the label value the loss ignores (e.g. -100)"
        )
    as_process_group(where, dp_group, "dp_group")


def _base_name(base: str | type | None) -> str | None:
    """A base given as a schedule class or a name, as a name of ``MPIPE_BASES`` ([Note: MPipe bases])."""
    if base is None or isinstance(base, str):
        return base
    from hp_pipeline import schedules

    by_class: dict[type, str] = {
        getattr(schedules, cls_name): name for name, cls_name in mpipe_base_schedules().items()
    }
    if isinstance(base, type) and base in by_class:
        return by_class[base]
    name = base.__name__ if isinstance(base, type) else type(base).__name__
    why = (
        " (GPipe has 1F1B's bubble but keeps all m micro-batches alive; use Schedule1F1B)"
        if name == "ScheduleGPipe"
        else ""
    )
    raise ValueError(
        f"ScheduleMPipe cannot build on {name}{why}; base= takes one of "
        f"{[c.__name__ for c in by_class]} or a name in {list(MPIPE_BASES)}"
    )


# [Note: MPipe with data parallelism]
# With a ``(pp, dp)`` mesh every dp replica runs its own MPipe pipeline on its
# share of the global batch; the text stages are typically wrapped with
# ``fully_shard`` on the dp submesh and take part through the FSDP steps
# ([Note: FSDP protocol] in :mod:`hp_pipeline.fsdp`), whose gradient reduction
# *averages* over dp. The tower is a plain replica on every rank of the mesh, so
# ``dp_group=`` makes the schedule treat it the same way: ``REDUCE_P`` sums this
# step's tower gradients over the pipeline group, then averages the sum over
# ``dp_group``; the construction broadcast and the sync check cover the dp
# group too. With ``normalize_by_tokens`` the token count is summed over both
# groups (``N``) and each replica divides by ``N / dp``, so that the dp average
# of the gradients is the gradient of ``sum(token losses) / N`` over the whole
# global batch; reported losses are divided the same way, so the dp *mean* of
# each replica's ``sum(losses)`` is the global loss. This assumes the stages'
# dp reduction averages (hp-fsdp's default).


# [Note: token-normalised loss]
# A language-model loss is a mean over the *valid* tokens of the whole batch
# (``labels != ignore_index``), not a mean of per-micro-batch means. With
# ``normalize_by_tokens=True`` the ``loss_fn`` returns the *sum* of the token
# losses of its micro-batch; every backward is seeded with 1; after the step the
# count of valid tokens is all-reduced over the pipeline group (with in-schedule
# loading each owner counts the micro-batches it read; otherwise the last
# stage's rank counts its targets) and this step's contribution to every
# gradient (stages and tower) is divided by it, and so is each reported
# micro-batch loss. The gradients then equal single-process training of
# ``sum(token losses) / count`` on the whole batch, and ``sum(losses)`` is its
# loss. Gradients accumulated over earlier steps are left as they were.


class ScheduleMPipe(PipelineSchedule):
    """MPipe: micro-batch ``k``'s preprocess tower runs on its owning rank, features go to stage 0.

    One stage per rank gives the 1F1B base order; a list of ``v > 1`` stages
    per rank (loop placement) the interleaved one; ``base=`` picks another
    of :data:`~hp_pipeline.mpipe.MPIPE_BASES` instead: ZB-H1 (one stage per
    rank), looped BFS or interleaved zero bubble (a list, loop placement),
    ZB-V or DualPipeV (two per rank, V placement) ([Note: MPipe bases]). It
    extends :class:`~hp_pipeline.schedules.PipelineSchedule` through its
    public subclass hooks ([Note: schedule subclass hooks]). Every rank holds a replica
    of ``preprocess`` (include its parameters in every rank's optimizer);
    stage 0's module is called as ``module(*text_args, *features, **kwargs)``.

    Args:
        stage_or_stages: this rank's stage(s), as for ``Schedule1F1B`` /
            ``ScheduleInterleaved1F1B``.
        n_microbatches: ``m``.
        preprocess: the tower module; returns a tensor or a tuple of tensors.
        loss_fn: ``loss_fn(output, target)`` on the last stage (``None``: forward only).
        owner_backward: the owner backpropagates dL/dfeatures through the graph
            it kept (``True``), or stage 0 recomputes the tower from the inputs
            sent along with the features (``False``).
        overflow_mode: ``"full"`` or ``"min"`` ([Note: MPipe ownership]).
        batched_recv: post all of stage 0's feature/data receives of a step at
            once and wait them once ([Note: MPipe receive posting]); ``False``
            receives each with the base executor's posting. Backends that
            coalesce (NCCL, HCCL) always use the base posting, in list order:
            batching there can deadlock (the same note).
        in_schedule_loading: each owner reads its micro-batches inside the
            step (``step(data=iterator)``); only ``input_keys`` travel to stage
            0 and ``target_key`` to the last stage.
        input_keys, preprocess_keys, target_key: the names, in a loaded
            micro-batch mapping, of stage 0's positional inputs, the tower's
            positional inputs and the target.
        normalize_by_tokens: see [Note: token-normalised loss]; ``loss_fn``
            must then return a sum over tokens.
        ignore_index: the label value that marks a token without loss.
        broadcast_tower: copy pipeline rank 0's tower parameters and buffers to
            every rank at construction.
        check_tower_sync: before every step, verify that the tower's
            parameters are identical on every rank (raises otherwise).
        base: the base schedule: ``None`` (1F1B or interleaved by the stage
            count), a name in ``MPIPE_BASES`` (``"1f1b"``, ``"interleaved"``,
            ``"looped-bfs"``, ``"zb-h1"``, ``"interleaved-zb"``, ``"zbv"``,
            ``"dualpipev"``) or the class of that schedule (``Schedule1F1B``,
            ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
            ``ScheduleZeroBubble``, ``ScheduleInterleavedZeroBubble``,
            ``ScheduleZBV`` / ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``).
            Any other raises ``ValueError`` naming the ones MPipe serves.
        dp_group: the data-parallel group across pipeline replicas when the
            stages are sharded or replicated over data parallelism (e.g.
            ``mesh["dp"].get_group()`` of a ``(pp, dp)`` mesh, stages wrapped
            with ``fully_shard`` on ``mesh["dp"]``); see [Note: MPipe with
            data parallelism]. ``None``: one pipeline, no data parallelism.
        args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads,
        abort_timeout: as for the other schedules.
    """

    _name = "ScheduleMPipe"

    def __init__(
        self,
        stage_or_stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        *,
        preprocess: nn.Module,
        loss_fn: LossFn | None,
        owner_backward: bool = True,
        overflow_mode: OverflowMode = "full",
        batched_recv: bool = True,
        in_schedule_loading: bool = False,
        input_keys: Sequence[str] = ("input_ids",),
        preprocess_keys: Sequence[str] = ("pixel_values",),
        target_key: str = "labels",
        normalize_by_tokens: bool = False,
        ignore_index: int = -100,
        broadcast_tower: bool = True,
        check_tower_sync: bool = False,
        base: str | type | None = None,
        dp_group: dist.ProcessGroup | Any | None = None,
        **options: Any,
    ) -> None:
        _check_mpipe_keywords(
            preprocess=preprocess,
            overflow_mode=overflow_mode,
            flags={
                "owner_backward": owner_backward,
                "batched_recv": batched_recv,
                "in_schedule_loading": in_schedule_loading,
                "normalize_by_tokens": normalize_by_tokens,
                "broadcast_tower": broadcast_tower,
                "check_tower_sync": check_tower_sync,
            },
            keys={"input_keys": input_keys, "preprocess_keys": preprocess_keys},
            target_key=target_key,
            ignore_index=ignore_index,
            dp_group=dp_group,
            options=options,
        )
        self.preprocess = preprocess
        self.owner_backward = bool(owner_backward)
        self.overflow_mode: OverflowMode = overflow_mode
        self.batched_recv = bool(batched_recv)
        self.in_schedule_loading = bool(in_schedule_loading)
        self.input_keys, self.preprocess_keys = tuple(input_keys), tuple(preprocess_keys)
        self.target_key, self.ignore_index = target_key, ignore_index
        self.normalize_by_tokens = bool(normalize_by_tokens)
        self.check_sync = bool(check_tower_sync)
        self.dp_group = dp_group = as_process_group(self._name, dp_group, "dp_group")
        self.dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.tower_trainable = any(p.requires_grad for p in preprocess.parameters())
        local = 1 if isinstance(stage_or_stages, PipelineStage) else len(stage_or_stages)
        # An empty list is reported by the base class (it names what it needs), not here.
        self.base, self._v, self._style = mpipe_base_layout(_base_name(base), max(local, 1))
        self._training = loss_fn is not None
        super().__init__(stage_or_stages, n_microbatches, loss_fn, **options)
        p, m = self.num_ranks, n_microbatches
        self.owned_micros = mpipe_owned_micros(p, m, self.group_rank, overflow_mode)
        if self.in_schedule_loading:
            check_owns_data(p, m, self.group_rank, overflow_mode)
        if broadcast_tower and p > 1:
            # Construction communicates here, so the ranks agree first ([Note: schedule agreement]).
            self._agree_across_ranks()
            self.broadcast_tower()

    # -- construction hooks ([Note: schedule subclass hooks]) ---------------------------

    def fingerprint(self) -> dict[str, Any]:
        """The base's settings plus the MPipe keywords that shape the order on every rank."""
        return {
            **super().fingerprint(),
            "base": self.base,
            "overflow_mode": self.overflow_mode,
            "owner_backward": self.owner_backward,
            "in_schedule_loading": self.in_schedule_loading,
            "tower_trainable": self.tower_trainable,
        }

    def expected_num_stages(self, num_ranks: int, stages_per_rank: int) -> int:
        """Every base runs the same number of stages on each rank."""
        return num_ranks * stages_per_rank

    def build_order(self, num_ranks: int, n_microbatches: int) -> Order:
        """The base order with the tower's steps woven in ([Note: MPipe steps])."""
        return build_mpipe_order(
            num_ranks,
            n_microbatches,
            base=self.base,
            stages_per_rank=self._v,
            overflow_mode=self.overflow_mode,
            owner_backward=self.owner_backward,
            tower_backward=self._training and self.tower_trainable,
            load_data=self.in_schedule_loading,
        )

    def add_comms(self, order: Order) -> Order:
        """With in-schedule loading the data goes from each owner to stage 0 and the last stage too."""
        data_stages = [0, self.num_ranks * self._v - 1] if self.in_schedule_loading else None
        return insert_comms(order, data_stages=data_stages)

    def make_runner(self, *, training: bool, abort_timeout: float) -> StepRunner:
        """An :class:`~hp_pipeline.mpipe.runner.MPipeRunner`: the base executor plus the tower's steps."""
        runner = MPipeRunner(
            self._stages,
            self.order[self.group_rank],
            self._peer_rank,
            self.group,
            training=training,
            abort_timeout=abort_timeout,
            preprocess=self.preprocess,
            owner_backward=self.owner_backward,
            tower_trainable=self.tower_trainable,
            batched_recv=self.batched_recv,
            input_keys=self.input_keys,
            preprocess_keys=self.preprocess_keys,
            target_key=self.target_key,
            ignore_index=self.ignore_index,
            stage_rank={s: self._peer_rank(s) for s in range(self.num_ranks * self._v)},
        )
        runner.n_micro = self._n_microbatches
        runner.dp_group, runner.dp_size = self.dp_group, self.dp_size
        runner.loading = self.in_schedule_loading
        return runner

    @property
    def batched(self) -> bool:
        """Whether this rank posts its feature/data receives batched (see ``batched_recv``)."""
        return bool(getattr(self._runner, "batched", False))

    # -- tower replicas -------------------------------------------------------------

    def _tower_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.preprocess.named_parameters(), *self.preprocess.named_buffers()]

    def broadcast_tower(self) -> None:
        """Copy pipeline rank 0's tower parameters and buffers to every rank (call on every rank)."""
        from hp_core import broadcast

        with torch.no_grad():
            for _, tensor in self._tower_tensors():
                broadcast(tensor.detach(), group=self.group, group_src=0)
                if self.dp_group is not None:  # [Note: MPipe with data parallelism]
                    broadcast(tensor.detach(), group=self.dp_group, group_src=0)

    def check_tower_sync(self) -> None:
        """Raise ``RuntimeError`` naming the tower parameters that differ between ranks (every rank)."""
        from hp_core import all_reduce

        named = self._tower_tensors()
        if not named:
            return
        device = named[0][1].device
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for _, t in named]).to(device)
        high, low = flat.clone(), flat.clone()
        for group in (self.group, self.dp_group) if self.dp_group is not None else (self.group,):
            all_reduce(high, "max", group)
            all_reduce(low, "min", group)
        gap = high - low
        if not bool((gap > 0).any()):
            return
        bad, offset = [], 0
        for name, t in named:
            part = gap[offset : offset + t.numel()]
            offset += t.numel()
            if bool((part > 0).any()):
                bad.append(f"{name} (max difference {float(part.max()):.3g})")
        raise RuntimeError(
            f"ScheduleMPipe: the preprocess tower's replicas differ across the pipeline group: "
            f"{', '.join(bad)}. They must stay identical: give every rank's optimizer the tower's "
            "parameters with the same settings, do not modify them on one rank only, and call "
            "broadcast_tower() after loading a checkpoint on some ranks only"
        )

    # -- running ----------------------------------------------------------------------

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
        data: Iterator[Mapping[str, torch.Tensor]] | None = None,
        preprocess_inputs: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step; returns the merged output on the last stage's rank.

        Without in-schedule loading: stage 0's rank passes the text inputs
        (``*args``, ``**kwargs``), the last stage's rank ``target=``, and every
        rank that owns micro-batches ``preprocess_inputs=`` (the whole batch's
        tower inputs: a tensor or a tuple of tensors, split along dim 0 like
        the other inputs). With it: every rank passes ``data=``, an iterator
        yielding its owned micro-batches as mappings (see :class:`PPRankOwnedSampler`).
        ``return_outputs`` and ``loss_kwargs`` are :meth:`PipelineSchedule.step`'s (torch's),
        and so is the pre-split form (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``);
        with it, ``preprocess_inputs`` is pre-split too: a list of ``n_microbatches``
        entries, micro-batch ``k``'s tower inputs (a tensor or a tuple of tensors;
        ``None`` for a micro-batch this rank does not own).
        """
        if self.check_sync:
            self.check_tower_sync()
        m = self._n_microbatches
        runner = self._runner
        assert isinstance(runner, MPipeRunner)
        pre_failure: StageFailure | None = None
        inputs: tuple[Any, Any, list[Any] | None] = (None, None, None)
        runner.data_iter, runner.tower_chunks = None, None
        tower_params = [p for p in self.preprocess.parameters() if p.requires_grad]
        runner.tower_grad_start = [None if p.grad is None else p.grad.detach().clone() for p in tower_params]
        stage_params = [p for s in self._stages.values() for p in s.submod.parameters() if p.requires_grad]
        # Only the token normalisation rescales this step's contribution of the stages' gradients.
        stage_start = [
            None if p.grad is None or not self.normalize_by_tokens else p.grad.detach().clone()
            for p in stage_params
        ]
        try:
            check_bool("step", "return_outputs", return_outputs)
            check_loss_kwargs(loss_kwargs)
            for stage in self._stages.values():
                stage._check_materialized()
            mbs = (arg_mbs, kwarg_mbs, target_mbs)
            if self.in_schedule_loading:
                if any(v is not None for v in mbs):
                    raise ValueError(
                        f"rank {dist.get_rank()}: ScheduleMPipe(in_schedule_loading=True) reads each "
                        "micro-batch inside the step; pass step(data=iterator), not "
                        "arg_mbs/kwarg_mbs/target_mbs"
                    )
                if data is None:
                    raise ValueError(
                        f"rank {dist.get_rank()}: ScheduleMPipe(in_schedule_loading=True) reads the data "
                        "inside the step; pass step(data=iterator) on every rank"
                    )
                runner.data_iter = iter(data)
            else:
                inputs = self._split_inputs(
                    args, kwargs, target, "schedule.step(input_ids, preprocess_inputs=pixels)", mbs
                )
                if self.owned_micros:
                    pre_split = any(v is not None for v in mbs)
                    runner.tower_chunks = tower_chunks(self.owned_micros, preprocess_inputs, m, pre_split)
        except Exception as exc:
            pre_failure = _failure_outside_steps(exc)
        # [Note: token-normalised loss]: seed 1 and divide by the token count after the step.
        scale = 1.0 if self.normalize_by_tokens or not self.scale_grads else 1.0 / m
        self._run_step(*inputs, scale, pre_failure, loss_kwargs=loss_kwargs)
        if self.normalize_by_tokens and self._loss_fn is not None:
            self._normalise(
                runner, inputs[2], stage_params, stage_start, tower_params, runner.tower_grad_start
            )
        if self._tied and self._loss_fn is not None:
            sync_tied(self._tied, self._modules(), self._rank_of_stage(), self.group, values=False)
        return self._finish(losses, return_outputs=return_outputs)

    def _normalise(
        self,
        runner: MPipeRunner,
        targets: list[Any] | None,
        stage_params: list[torch.nn.Parameter],
        stage_start: list[torch.Tensor | None],
        tower_params: list[torch.nn.Parameter],
        tower_start: list[torch.Tensor | None],
    ) -> None:
        """[Note: token-normalised loss]."""
        from hp_core import all_reduce

        # Summed without reading a device value per micro-batch; the one read is below.
        local: int | torch.Tensor
        if self.in_schedule_loading:
            local = runner.local_tokens
        else:
            local = sum(((t != self.ignore_index).sum() for t in targets or ()), start=0)
        device = next(iter(self._stages.values())).device
        count = torch.zeros(1, dtype=torch.int64, device=device).add_(local)
        all_reduce(count, "sum", self.group)
        if self.dp_group is not None:
            all_reduce(count, "sum", self.dp_group)
        # Kept on the device: reading it here would stall the host every step; it is read only
        # when last_token_count is. [Note: MPipe with data parallelism]: the dp average then
        # divides by dp once more.
        self._token_count = count
        total = count.clamp(min=1).to(torch.float64).reshape(()) / self.dp_size
        with torch.no_grad():
            for params, starts in ((stage_params, stage_start), (tower_params, tower_start)):
                for p, start in zip(params, starts, strict=True):
                    if p.grad is None:
                        continue
                    # A sharded gradient (a DTensor of fully_shard) is scaled shard by shard.
                    grad = _local(p.grad)
                    if start is None:
                        grad.div_(total)
                    else:
                        begin = _local(start)
                        grad.sub_(begin).div_(total).add_(begin)
        last = self._stages.get(self.num_stages - 1)
        if last is not None:
            for i, loss in list(last._last_losses.items()):
                last._last_losses[i] = loss / total.to(loss.dtype)  # the loss keeps its dtype

    _token_count: torch.Tensor | None = None

    @property
    def last_token_count(self) -> int:
        """The tokens the last step's loss was divided by, over the pipeline (and dp) group.

        Read on access (a device-to-host copy); the step itself keeps the count on the device.
        """
        return 0 if self._token_count is None else int(self._token_count.item())

    # -- clipping ---------------------------------------------------------------------

    def parameters_for_norm(self) -> list[torch.nn.Parameter]:
        """Stage parameters (tied ones once) plus, on pipeline rank 0 only, the tower's replica."""
        params = super().parameters_for_norm()
        if self.group_rank == 0:
            seen = {id(p) for p in params}
            params += [p for p in self.preprocess.parameters() if id(p) not in seen]
        return params

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip by the global norm of the whole model, the tower counted once (call on every rank)."""
        return clip_grad_norm_(
            self.parameters_for_norm(),
            max_norm,
            norm_type,
            group=self.group,
            error_if_nonfinite=error_if_nonfinite,
            also_scale=[
                *(p for stage in self._stages.values() for p in stage.submod.parameters()),
                *self.preprocess.parameters(),
            ],
        )

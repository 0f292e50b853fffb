"""The MPipe executor: the base executor plus the tower's steps and in-schedule data.

MPipe's kinds run through the step-kind registry ([Note: running a kind] in
:mod:`hp_pipeline.kinds`): this module holds their handlers, and
:class:`MPipeRunner` gives the built-in ``LOAD``/``SEND_D``/``RECV_D`` theirs
for its own runs and uses the runner's public hooks (``begin_step``,
``forward_inputs``, ``target_of``, ``set_early_receives``); posting,
first-step headers and failure draining are the base executor's ([Note:
posting and waiting] and [Note: failures] in :mod:`hp_pipeline.executor`).
[Note: MPipe runner steps] lists the steps; the other [Note]s below:
feature gradients, data keys, early tower reduction, tower gradient
reduction.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_pipeline.executor import CommError, StepRunner
from hp_pipeline.ir import MetaStep, MetaStepType
from hp_pipeline.kinds import Transfer
from hp_pipeline.mpipe.order import mpipe_receives_lead
from hp_pipeline.stage import PipelineStage, TensorMeta

__all__ = ["MPIPE_HANDLERS"]

# [Note: MPipe runner steps]
# * ``LOAD``: take this rank's next owned micro-batch (a mapping of tensors)
#   from the data iterator; ``SEND_D``/``RECV_D`` carry only the tensors the
#   receiving stage needs: ``input_keys`` to stage 0, ``target_key`` to the last
#   stage ([Note: data keys]);
# * ``PF``: run the tower on the micro-batch; ``SEND_P``/``RECV_P`` carry its
#   outputs (plus, without the owner backward, the tower's inputs) to stage 0;
# * stage 0's forward is called as ``module(*text_args, *features, **kwargs)``,
#   the features being leaves that collect dL/dfeatures in stage 0's backward;
# * ``PB``: backward through the tower, on the owner (with the gradient
#   ``SEND_PG``/``RECV_PG`` brought back) or recomputed on stage 0
#   ([Note: feature gradients]);
# * ``REDUCE_P``: sum this step's tower-gradient contribution over the pipeline
#   group ([Note: tower gradient reduction], posted early where the backend
#   allows: [Note: early tower reduction]).


# [Note: tower gradient reduction]
# Each rank backpropagates only its own micro-batches through its replica of the
# tower, so its gradients hold part of the step's gradient (with ``dp_group``
# the sum is then averaged over the data-parallel replicas, see [Note: MPipe
# with data parallelism] in :mod:`hp_pipeline.mpipe.schedule`). ``REDUCE_P`` sums,
# over the pipeline group, each parameter's *contribution of this step*
# (``grad - grad_at_step_start``) and adds the sum back to the value at the
# start of the step. Gradients accumulated over earlier steps (which every
# replica already holds identically) are thus not counted ``p`` times. All
# parameters go in one flat buffer per dtype, with one flag per parameter that
# says whether any rank produced a gradient, so a parameter no micro-batch
# reached keeps ``grad = None`` like in single-process training.


T = MetaStepType


def flatten_tower_output(out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    kinds = type(out).__name__ if not isinstance(out, (tuple, list)) else [type(t).__name__ for t in out]
    raise TypeError(
        f"the MPipe preprocess tower returned {kinds}; it must return a tensor or a non-empty "
        "tuple/list of tensors (they become stage 0's extra positional arguments)"
    )


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# [Note: feature gradients]
# Stage 0's features are leaves; their gradient is dL/dfeatures, which the
# tower's backward needs. A full backward (``B``) accumulates it into
# ``leaf.grad``, but a split one (``I`` of a zero-bubble base) computes input
# gradients with ``torch.autograd.grad``, which fills no ``.grad``, and a
# first stage keeps no input gradient of its own. So every feature leaf that
# requires grad gets a tensor hook that records the gradient as autograd
# computes it: the hook fires for ``B`` and ``I`` alike, once per backward (a
# leaf used twice gets the sum), and not for ``W``, which asks for parameter
# gradients only. ``SEND_PG`` and the recompute ``PB`` read the recorded value.
#
# On the first step every MPipe transfer carries one header object (the list of
# :class:`~hp_pipeline.stage.TensorMeta` of all its tensors: one metadata
# message per micro-batch, not one per tensor); later steps reuse it. A loaded
# micro-batch or a tower output whose shape changes after the first step fails
# in its compute step (``LOAD`` / ``PF``), so the failure drains like any other.


# [Note: data keys]
# A loaded micro-batch is a mapping; the owner keeps it whole (its tower reads
# ``preprocess_keys``) and sends each other stage only what it reads: stage 0
# gets ``input_keys`` (its positional text inputs), the last stage
# ``target_key``. A stage on the owner's rank reads the owner's copy.


# [Note: early tower reduction]
# Once a rank has run its last ``PB``, its contribution to the tower's
# gradients is final, so on gloo the sum is posted there, asynchronously, and
# ``REDUCE_P`` only waits for it: the transfer overlaps the rank's remaining
# pipeline steps (rank 0's last ``PB`` usually comes well before its last
# ``B``), and a rank that reaches ``REDUCE_P`` late finds the other ranks'
# parts already there. Every rank still posts exactly one sum per dtype, in
# the same order; a rank that fails before its last ``PB`` posts zeros at
# ``REDUCE_P`` like before. Backends that run a rank's operations in one queue
# (NCCL, HCCL) are excluded: there a collective posted before a send that a
# peer must receive first, while that peer posts the same collective after
# the receive, would wait for each other forever; they reduce at ``REDUCE_P``.


class MPipeRunner(StepRunner):
    """Runs one rank's MPipe steps; one instance per schedule, reused across steps."""

    def __init__(
        self,
        stages: dict[int, PipelineStage],
        steps: Sequence[MetaStep],
        peer_rank: Any,
        group: dist.ProcessGroup | None,
        *,
        training: bool,
        abort_timeout: float,
        preprocess: nn.Module,
        owner_backward: bool,
        tower_trainable: bool,
        batched_recv: bool,
        input_keys: Sequence[str],
        preprocess_keys: Sequence[str],
        target_key: str,
        ignore_index: int,
        stage_rank: Mapping[int, int],
    ) -> None:
        super().__init__(
            stages,
            steps,
            peer_rank,
            group,
            training=training,
            abort_timeout=abort_timeout,
            # [Note: data keys]: in-schedule loading is MPipe's
            handlers={MetaStepType(code): handler for code, handler in _DATA_HANDLERS},
        )
        self.preprocess = preprocess
        self.owner_backward = owner_backward
        self.tower_trainable = tower_trainable and training
        self.input_keys = tuple(input_keys)
        self.preprocess_keys = tuple(preprocess_keys)
        self.target_key = target_key
        self.ignore_index = ignore_index
        self.num_stages = next(iter(stages.values())).num_stages
        self.device = next(iter(stages.values())).device
        # [Note: MPipe receive posting]: batch the leading receives when the order allows it;
        # the base runner refuses on backends that coalesce (their receive groups would hold
        # back our sends).
        early = [s for s in self.steps if s.type in (T.PREPROCESS_RECV, T.DATA_RECV)]
        self.batched = bool(
            batched_recv and mpipe_receives_lead(self.steps, stage_rank) and self.set_early_receives(early)
        )
        # [Note: early tower reduction]: the reduction of this rank's tower gradients is posted
        # right after its last PB, where no backend runs its operations in one queue.
        backwards = [s for s in self.steps if s.type is T.PREPROCESS_BWD]
        self._last_tower_backward = backwards[-1] if backwards and not self._coalesce else None
        self._recv_step = {(s.type, s.stage_index, s.micro_index): s for s in self.steps if s.type.is_recv}
        self._feature_source = {
            s.micro_index: s.peer_stage
            for s in self.steps
            if s.type is T.PREPROCESS_RECV and s.micro_index is not None and s.peer_stage is not None
        }
        # Learned on the first step and kept: the metadata of each MPipe transfer.
        self._xfer_meta: dict[MetaStep, tuple[TensorMeta, ...]] = {}
        self._shapes: dict[tuple[str, int], tuple[Any, ...]] = {}
        self._n_features: dict[int, int] = {}
        self.n_micro = 0
        self.loading = False
        # [Note: MPipe with data parallelism]: the tower's gradients are averaged over this group.
        self.dp_group: dist.ProcessGroup | None = None
        self.dp_size = 1
        # Per-step inputs, set by the schedule before run().
        self.data_iter: Iterator[Any] | None = None
        self.tower_chunks: list[tuple[Any, ...]] | None = None
        self.tower_grad_start: list[torch.Tensor | None] = []
        self.local_tokens: int | torch.Tensor = 0

    def begin_step(self) -> None:
        """The per-step state of the tower, the loaded data and the features."""
        super().begin_step()
        self._pending_reduce: Any = None
        #: ids of this step's tower-gradient buffers to which this rank sent every gradient
        self._contributed: set[int] = set()
        self.local_tokens = 0
        self._data: dict[int, dict[str, torch.Tensor]] = {}
        self._tower_in: dict[int, tuple[torch.Tensor, ...]] = {}
        self._tower_out: dict[int, tuple[torch.Tensor, ...]] = {}  # detached outputs
        self._tower_graph: dict[int, tuple[torch.Tensor, ...]] = {}  # graph-connected (owner backward)
        self._features: dict[int, tuple[torch.Tensor, ...]] = {}  # leaves on stage 0
        # [Note: feature gradients]: micro -> {feature position: dL/dfeature}.
        self._feature_grad: dict[int, dict[int, torch.Tensor]] = {}
        self._feature_meta: dict[int, tuple[TensorMeta, ...]] = {}

    # -- helpers --------------------------------------------------------------------

    def _keys_for(self, stage: int) -> tuple[str, ...]:
        """[Note: data keys]: what each data-receiving stage needs of a micro-batch."""
        if stage == 0:
            return self.input_keys
        return (self.target_key,)

    def _feature_metas(self, outs: Sequence[torch.Tensor]) -> tuple[TensorMeta, ...]:
        if self.owner_backward:
            return tuple(TensorMeta.of(t) for t in outs)
        # Recompute mode: the owner ran the tower without a graph; a feature gets a gradient
        # when it is differentiable and the tower trains.
        return tuple(
            TensorMeta(tuple(t.shape), t.dtype, self.tower_trainable and _differentiable(t)) for t in outs
        )

    def _check_same(self, what: str, i: int, tensors: Sequence[torch.Tensor]) -> None:
        """Shapes are fixed at the first step; checked in the compute step, so a change drains cleanly."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors)
        cached = self._shapes.setdefault((what, i), shapes)
        if cached != shapes:
            raise ValueError(
                f"{what} of micro-batch {i} is {[(list(a), str(b)) for a, b in shapes]} but the first step "
                f"had {[(list(a), str(b)) for a, b in cached]}; shapes and dtypes are fixed at the first "
                "step of a schedule (peers allocate their receive buffers from them): keep the "
                "micro-batch shape constant (pad) or build a new schedule"
            )

    def _received(self, kind: MetaStepType, stage: int, i: int) -> list[torch.Tensor] | None:
        """What this rank's receive of ``kind`` for (stage, micro-batch) brought; None without one."""
        step = self._recv_step.get((kind, stage, i))
        return None if step is None else self.take_recv(step)

    # -- compute (the handlers of LOAD, PF, PB and REDUCE_P) ------------------------------

    def _run_load(self, step: MetaStep) -> None:
        i = step.micro_index
        assert i is not None
        if self.data_iter is None:
            raise ValueError(
                f"rank {self.rank} must load micro-batch {i} (in-schedule loading) but step() got no "
                "data= iterator here; pass step(data=iter(loader)) on every rank that owns micro-batches"
            )
        try:
            batch = next(self.data_iter)
        except StopIteration:
            raise ValueError(
                f"rank {self.rank}: the data iterator ran out before micro-batch {i}; each step reads "
                "one micro-batch per owned micro (see PPRankOwnedSampler)"
            ) from None
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"in-schedule loading: a micro-batch must be a mapping of name -> tensor, got "
                f"{type(batch).__name__}"
            )
        needed = set(self.input_keys) | set(self.preprocess_keys) | {self.target_key}
        missing = sorted(needed - set(batch))
        if missing:
            raise KeyError(f"micro-batch {i} lacks {missing}; it has {sorted(batch)}")
        data = {k: batch[k].to(self.device) for k in sorted(needed)}
        self._check_same("the loaded data", i, list(data.values()))
        self._data[i] = data
        # Kept as a tensor where the loader's labels live: reading the count here would stall a
        # GPU rank once per micro-batch; the token normalisation reads the step's sum once.
        self.local_tokens = self.local_tokens + (batch[self.target_key] != self.ignore_index).sum()

    def _tower_args(self, i: int) -> tuple[Any, ...]:
        if i in self._data:
            return tuple(self._data[i][k] for k in self.preprocess_keys)
        if self.tower_chunks is None:
            raise ValueError(
                f"rank {self.rank} owns micro-batch {i} but step() got no preprocess_inputs= here; "
                "pass the whole batch's tower inputs on every rank that owns micro-batches"
            )
        return self.tower_chunks[i]

    def _run_tower_forward(self, step: MetaStep) -> None:
        i = step.micro_index
        assert i is not None
        args = self._tower_args(i)
        keep = self.training and self.tower_trainable and self.owner_backward
        with torch.set_grad_enabled(keep):
            outs = flatten_tower_output(self.preprocess(*args))
        self._check_same("the tower's output", i, outs)
        if keep:
            self._tower_graph[i] = outs
        self._feature_meta[i] = self._feature_metas(outs)
        self._tower_out[i] = tuple(t.detach().contiguous() for t in outs)
        self._tower_in[i] = tuple(a for a in args if isinstance(a, torch.Tensor))

    def _features_for(self, i: int) -> tuple[torch.Tensor, ...]:
        bufs = self._received(T.PREPROCESS_RECV, 0, i)
        if bufs is not None:
            n = self._n_features[i]
            outs, inputs = tuple(bufs[:n]), tuple(bufs[n:])
            metas = self._xfer_meta[MetaStep(i, T.PREPROCESS_RECV, 0, self._owner_stage(i))][:n]
            self._tower_in[i] = inputs
        else:
            outs, metas = self._tower_out[i], self._feature_meta[i]
        leaves = []
        got = self._feature_grad[i] = {}
        for k, (t, meta) in enumerate(zip(outs, metas, strict=True)):
            leaf = t.detach()
            if meta.requires_grad and self.training:
                leaf.requires_grad_(True)
                leaf.register_hook(_recorder(got, k))
            leaves.append(leaf)
        self._features[i] = tuple(leaves)
        return self._features[i]

    def _take_feature_grads(self, i: int) -> list[torch.Tensor | None]:
        """dL/dfeatures of micro-batch ``i`` (``None`` where no gradient reached a feature or none is due)."""
        leaves = self._features.pop(i, ())
        got = self._feature_grad.pop(i, {})
        return [got.get(k) if leaf.requires_grad else None for k, leaf in enumerate(leaves)]

    def _owner_stage(self, i: int) -> int:
        """The stage whose rank ran micro-batch ``i``'s tower (0 when it was this rank)."""
        return self._feature_source.get(i, 0)

    def _data_for(self, stage: int, i: int) -> dict[str, torch.Tensor]:
        bufs = self._received(T.DATA_RECV, stage, i)
        if bufs is not None:
            self._data.setdefault(i, {}).update(zip(self._keys_for(stage), bufs, strict=True))
        if i not in self._data:
            raise RuntimeError(f"stage {stage}: micro-batch {i} was neither loaded nor received here")
        return self._data[i]

    def forward_inputs(self, stage: PipelineStage, i: int) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        """Stage 0 runs ``module(*text, *features, **kwargs)``; other stages as in the base runner."""
        if not stage.is_first:
            return super().forward_inputs(stage, i)
        features = self._features_for(i)
        if self.loading:
            data = self._data_for(0, i)
            return (*(data[k] for k in self.input_keys), *features), {}
        if self.arg_mbs is None or self.kwarg_mbs is None:
            raise RuntimeError(f"stage 0 runs on rank {self.rank} but step() received no inputs here")
        return (*self.arg_mbs[i], *features), dict(self.kwarg_mbs[i])

    def target_of(self, stage: PipelineStage, i: int) -> Any:
        """With in-schedule loading, the last stage's target comes with the data ([Note: data keys])."""
        if self.loading:
            return self._data_for(stage.stage_index, i)[self.target_key]
        return super().target_of(stage, i)

    def _run_tower_backward(self, step: MetaStep) -> None:
        stage, i = step.stage_index, step.micro_index
        assert i is not None
        if self.owner_backward:
            outs = self._tower_graph.pop(i, None)
            grads = self._feature_grads(stage, i)
        else:
            with torch.enable_grad():
                outs = flatten_tower_output(self.preprocess(*self._tower_in[i]))
            grads = self._take_feature_grads(i)
        if outs is not None:
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if step == self._last_tower_backward:  # [Note: early tower reduction]
            self._pending_reduce = self._start_reduce()

    def _feature_grads(self, stage: int, i: int) -> list[torch.Tensor | None]:
        received = self._received(T.PREPROCESS_GRAD_RECV, stage, i)
        if received is None:
            return self._take_feature_grads(i)
        bufs = iter(received)
        return [next(bufs) if m.requires_grad else None for m in self._feature_meta[i]]

    def _reduce_tower(self) -> None:
        """``REDUCE_P``: finish the sum posted early, or run it whole ([Note: early tower reduction]).

        A collective: it runs even while the rank drains (its kind says so), so no peer waits in it.
        """
        pending, self._pending_reduce = self._pending_reduce, None
        if pending is None:
            pending = self._start_reduce()
        packs, works = pending
        try:
            for work in works:
                work.wait()
            if self.dp_group is not None:
                from hp_core import all_reduce

                for _, _, flat in packs:
                    all_reduce(flat, "sum", self.dp_group)
        except Exception as exc:
            raise CommError(str(exc)) from exc
        self._unpack_reduced(packs)

    def _start_reduce(
        self,
    ) -> tuple[list[tuple[list[int], list[torch.nn.Parameter], torch.Tensor]], list[Any]]:
        """Pack this step's tower-gradient contribution (one flat buffer per dtype) and post its sum."""
        from hp_core import all_reduce

        params = [p for p in self.preprocess.parameters() if p.requires_grad]
        self._contributed = set()  # a step whose reduction never finished leaves no stale id
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(index)
        packs, works = [], []
        for dtype, indices in by_dtype.items():
            parts, flags = [], []
            for index in indices:
                p, start = params[index], self.tower_grad_start[index]
                if self.draining or p.grad is None:
                    parts.append(torch.zeros(p.numel(), dtype=dtype, device=p.device))
                    flags.append(0.0)
                else:
                    delta = p.grad if start is None else p.grad - start
                    parts.append(delta.detach().reshape(-1))
                    flags.append(1.0)
            flat = torch.cat([*parts, torch.tensor(flags, dtype=dtype, device=parts[0].device)])
            packs.append((indices, params, flat))
            if all(flags):  # every sum has this rank's share: its flags need no read
                self._contributed.add(id(flat))
            try:
                works.append(all_reduce(flat, "sum", self.group, async_op=True))
            except Exception as exc:
                raise CommError(str(exc)) from exc
        return packs, works

    def _unpack_reduced(self, packs: list[tuple[list[int], list[torch.nn.Parameter], torch.Tensor]]) -> None:
        for indices, params, flat in packs:
            flag_at = flat.numel() - len(indices)
            if self.dp_size > 1:  # the dp average; the flags only need to be non-zero
                flat[:flag_at].div_(self.dp_size)
            # Reading the summed flags is a device-to-host copy, which waits for the reduction;
            # a rank that sent a gradient for every parameter knows every flag is non-zero.
            if id(flat) in self._contributed:
                self._contributed.discard(id(flat))
                flags = [1.0] * len(indices)
            else:
                flags = flat[flag_at:].tolist()
            offset = 0
            for k, index in enumerate(indices):
                p, start = params[index], self.tower_grad_start[index]
                total = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if flags[k] == 0:
                    continue
                new = total if start is None else start + total
                if p.grad is None:
                    p.grad = new.clone()
                else:
                    p.grad.copy_(new)

    # -- payloads (the Transfer of every MPipe transfer and of SEND_D / RECV_D) -------------

    def _payload(self, step: MetaStep) -> list[torch.Tensor]:
        i = step.micro_index
        assert i is not None and step.peer_stage is not None
        if self.draining:
            return [m.zeros(self.device) for m in self._xfer_meta[step]]
        if step.type is T.DATA_SEND:
            tensors = [self._data[i][k].contiguous() for k in self._keys_for(step.peer_stage)]
            metas = tuple(TensorMeta(tuple(t.shape), t.dtype, False) for t in tensors)
        elif step.type is T.PREPROCESS_SEND:
            outs = list(self._tower_out.pop(i))
            metas = self._feature_meta[i]
            tensors = outs
            if not self.owner_backward and self.training and self.tower_trainable:
                ins = [t.detach().contiguous() for t in self._tower_in.pop(i)]
                tensors = outs + ins
                metas = metas + tuple(TensorMeta(tuple(t.shape), t.dtype, False) for t in ins)
            self._n_features[i] = len(outs)
        else:  # PREPROCESS_GRAD_SEND: dL/dfeatures, zeros for features that got none
            leaves = self._features.get(i, ())
            grads = self._take_feature_grads(i)
            tensors = [
                (g if g is not None else torch.zeros_like(leaf)).contiguous()
                for leaf, g in zip(leaves, grads, strict=True)
                if leaf.requires_grad
            ]
            metas = tuple(TensorMeta(tuple(t.shape), t.dtype, False) for t in tensors)
        self._xfer_meta[step] = metas
        return tensors

    def _header(self, step: MetaStep) -> tuple[int, tuple[TensorMeta, ...]]:
        """The first step's header: the feature count (``SEND_P``) and the metadata of every tensor."""
        n = self._n_features.get(step.micro_index or 0, 0) if step.type is T.PREPROCESS_SEND else 0
        return n, self._xfer_meta[step]

    def _metas(self, step: MetaStep, header: Any) -> list[TensorMeta]:
        if header is not None:
            n, metas = header
            self._xfer_meta[step] = tuple(metas)
            if step.type is T.PREPROCESS_RECV and step.micro_index is not None:
                self._n_features[step.micro_index] = n
        return list(self._xfer_meta[step])


_TRANSFER = Transfer(payload=MPipeRunner._payload, header=MPipeRunner._header, metas=MPipeRunner._metas)
# By code: the kinds may not be registered yet when this module is imported.
# LOAD / SEND_D / RECV_D are built-in kinds; their MPipe meaning is given to MPipeRunner alone.
_DATA_HANDLERS: tuple[tuple[str, Any], ...] = (
    ("LOAD", MPipeRunner._run_load),
    ("SEND_D", _TRANSFER),
    ("RECV_D", _TRANSFER),
)
#: MPipe's kinds' handlers, attached by ``hp_pipeline._builtin_kinds.register_builtins``.
MPIPE_HANDLERS: tuple[tuple[str, Any], ...] = (
    ("PF", MPipeRunner._run_tower_forward),
    ("PB", MPipeRunner._run_tower_backward),
    ("REDUCE_P", lambda runner, _: runner._reduce_tower()),
    ("SEND_P", _TRANSFER),
    ("RECV_P", _TRANSFER),
    ("SEND_PG", _TRANSFER),
    ("RECV_PG", _TRANSFER),
)


def _recorder(store: dict[int, torch.Tensor], k: int) -> Any:
    """A tensor hook that keeps feature ``k``'s gradient ([Note: feature gradients])."""

    def hook(grad: torch.Tensor) -> None:
        store[k] = grad

    return hook

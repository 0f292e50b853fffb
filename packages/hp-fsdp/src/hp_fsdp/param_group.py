"""A unit's parameters as one communication group: unshard, reshard, reduce.

One :class:`FSDPParamGroup` exists per ``fully_shard`` call that manages at
least one parameter. It owns the unit's lifecycle between "sharded" (the
module holds DTensor shards) and "unsharded" (the module holds gathered
tensors), and it issues the unit's collectives through
:mod:`hp_fsdp.collectives`.
"""

from __future__ import annotations

from typing import Any

import torch
from hp_core import DeviceMesh, get_logger

from hp_fsdp.collectives import (
    AllGatherHandle,
    ReduceHandle,
    ReducePlan,
    all_gather_params,
    all_reduce_replicated,
    reduce_grads,
)
from hp_fsdp.param import FSDPParam
from hp_fsdp.policies import MixedPrecisionPolicy
from hp_fsdp.post_forward import PostForwardMesh, build_post_forward_mesh, resolve

__all__ = ["FSDPParamGroup"]

logger = get_logger("hp_fsdp")


class _Outcome:
    """Collects the per-parameter results of a unit's one or two reductions (sharded, replicated).

    ``None`` from a part means its gradients stay pending (HSDP without the
    all-reduce): the unit's outcome is then decided by a later reduction.
    """

    def __init__(self, group: FSDPParamGroup, pending: int) -> None:
        self.group = group
        self.pending = pending
        self.received: list[bool] | None = []

    def add(self, received: list[bool] | None) -> None:
        if received is None or self.received is None:
            self.received = None
        else:
            self.received += received
        self.pending -= 1
        if self.pending == 0 and self.received is not None:
            self.group._outcome(self.received)


class FSDPParamGroup:
    """The parameters of one unit and the knobs that govern their communication."""

    def __init__(
        self,
        params: list[FSDPParam],
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        *,
        reshard_after_forward: bool,
        comm_fusion: bool,
        full_group: Any,
    ) -> None:
        self.params = params
        self.sharded = [p for p in params if not p.replicate]
        self.replicated = [p for p in params if p.replicate]
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.comm_fusion = comm_fusion
        self.reshard_after_forward = reshard_after_forward  # free (all or part of) the gathered params
        # reshard_after_forward=N: the group of N ranks that keeps the unit between forward and
        # backward (None: reshard fully); see [Note: reshard to groups of N ranks]
        self.post_forward_mesh: PostForwardMesh | None = None
        self._held_post_forward: PostForwardMesh | None = None  # the group whose pieces are held now
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.reduce_op_type = "avg"
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.full_group = full_group  # the whole data-parallel group, for replicate params
        self.dp_size = mesh.size()
        self.is_unsharded = False
        self._gather: AllGatherHandle | None = None
        self._partial_outputs: list[torch.Tensor] | None = None  # HSDP: reduce-scattered, not all-reduced
        # per-iteration flags, reset by the root's final callback
        self.needs_post_backward = False
        # set by every pre-backward, cleared by every reduction: a reduction is due (see [Note: gradients
        # that arrive after the post-backward])
        self.ran_backward = False
        self._unchecked_backward = False  # backward ran since gradients last arrived on some rank
        # the last reduction found no gradient on any rank: see [Note: no silent gradient loss]
        self._lost = False
        self._verdict_task = -1  # the backward (autograd graph task) whose end will decide it
        # the unit's name under its root, the same on every rank once the ranks agreed ([Note: cross-rank
        # agreement]); its reductions carry a tag of it ([Note: one unit's reduction met another's])
        self.unit_name = ""
        # the unit's FQN under its root as FSDP2 names it ("" for the root), for profiler labels, and
        # the name debug logs show (set by hp_fsdp.state.agree; see [Note: profiler labels])
        self.fqn = ""
        self.log_name = "<unit>"
        self.forward_calls = 0  # post-backward markers placed this iteration (a module may run twice)
        self.post_backward_runs = 0

    # -- dtypes ---------------------------------------------------------------------------

    def param_dtype(self, p: FSDPParam) -> torch.dtype:
        """The gathered (compute) dtype of ``p``."""
        return self.mp_policy.param_dtype or p.orig_dtype

    def reduce_dtype(self, p: FSDPParam) -> torch.dtype:
        """The dtype gradients of ``p`` are reduced in (defaults to the compute dtype)."""
        return self.mp_policy.reduce_dtype or self.param_dtype(p)

    # -- reshard_after_forward --------------------------------------------------------------

    @property
    def shard_size(self) -> int:
        """Ranks along the shard dim (the mesh's last dim)."""
        return self.mesh.size(self.mesh.ndim - 1)

    def set_reshard_after_forward(self, value: bool | int) -> None:
        """Apply a validated ``reshard_after_forward`` (an int divides :attr:`shard_size`).

        Builds the post-forward group for an int strictly between 1 and the
        shard size (process-group creation: every rank calls this in the same
        order, as ``fully_shard`` and the setter are). Pieces already held
        stay valid for their own group until they are used or dropped.
        """
        reshard, size = resolve(value, self.shard_size)
        self.reshard_after_forward = reshard
        if size is None:
            self.post_forward_mesh = None
        elif self.post_forward_mesh is None or self.post_forward_mesh.size != size:
            self.post_forward_mesh = build_post_forward_mesh(self.mesh, size)

    def reshard_after_forward_pass(self) -> None:
        """The forward post-hook's reshard: none, to the post-forward group, or full.

        Only a forward with grad keeps pieces: they exist to serve the backward
        (see [Note: reshard to groups of N ranks]).
        """
        if not self.reshard_after_forward:
            return
        target = self.post_forward_mesh
        if target is None or not torch.is_grad_enabled() or not self.sharded:
            self.reshard()
            return
        self._land_gather()
        if not self.is_unsharded:
            return
        for p in self.sharded:
            p.keep_post_forward(target.size, target.rank)
        self._free_gathered()
        self._held_post_forward = target
        logger.debug("FSDP::reshard (%s): kept for groups of %d ranks", self.log_name, target.size)

    def _drop_post_forward(self) -> None:
        if self._held_post_forward is None:
            return
        for p in self.sharded:
            p.post_forward_data = None
        self._held_post_forward = None

    # -- unshard / reshard ------------------------------------------------------------------

    def unshard(self) -> None:
        """Start gathering (no-op when already gathered or in flight).

        From the pieces kept after forward when they are held (over their
        group; the pieces are copied into the gather's input and dropped),
        otherwise from the shards over the shard group.
        """
        if self.is_unsharded or self._gather is not None:
            return
        held, self._held_post_forward = self._held_post_forward, None
        self._gather = all_gather_params(
            self.params,
            self.shard_group,
            self.param_dtype,
            fused=self.comm_fusion,
            post_forward=held,
            fqn=self.fqn,
        )
        logger.debug("FSDP::all_gather (%s): issued", self.log_name)

    def wait_for_unshard(self) -> None:
        """Finish the gather and register the gathered parameters on the modules."""
        if self._gather is None:
            if not self.is_unsharded:
                self.unshard()
            if self._gather is None:
                return
        self._gather.finish()
        self._gather = None
        logger.debug("FSDP::all_gather (%s): waited", self.log_name)
        for p in self.params:
            p.to_unsharded_module_param()
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the gathered storage (and any pieces kept after forward) and register the shards again."""
        self._drop_post_forward()
        self._land_gather()
        self._free_gathered()

    def _land_gather(self) -> None:
        if self._gather is not None:
            self._gather.finish()  # an in-flight gather must land before its buffers are freed
            self._gather = None
            logger.debug("FSDP::all_gather (%s): waited", self.log_name)
            self.is_unsharded = True

    def _free_gathered(self) -> None:
        if not self.is_unsharded:
            return
        for p in self.params:
            p.to_sharded_module_param()
            p.free_unsharded()
        self.is_unsharded = False
        logger.debug("FSDP::reshard (%s)", self.log_name)

    # -- gradients --------------------------------------------------------------------------

    def reduce_plan(self) -> ReducePlan:
        """Map the reduce op type and divide factor onto collective ops.

        ``avg`` without a factor averages over the shard dim, then over the
        replicate dim: the mean over all data-parallel ranks. With a factor
        ``f`` the shard-dim reduction pre-multiplies by ``1/f`` and everything
        after sums, so the result is the sum divided by ``f``. ``sum`` sums.
        """
        factor = self.gradient_divide_factor
        if factor is not None:
            return ReducePlan("premul_sum", 1.0 / factor, "sum", None, "premul_sum", 1.0 / factor)
        if self.reduce_op_type == "sum":
            return ReducePlan("sum", None, "sum", None, "sum", None)
        return ReducePlan("avg", None, "avg", None, "avg", None)

    def _take_partial(self, outputs: list[torch.Tensor], all_reduce: bool) -> list[torch.Tensor] | None:
        """HSDP accumulation: add earlier un-all-reduced outputs, or stash these ones for later."""
        if not all_reduce:
            if self._partial_outputs is None:
                self._partial_outputs = outputs
            else:
                for acc, out in zip(self._partial_outputs, outputs, strict=True):
                    acc.add_(out)
            return None
        if self._partial_outputs is not None:
            for out, acc in zip(outputs, self._partial_outputs, strict=True):
                out.add_(acc)
            self._partial_outputs = None
        return outputs

    def reduce(self, *, force: bool = False) -> ReduceHandle | None:
        """Reduce this unit's accumulated gradients (returns the async reduce-scatter handle).

        Without ``force`` and with gradient sync off, the full gradients are
        kept (in the reduce dtype) to be reduced by a later synchronising step.
        Otherwise every parameter is reduced, whether this rank has gradients
        or not: whether a unit reduces is decided by what every rank sees alike
        (its hooks), never by the local gradients, which may differ across
        ranks ([Note: gradient flags] in :mod:`hp_fsdp.collectives`).
        """
        self._unchecked_backward = self._unchecked_backward or self.ran_backward
        self.ran_backward = False
        main_grad = self.mp_policy.apply_grad_on_fp32_main_grad
        if not (self.requires_gradient_sync or force):
            for p in self.params:
                p.stash_unsharded_grad(self.reduce_dtype(p))
            return None
        plan = self.reduce_plan()
        all_reduce = self.requires_all_reduce or force
        outcome = _Outcome(self, pending=2 if self.sharded and self.replicated else 1)
        handle = None
        if self.sharded:
            grads = [p.take_unsharded_grad() for p in self.sharded]
            handle = reduce_grads(
                self.sharded,
                grads,
                shard_group=self.shard_group,
                replicate_group=self.replicate_group,
                all_reduce=all_reduce,
                plan=plan,
                reduce_dtype_of=self.reduce_dtype,
                fused=self.comm_fusion,
                main_grad=main_grad,
                partial=self._take_partial,
                unit=self.unit_name,
                fqn=self.fqn,
            )
            handle.on_done = outcome.add
            logger.debug("FSDP::reduce_scatter (%s): issued", self.log_name)
        if self.replicated:
            grads = [p.take_unsharded_grad() for p in self.replicated]
            received = all_reduce_replicated(
                self.replicated,
                grads,
                group=self.full_group,
                plan=plan,
                reduce_dtype_of=self.reduce_dtype,
                fused=self.comm_fusion,
                main_grad=main_grad,
                unit=self.unit_name,
            )
            logger.debug("FSDP::all_reduce (%s): replicated parameters reduced", self.log_name)
            outcome.add(received)  # all-reduced over every data-parallel rank: assigned now
        return handle

    # [Note: gradients that arrive after the post-backward]
    # A unit's post-backward runs when the gradients of its inputs are
    # computed. Usually its parameters' gradients are complete then, but not
    # always: a module called twice whose first call's inputs need no
    # gradient (``blk(tanh(blk(x)))`` with ``x`` data: that call places no
    # marker, so the marker of the second call fires first), or a tied
    # embedding and head in one unit (``fully_shard([emb, head])``: autograd
    # accumulates the shared weight once, after the embedding's backward, long
    # after the head's marker). The reduction at the marker then finds no
    # gradient; the later backward through the unit runs its pre-backward
    # again (gathering again if it was resharded), which sets ``ran_backward``,
    # and the root's final callback reduces what arrived (as FSDP2's final
    # callback runs post-backward for units whose hooks fired early). Both
    # decisions, to reduce at the marker and again at the end, follow the
    # hooks, which fire alike on every rank; a rank never skips a reduction
    # because it holds no gradient, or the ranks' collectives would pair up
    # wrongly.

    def _outcome(self, received: list[bool]) -> None:
        """A reduction that assigns gradients is complete: ``received`` per parameter (any rank)."""
        if any(received):
            self._unchecked_backward = False
            self._lost = False
            return
        if not self._unchecked_backward:
            return
        if not any(p.sharded_param.requires_grad for p in self.params):
            self._unchecked_backward = False
            return
        self._lost = True
        task = torch._C._current_graph_task_id()
        if task == -1:
            self._raise_if_lost()  # outside backward (reduce_grad): nothing more can arrive
        elif task != self._verdict_task:
            # In backward, gradients may still arrive and be reduced by the root's final callback
            # ([Note: gradients that arrive after the post-backward]): decide once that has run.
            self._verdict_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._raise_if_lost)

    def _raise_if_lost(self) -> None:
        """[Note: no silent gradient loss].

        A unit whose backward ran (its outputs received a gradient) but whose
        trainable parameters got no gradient on any rank by the end of the
        backward has lost its gradients: its forward used tensors other than
        the parameters this unit reduces (for example a nested unit kept
        gathered copies across steps, or a schedule's weight step asked
        autograd for the sharded parameters instead of the gathered ones).
        Stepping would silently train nothing, so it is an error. It is
        decided from the gradient flags every rank receives with the
        reduction ([Note: gradient flags] in :mod:`hp_fsdp.collectives`), so
        every rank raises alike and no collective is added; in backward, after
        the root's final callback, which may still reduce gradients that
        arrived late and has reset every unit for the next step. A unit where
        only *some* parameters lack a gradient is left alone, as in FSDP2:
        unused parameters (an idle expert, a branch not taken) are legitimate.
        """
        self._verdict_task = -1
        if not self._lost:
            return
        self._lost = False
        self._unchecked_backward = False
        names = ", ".join(p.fqn for p in self.params if p.sharded_param.requires_grad)
        raise RuntimeError(
            f"hp_fsdp: the unit holding [{names}] ran backward since its last reduction, but none of "
            "these parameters received a gradient on any rank, so the optimizer would train nothing. The "
            "forward used tensors other than the unit's gathered parameters: do not keep references to "
            "parameters across unshard/reshard, and let the unit's own hooks (or the pipeline's "
            "UNSHARD / RESHARD steps) gather them. Parameters that are unused on purpose need "
            "requires_grad=False or ignored_params."
        )

    def has_pending_grads(self) -> bool:
        """Whether a reduction is due: a pre-backward ran since the last one.

        Decided from the hooks, alike on every rank, not from the local
        gradients (see [Note: gradients that arrive after the post-backward]).
        """
        return self.ran_backward

    def reset_iteration(self) -> None:
        """Clear the per-backward flags (called by the root's final callback)."""
        self.needs_post_backward = False
        self.forward_calls = 0
        self.post_backward_runs = 0

    @property
    def is_idle_sharded(self) -> bool:
        """Neither gathered nor gathering: :meth:`unshard` would issue a collective now."""
        return not self.is_unsharded and self._gather is None

    @property
    def post_backward_done(self) -> bool:
        """Whether every marker placed in forward this iteration has run its post-backward."""
        return self.post_backward_runs >= max(1, self.forward_calls)

    def __repr__(self) -> str:
        return f"FSDPParamGroup({[p.fqn for p in self.params]})"

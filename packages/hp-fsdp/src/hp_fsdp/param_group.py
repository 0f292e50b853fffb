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
from hp_core import DeviceMesh

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
        self.ran_backward = False  # since the last reduction: see [Note: no silent gradient loss]
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

    @property
    def is_sharded_post_forward(self) -> bool:
        """Whether the pieces kept after forward are held (the next gather runs over their group)."""
        return self._held_post_forward is not None

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
            self.params, self.shard_group, self.param_dtype, fused=self.comm_fusion, post_forward=held
        )

    def wait_for_unshard(self) -> None:
        """Finish the gather and register the gathered parameters on the modules."""
        if self._gather is None:
            if not self.is_unsharded:
                self.unshard()
            if self._gather is None:
                return
        self._gather.finish()
        self._gather = None
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
            self.is_unsharded = True

    def _free_gathered(self) -> None:
        if not self.is_unsharded:
            return
        for p in self.params:
            p.to_sharded_module_param()
            p.free_unsharded()
        self.is_unsharded = False

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
        """
        main_grad = self.mp_policy.apply_grad_on_fp32_main_grad
        if not (self.requires_gradient_sync or force):
            for p in self.params:
                p.stash_unsharded_grad(self.reduce_dtype(p))
            return None
        self._check_gradients_arrived()
        plan = self.reduce_plan()
        handle = None
        if self.sharded:
            grads = [p.take_unsharded_grad() for p in self.sharded]
            handle = reduce_grads(
                self.sharded,
                grads,
                shard_group=self.shard_group,
                replicate_group=self.replicate_group,
                all_reduce=self.requires_all_reduce or force,
                plan=plan,
                reduce_dtype_of=self.reduce_dtype,
                fused=self.comm_fusion,
                main_grad=main_grad,
                partial=self._take_partial,
            )
        if self.replicated:
            grads = [p.take_unsharded_grad() for p in self.replicated]
            all_reduce_replicated(
                self.replicated,
                grads,
                group=self.full_group,
                plan=plan,
                reduce_dtype_of=self.reduce_dtype,
                fused=self.comm_fusion,
                main_grad=main_grad,
            )
        return handle

    def _check_gradients_arrived(self) -> None:
        """Refuse to reduce a unit whose backward ran but reached none of its parameters.

        [Note: no silent gradient loss]
        A unit whose backward ran (its outputs received a gradient) but whose
        trainable parameters all lack one has lost its gradients: its forward
        used tensors other than the parameters this unit reduces (for example
        a nested unit kept gathered copies across steps, or a schedule's
        weight step asked autograd for the sharded parameters instead of the
        gathered ones). Stepping would silently train nothing, so it is an
        error, found with the flag set by the unit's pre-backward and a look
        at the gradients the reduction reads anyway: no communication. A
        unit where only *some* parameters lack a gradient is left alone, as
        in FSDP2: unused parameters (an idle expert, a branch not taken) are
        legitimate.
        """
        ran, self.ran_backward = self.ran_backward, False
        if not ran:
            return
        trainable = [p for p in self.params if p.sharded_param.requires_grad]
        if not trainable or any(p.has_unsharded_grad() for p in trainable):
            return
        names = ", ".join(p.fqn for p in trainable)
        raise RuntimeError(
            f"hp_fsdp: the unit holding [{names}] ran backward since its last reduction, but none of "
            "these parameters received a gradient, so the optimizer would train nothing. The forward "
            "used tensors other than the unit's gathered parameters: do not keep references to "
            "parameters across unshard/reshard, and let the unit's own hooks (or the pipeline's "
            "UNSHARD / RESHARD steps) gather them. Parameters that are unused on purpose need "
            "requires_grad=False or ignored_params."
        )

    def has_pending_grads(self) -> bool:
        """Whether gathered params hold gradients not reduced yet."""
        return any(
            (p.unsharded_param is not None and p.unsharded_param.grad is not None) for p in self.params
        )

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

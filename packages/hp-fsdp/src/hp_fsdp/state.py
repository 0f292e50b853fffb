"""Per-unit state and the hooks that drive it through forward and backward.

Each unit gathers in its forward pre-hook, reshards in its post-hook, gathers
again at its pre-backward (a multi-grad hook on its outputs) and reduces at
its post-backward (an identity Function on its inputs); the root, the unit
whose forward runs first, queues a final callback on the autograd engine.
The whole sequence is [Note: the hook sequence] in the package README; the
notes here explain the choices next to the code that makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hp_core import get_logger, get_platform
from torch import nn
from torch.utils import _pytree as pytree

from hp_fsdp._profiling import label, labelled, of_self
from hp_fsdp.agreement import check_agreement
from hp_fsdp.collectives import ReduceHandle
from hp_fsdp.param_group import FSDPParamGroup
from hp_fsdp.policies import MixedPrecisionPolicy

__all__ = [
    "FSDPState",
    "RootContext",
    "agree",
    "eager",
    "get_state",
    "prefetch_states",
    "states_below",
]

logger = get_logger("hp_fsdp")

STATE_ATTR = "_hp_fsdp_state"


def get_state(module: nn.Module) -> FSDPState | None:
    """The unit state attached to ``module`` by ``fully_shard``, if any."""
    return module.__dict__.get(STATE_ATTR)


def states_below(modules: Sequence[nn.Module]) -> list[FSDPState]:
    """The unit states of the subtrees of ``modules`` (the first module's own first), each once."""
    states: list[FSDPState] = []
    seen: set[int] = set()
    for module in modules:
        for sub in module.modules():
            state = get_state(sub)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states


def _unit_paths(roots: Sequence[nn.Module], states: Sequence[FSDPState]) -> dict[int, list[str]]:
    """Per unit (by ``id``), the paths of its modules under ``roots``, in ``named_modules`` order.

    The root's own path is ``""``; with several roots (a list unit at the
    top) each path starts with ``[i]``. A unit not reached under ``roots``
    gets ``<ClassName>``.
    """
    paths: dict[int, list[str]] = {}
    wanted = set(map(id, states))
    for index, root in enumerate(roots):
        base = "" if len(roots) == 1 else f"[{index}]"
        for path, module in root.named_modules():
            state = get_state(module)
            if state is not None and id(state) in wanted:
                paths.setdefault(id(state), []).append(f"{base}.{path}" if base and path else (base or path))
    for state in states:
        paths.setdefault(id(state), [f"<{type(state.modules[0]).__name__}>"])
    return paths


def agree(roots: Sequence[nn.Module], states: Sequence[FSDPState]) -> None:
    """Compare the units of ``states`` not compared yet with the other ranks, and name them.

    See [Note: fully_shard agreement] in :mod:`hp_fsdp.agreement`. Every unit
    under ``roots`` gets its FSDP2-style ``fqn`` for profiler labels and logs
    (the paths of its modules under the root, ``""`` for the root itself, as
    FSDP2's ``_init_fqns``); a unit compared now also gets ``unit_name``, its
    first module's path (``'<root>'`` for the root), the same on every rank:
    it names the unit in errors and tags its reductions.
    """
    paths = _unit_paths(roots, states)
    for state in states:
        state.set_fqn(", ".join(paths[id(state)]))
    pending = [s for s in states if not s.agreed]
    if not pending:
        return
    names = {key: value[0] or "<root>" for key, value in paths.items()}
    check_agreement(names, pending)
    for state in pending:
        if state.group is not None:  # a name every rank shares: it tags the unit's reductions
            state.group.unit_name = names[id(state)]


def _streams_overlap() -> bool:
    """Whether an implicit backward prefetch can pay for its memory (see [Note: implicit prefetch]).

    [Note: implicit prefetch]
    On an accelerator the next unit's all-gather runs on the communication
    stream while this unit's backward computes, so gathering one unit ahead
    hides the communication. On a CPU platform there is no separate engine to
    overlap with: the gather competes with the backward for the same cores,
    and gathering ahead only raises peak memory by one unit's buffer at the
    start of backward, where activations peak (measured in
    ``benchmarks/fsdp_step.py``: with it hp used 3-16% more than torch's
    fully_shard, without it the same). So on CPU only the explicit
    ``set_modules_to_backward_prefetch`` lists prefetch.
    """
    try:
        return get_platform().device_type != "cpu"
    except Exception:  # no platform resolvable: be conservative
        return False


# [Note: implicit forward prefetch]
# On an accelerator the CPU runs ahead of the device, so the all-gather a unit
# issues in its pre-forward already overlaps the previous unit's kernels. On a
# CPU platform nothing runs ahead: without prefetch every unit's forward waits
# for its own gather from start to end. So on CPU each unit, once its own
# parameters are gathered, starts the gather of the unit that ran after it in
# the last training forward, and the communication proceeds on the backend's
# threads while this unit computes (``benchmarks/fsdp_step.py`` at 2 ranks:
# step 119 ms against 137 ms without, torch's fully_shard 138 ms). It does not
# raise the peak: two units are gathered only during forward, while the
# activations are still below their peak at the start of backward, and the
# last unit prefetches nothing. A prefetch is only a hint: if the predicted
# unit does not run in this forward (the order changed), the root resharding
# it at the end of the forward keeps the next optimizer step from leaving it
# with stale gathered values. An explicit ``set_modules_to_forward_prefetch``
# list replaces it for that unit.


# [Note: when a reduction is waited for]
# A reduce-scatter's send buffer holds the unit's whole gradient (padded) and
# must live until the collective completes. On an accelerator the reduction
# runs beside the next unit's backward, so it is finished one unit later (at
# most one in flight). On a CPU platform the collective's threads compete
# with that backward for the same cores, and keeping the send buffer alive
# through the next unit's backward raised peak memory by exactly one block
# (measured in ``benchmarks/fsdp_step.py`` at 4 ranks: +0.76 MiB = one block's
# fp32 parameters, ratio 1.056 to torch's fully_shard). So on CPU each unit
# waits for its own reduction before its post-backward returns, and the send
# buffer is freed before the next unit's backward allocates.


# -- explicit prefetch lists ---------------------------------------------------------------


def prefetch_states(what: str, modules: Any, owner: FSDPState) -> list[FSDPState]:
    """The units named in a ``set_modules_to_*_prefetch`` list; all checked before any is recorded.

    Whether they share ``owner``'s root can only be told once the root is
    known: here when the tree already ran, otherwise at the root's first
    forward (:func:`check_prefetch_under_root`).
    """
    if isinstance(modules, nn.Module) or not isinstance(modules, (list, tuple)):
        raise TypeError(
            f"{what}: modules is a {type(modules).__name__}, not a list; pass a list of fully_shard-ed "
            f"modules, e.g. [{type(modules).__name__ if isinstance(modules, nn.Module) else 'block'}]."
        )
    states: list[FSDPState] = []
    for index, module in enumerate(modules):
        state = get_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(
                f"{what}: modules[{index}] ({type(module).__name__}) was not passed to fully_shard; only "
                "fully_shard-ed modules can be prefetched. Call fully_shard on it first."
            )
        states.append(state)
    context = owner.context
    if context is not None:
        for index, state in enumerate(states):
            if state not in context.states:
                raise ValueError(
                    f"{what}: modules[{index}] ({type(state.modules[0]).__name__}) is a unit of another root "
                    f"than {type(owner.modules[0]).__name__}, so its gather would never be used there; "
                    "prefetch only units that run under the same root module."
                )
    return states


def check_prefetch_under_root(states: Sequence[FSDPState]) -> None:
    """Every explicit prefetch target of ``states`` (one root's units) is one of them."""
    members = set(map(id, states))
    for state in states:
        for what, targets in (
            ("set_modules_to_forward_prefetch", state.forward_prefetch),
            ("set_modules_to_backward_prefetch", state.backward_prefetch),
        ):
            for target in targets or ():
                if id(target) not in members:
                    raise ValueError(
                        f"{what}: {type(state.modules[0]).__name__} prefetches "
                        f"{type(target.modules[0]).__name__}, a unit outside the root "
                        f"{type(states[0].modules[0]).__name__} it runs under, so the gather would never be "
                        "used; prefetch only units under the same root module."
                    )


class RootContext:
    """What the units under one root share during an iteration."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states
        self.forward_order: list[FSDPState] = []
        self.pending: list[ReduceHandle] = []
        self.callback_queued = False
        self.implicit_prefetch = _streams_overlap()
        self.overlap_reduce = _streams_overlap()  # see [Note: when a reduction is waited for]
        # see [Note: implicit forward prefetch]
        self.implicit_forward_prefetch = not _streams_overlap()
        self.prefetch_order: list[FSDPState] = []  # the forward order of the last training forward
        self.prefetched: list[FSDPState] = []  # implicitly prefetched, not yet run in this forward

    def next_in_forward(self, state: FSDPState) -> FSDPState | None:
        """The unit that ran after ``state`` in the last training forward, if any."""
        order = self.prefetch_order
        for index, candidate in enumerate(order):
            if candidate is state:
                return order[index + 1] if index + 1 < len(order) else None
        return None

    def drop_unused_prefetches(self) -> None:
        """Reshard units prefetched for this forward that did not run in it (their shards may change)."""
        unused, self.prefetched = self.prefetched, []
        for state in unused:
            if state.group is not None:
                state.group.reshard()

    def finish_pending(self) -> None:
        """Wait for every reduction in flight and assign its gradients."""
        pending, self.pending = self.pending, []
        for handle in pending:
            handle.finish()


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's forward inputs whose backward marks the unit's backward as done."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *tensors: torch.Tensor) -> Any:
        ctx.state = state
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.state.post_backward()
        return (None, *grads)


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread.

    [Note: forward in backward]
    Activation checkpointing runs a unit's forward again inside backward to
    recompute what it did not save. That run is not an iteration's forward:
    the unit's pre-backward has already gathered its parameters, and its
    backward follows at once. So it only waits for the gather and leaves the
    forward bookkeeping alone: it does not count as a run of the module, does
    not enter the forward order, prefetches nothing, places no second
    post-backward marker (non-reentrant checkpointing keeps the first
    forward's; the recomputed graph's marker would never run, so the unit
    would wait for it and reduce only in the root's final callback) and does
    not reshard after it (the backward about to run uses those parameters;
    with torch's default early stop the post-hook does not even run).
    Reentrant checkpointing runs the first forward without grad, so no marker
    exists yet and the re-run places it.
    """
    return torch._C._current_graph_task_id() != -1


def eager(fn: Any) -> Any:
    """Run a hook eagerly, outside any compiled graph ([Note: hooks under torch.compile]).

    [Note: hooks under torch.compile]
    The hooks gather and free storage, issue asynchronous collectives, queue
    autograd-engine callbacks and keep per-step flags: none of it belongs in
    a graph, and tracing it would bake per-step state into guards (and c10d
    calls with ``async_op=True`` inside an AOT graph carry no data
    dependency on their wait, which miscompiles). As FSDP2 does, each hook
    is excluded from tracing as a whole (``recursive=True``: nothing it
    calls is traced either). Under ``block.compile()`` the hooks run around
    the block's graph, which sees plain gathered parameters; under
    ``torch.compile(model)`` dynamo splits the graph at each unit's hooks.
    Disabling once per hook function (not per call) keeps the number of
    graph breaks to those splits.
    """
    return torch._dynamo.disable(fn, recursive=True)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, tree)


class FSDPState:
    """The hooks and flags of one unit; ``group`` is None for a unit without parameters."""

    def __init__(
        self, modules: Sequence[nn.Module], group: FSDPParamGroup | None, mp_policy: MixedPrecisionPolicy
    ) -> None:
        self.modules = tuple(modules)
        self.group = group
        self.mp_policy = mp_policy
        self.is_root: bool | None = None
        self.context: RootContext | None = None
        self.forward_prefetch: list[FSDPState] | None = None  # None: implicit on CPU
        self.backward_prefetch: list[FSDPState] | None = None
        # what the user asked for: None follows FSDP2 (True for every unit but the root); an int N
        # reshards to groups of N ranks ([Note: reshard to groups of N ranks] in post_forward.py)
        self.reshard_after_forward: bool | int | None = None
        self.agreed = False  # compared with the other ranks: see [Note: fully_shard agreement]
        # the FQN under the root, FSDP2's format ("" for the root), and the name logs show: set by agree
        self.fqn = ""
        self.log_name = f"<{type(self.modules[0]).__name__}>"
        self._ran: set[int] = set()
        self.handles: list[Any] = []
        for module in self.modules:
            module.__dict__[STATE_ATTR] = self
            self.handles.append(
                module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(self._post_forward, prepend=False))

    # -- lazy init ----------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """Make this unit the root of every unit below it ([Note: the hook sequence] in the README)."""
        states = states_below(self.modules)
        # Before anything is recorded or gathered, so a rejected tree is left as it was; the
        # prefetch check reads facts the agreement compared, so every rank decides alike.
        agree(self.modules, states)
        check_prefetch_under_root(states)
        context = RootContext(states)
        for state in states:
            state.is_root = state is self
            state.context = context
        for state in states:
            state.apply_reshard_after_forward()

    def set_fqn(self, fqn: str) -> None:
        """Name the unit in profiler labels and debug logs (``""``: the root, logged as ``<root>``)."""
        self.fqn = fqn
        self.log_name = fqn or "<root>"
        if self.group is not None:
            self.group.fqn, self.group.log_name = self.fqn, self.log_name

    def set_reshard_after_forward(self, value: bool | int | None) -> None:
        """Record the requested behaviour (None: FSDP2's default; validated already) and apply it."""
        self.reshard_after_forward = value
        self.apply_reshard_after_forward()

    def apply_reshard_after_forward(self) -> None:
        """The effective value: as requested, else True except on the root (its backward follows at once)."""
        if self.group is None:
            return
        value = self.reshard_after_forward
        self.group.set_reshard_after_forward((not self.is_root) if value is None else value)

    def _root_context(self) -> RootContext:
        if self.is_root is None:
            self._lazy_init()
        assert self.context is not None
        return self.context

    # -- forward ------------------------------------------------------------------------------

    @eager
    @labelled("FSDP::pre_forward", of_self("fqn"))
    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        context = self._root_context()
        logger.debug("FSDP::pre_forward (%s)", self.log_name)
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if _in_backward():
            return self._pre_forward_in_backward(args, kwargs)
        if self.is_root and torch.is_grad_enabled():
            with label("FSDP::root_pre_forward"):
                if context.forward_order:
                    context.prefetch_order = context.forward_order
                context.forward_order = []
        first = not self._ran
        self._ran.add(id(module))
        if first and context.prefetched and self in context.prefetched:
            context.prefetched.remove(self)
        if self.group is not None:
            self.group.wait_for_unshard()
            for p in self.group.params:  # [Note: requires_grad follows the user] in param.py
                p.sync_requires_grad()
        if first:
            self._forward_prefetch(context)
        if torch.is_grad_enabled():
            if first and self not in context.forward_order:
                context.forward_order.append(self)
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _pre_forward_in_backward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A forward re-run during backward (activation checkpointing): see [Note: forward in backward]."""
        if self.group is None:
            return args, kwargs
        self.group.wait_for_unshard()
        if self.group.forward_calls == 0 and torch.is_grad_enabled():
            # reentrant checkpointing: the first forward ran without grad and placed no marker, so
            # this run's marker is the one the inner backward reaches
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _forward_prefetch(self, context: RootContext) -> None:
        """Start the next units' gathers (explicit list, else [Note: implicit forward prefetch])."""
        if self.forward_prefetch is not None:
            for target in self.forward_prefetch:
                if target.group is not None:
                    target.group.unshard()
            return
        if not context.implicit_forward_prefetch:
            return
        following = context.next_in_forward(self)
        if following is None or following.group is None:
            return
        if following.group.is_idle_sharded:
            following.group.unshard()
            context.prefetched.append(following)

    def _register_post_backward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions or self.group is None:
            return args, kwargs
        self.group.forward_calls += 1  # one marker per call: see [Note: a unit run twice in one forward]
        wrapped = _PostBackward.apply(self, *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped, strict=True):
            flat[i] = tensor
        return pytree.tree_unflatten(flat, spec)

    @eager
    @labelled("FSDP::post_forward", of_self("fqn"))
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        logger.debug("FSDP::post_forward (%s)", self.log_name)
        if _in_backward():  # see [Note: forward in backward]: keep the parameters for this backward
            if self.mp_policy.output_dtype is not None:
                output = _cast_floats(output, self.mp_policy.output_dtype)
            return output
        if len(self._ran) >= len(self.modules):
            self._ran.clear()
            if self.group is not None:
                self.group.reshard_after_forward_pass()
            if self.is_root and self.context is not None and self.context.prefetched:
                self.context.drop_unused_prefetches()
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if torch.is_grad_enabled():
            tensors = [
                x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor) and x.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        return output

    # -- backward -----------------------------------------------------------------------------

    @eager
    @labelled("FSDP::pre_backward", of_self("fqn"))
    def _pre_backward(self, grad: Any) -> None:
        context = self._root_context()
        logger.debug("FSDP::pre_backward (%s)", self.log_name)
        if not context.callback_queued:
            context.callback_queued = True
            root = next(s for s in context.states if s.is_root)
            torch.autograd.Variable._execution_engine.queue_callback(root._final_callback)
        if self.group is None:
            return
        self.group.needs_post_backward = True
        self.group.ran_backward = True
        self.group.wait_for_unshard()
        for target in self._backward_targets(context):
            if target.group is not None and not target.group.post_backward_done:
                target.group.unshard()

    def _backward_targets(self, context: RootContext) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        if not context.implicit_prefetch:
            return []
        order = context.forward_order
        if self in order:
            index = order.index(self)
            if index > 0:
                return [order[index - 1]]
        return []

    @eager
    @labelled("FSDP::post_backward", of_self("fqn"))
    def post_backward(self, *, final: bool = False) -> None:
        """Reduce this unit's gradients and reshard (once per forward call of the unit).

        [Note: a unit run twice in one forward]
        When a unit's module runs k times in one forward (weights reused by
        calling the block again), forward places k input markers, and backward
        reaches the last call's marker first. The gathered parameters are one
        leaf each, so autograd sums the contributions of all k calls before it
        accumulates ``.grad`` once, after the first call's backward. So the
        first k-1 markers only count (the parameters stay gathered for the
        earlier calls' backward) and the k-th reduces and reshards: one
        all-gather and one reduce-scatter per unit, as for a single call. A
        call whose inputs need no gradient places no marker; the root's final
        callback then reduces what is left.
        """
        group = self.group
        if group is None or (group.post_backward_done and not final):
            return
        logger.debug("FSDP::post_backward (%s)", self.log_name)
        group.post_backward_runs += 1
        if not final and group.post_backward_runs < group.forward_calls:
            return  # earlier calls of the module still run backward on the gathered parameters
        context = self._root_context()
        context.finish_pending()  # bound memory: at most one unit's reduction in flight
        handle = group.reduce()
        if handle is not None:
            if context.overlap_reduce or final:
                context.pending.append(handle)
            else:
                handle.finish()
        if group.reshard_after_backward:
            group.reshard()

    @eager
    @labelled("FSDP::root_post_backward_callback")
    def _final_callback(self) -> None:
        context = self._root_context()
        logger.debug("FSDP::root_post_backward_callback (%s)", self.log_name)
        for state in reversed(context.states):
            group = state.group
            if group is None:
                continue
            if group.has_pending_grads() or (group.needs_post_backward and group.post_backward_runs == 0):
                state.post_backward(final=True)
        context.finish_pending()
        for state in context.states:
            group = state.group
            if group is None:
                continue
            if group.reshard_after_backward:
                group.reshard()
            group.reset_iteration()
        context.callback_queued = False

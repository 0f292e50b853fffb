"""The built-in step kinds, declared through the same registry as any plug-in.

See [Note: step-kind registry] in :mod:`hp_pipeline.kinds` for what each field
means and [Note: dependency model] in :mod:`hp_pipeline._deps` for the rules
below. :func:`register_builtins`, called once by ``hp_pipeline/__init__``,
registers them with MPipe's and the activation swap's kinds and attaches the
executor handlers (:mod:`hp_pipeline.executor`, :mod:`hp_pipeline.mpipe.runner`).
The declarations themselves need no torch (but for the one context below,
imported when it runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from fractions import Fraction
from typing import Any

from hp_pipeline._deps import Edge, OrderView
from hp_pipeline.ir import MetaStep
from hp_pipeline.kinds import MetaStepType, StepKind, register_step_handler, register_step_kind

__all__ = ["BUILTIN_KINDS", "register_builtins"]


# -- dependency rules ------------------------------------------------------------------


def _forward_edges(view: OrderView, step: MetaStep) -> list[Edge]:
    """``F(s, i)`` needs ``F(s-1, i)``, and the loaded micro-batch when it receives the data."""
    T = MetaStepType
    i, s = step.micro_index, step.stage_index
    edges = []
    if s > 0:
        edges.append(
            Edge(MetaStep(i, T.FWD, s - 1), step, MetaStep(i, T.FWD_SEND, s - 1), MetaStep(i, T.FWD_RECV, s))
        )
    loader = view.loader_of.get(i) if i is not None else None
    if loader is not None and loader != s:
        recv = MetaStep(i, T.DATA_RECV, s, loader)
        if recv in view.position:
            edges.append(
                Edge(MetaStep(i, T.DATA_LOAD, loader), step, MetaStep(i, T.DATA_SEND, loader, s), recv)
            )
    return edges


def loaded_here(view: OrderView, step: MetaStep) -> list[MetaStep]:
    """The ``LOAD`` of the step's micro-batch when its own stage loads it (``F``; MPipe's ``PF``)."""
    return view.own_load(step)


def _backward_edges(view: OrderView, step: MetaStep) -> list[Edge]:
    """``B``/``I`` of stage ``s`` need the input-gradient backward of ``s+1`` (the output gradient)."""
    i, s = step.micro_index, step.stage_index
    if i is None or s + 1 >= view.num_stages:
        return []
    T = MetaStepType
    return [
        Edge(view.backward_input(s + 1, i), step, MetaStep(i, T.BWD_SEND, s + 1), MetaStep(i, T.BWD_RECV, s))
    ]


def _same_forward(view: OrderView, step: MetaStep) -> list[MetaStep]:
    return [MetaStep(step.micro_index, MetaStepType.FWD, step.stage_index)]


def _same_input_grad(view: OrderView, step: MetaStep) -> list[MetaStep]:
    assert step.micro_index is not None
    return [view.backward_input(step.stage_index, step.micro_index)]


def _same_load(view: OrderView, step: MetaStep) -> list[MetaStep]:
    return [MetaStep(step.micro_index, MetaStepType.DATA_LOAD, step.stage_index)]


def _weight_needs(view: OrderView, step: MetaStep) -> list[MetaStep]:
    return [MetaStep(step.micro_index, MetaStepType.BWD_INPUT, step.stage_index)]


def _forward_consumer(view: OrderView, step: MetaStep) -> MetaStep:
    return _same_forward(view, step)[0]


def _input_grad_consumer(view: OrderView, step: MetaStep) -> MetaStep:
    return _same_input_grad(view, step)[0]


# [Note: compiled split backward]
# ``I`` runs a stage's backward with ``retain_graph=True`` (``W`` walks the graph
# again, [Note: split backward] in :mod:`hp_pipeline.stage`). AOTAutograd's
# *donated buffers* (``torch._functorch.config.donated_buffer``, on by default)
# let a compiled graph's backward reuse the memory of tensors it saved, which a
# retained graph still needs. Torch decides it per graph: the forward's compile
# lists the buffers it may donate, and the first backward through the graph
# compiles it, donating when that backward frees the graph. A stage that runs a
# full ``B`` first and an ``I`` later through the same compiled graph (DualPipeV
# does, a zero-bubble schedule that only splits does not) would run a donating
# backward on a retained graph, which torch refuses ("compiled with non-empty
# donated buffers which requires ... retain_graph=False").
#
# So ``I`` declares a context around every ``F``, ``B``, ``I`` and ``W`` of a
# runner whose list holds ``I`` steps, all run with ``donated_buffer=False``: a
# stage's modules compile (and recompile) inside its forward, so their graphs
# list no donated buffers and no backward of theirs donates; and torch's runtime
# check, which reads the switch again at each retained backward, stands aside for
# the ``I``. The switch is scoped (``config.patch``): other code in the process,
# and schedules without split backward (1F1B, GPipe, ...), keep torch's default
# and its optimisation.
#
# [Note: compile caches under a split backward]
# Switching donation off for a graph is not enough while torch's caches share
# compiled code: inductor's FX graph cache keys a backward graph by its code and
# configuration but not by which of its inputs it may donate (torch 2.13), so
# the first backward of a graph compiled with donation off is served a donating
# kernel cached by any full backward of the same graph: a 1F1B or GPipe run, a
# plain training script, an earlier process sharing ``TORCHINDUCTOR_CACHE_DIR``,
# or the first stage of this very pipeline (its ``I`` computes nothing, so its
# ``W`` is the graph's first backward). Such a kernel writes into tensors the
# graph saved (``tanh``'s output, say); the ``I`` runs it on the retained graph
# and the ``W``, running it again, reads the overwritten values: wrong weight
# gradients and no error, since the check above stands aside. An AOTAutograd
# cache entry saved from such a compile points at the donating kernel too. So
# the same context also appends :data:`_CACHE_KEY_TAG` to
# ``torch.compiler.config.cache_key_tag``: what these steps compile (the
# forward, and the backward compiled lazily in whichever of ``B``, ``I`` or
# ``W`` reaches the graph first) is looked up and stored apart from what
# donating compiles cache, and is still cached across runs. What it cannot
# cover: a graph compiled *and* backpropagated by a full backward before the
# schedule's first step (say, a warm-up outside the schedule) keeps its donating
# backward, and inside ``I`` torch's check would not stop it: compile the
# stages' modules inside the schedule (their first call is the schedule's), or
# turn the switch off around such a warm-up too.

#: appended to torch's compile-cache key tag by the context of [Note: compile caches under a split backward]
_CACHE_KEY_TAG = "|hp_pipeline:no_donated_buffers"


def _without_donated_buffers(runner: Any, step: MetaStep) -> Any:
    """Around every ``F``, ``B``, ``I`` and ``W`` of a runner that runs ``I`` steps.

    See [Note: compiled split backward] and [Note: compile caches under a split backward].
    """
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "donated_buffer"):  # a torch without donated buffers
        return None
    return _no_donation_scope(functorch_config)


@contextmanager
def _no_donation_scope(functorch_config: Any) -> Iterator[None]:
    import torch.compiler.config

    compiler_config: Any = torch.compiler.config  # a ConfigModule: patch() is made at import
    with ExitStack() as stack:
        stack.enter_context(functorch_config.patch(donated_buffer=False))
        tag = getattr(compiler_config, "cache_key_tag", None)
        if isinstance(tag, str) and not tag.endswith(_CACHE_KEY_TAG):
            stack.enter_context(compiler_config.patch(cache_key_tag=tag + _CACHE_KEY_TAG))
        yield


def _overlap_cost(costs: Any) -> Fraction:
    if costs.overlap_f_b is None:
        raise ValueError(
            "StepCosts.overlap_f_b is None: an OVERLAP_F_B then costs its halves, timed one "
            "after the other; set overlap_f_b to time the pair as one step"
        )
    return Fraction(costs.overlap_f_b)


# -- the kinds, in the order the enum listed them ------------------------------------------

_PIPELINE = "pipeline"
_BACKWARD: dict[str, Any] = {
    "input_grad": True,
    "training_only": True,
    "compute": True,
    "edges": _backward_edges,
}

BUILTIN_KINDS = (
    StepKind(
        "FWD",
        "F",
        "forward of one micro-batch through one stage",
        _PIPELINE,
        compute=True,
        edges=_forward_edges,
        needs=loaded_here,
        cost="forward",
        colour="#4e79a7",
        resident=+1,  # its saved activations appear on the device
    ),
    StepKind(
        "BWD",
        "B",
        "full backward (input and weight gradients)",
        _PIPELINE,
        needs=_same_forward,
        cost="backward",
        colour="#59a14f",
        resident=-1,  # and a full backward frees them
        **_BACKWARD,
    ),
    # [Note: compiled split backward]
    StepKind(
        "BWD_INPUT",
        "I",
        "backward for the input gradient only",
        _PIPELINE,
        needs=_same_forward,
        cost="backward_input",
        colour="#f28e2b",
        wraps=("F", "B", "I", "W"),
        around=_without_donated_buffers,
        **_BACKWARD,
    ),
    StepKind(
        "BWD_WEIGHT",
        "W",
        "backward for the weight gradient only",
        _PIPELINE,
        compute=True,
        training_only=True,
        needs=_weight_needs,
        cost="backward_weight",
        colour="#76b7b2",
        resident=-1,  # after a split backward, W frees them (I keeps them for W)
    ),
    StepKind(
        "FWD_SEND",
        "SEND_F",
        "send the stage's output activation downstream",
        _PIPELINE,
        transfer="send",
        matching="RECV_F",
        peer_offset=+1,
        needs=_same_forward,
    ),
    StepKind(
        "FWD_RECV",
        "RECV_F",
        "receive the stage's input activation",
        _PIPELINE,
        transfer="recv",
        matching="SEND_F",
        peer_offset=-1,
        consumer=_forward_consumer,
    ),
    StepKind(
        "BWD_SEND",
        "SEND_B",
        "send the gradient of the stage's input upstream",
        _PIPELINE,
        transfer="send",
        matching="RECV_B",
        peer_offset=-1,
        needs=_same_input_grad,
        training_only=True,
        carries_backward=True,
    ),
    StepKind(
        "BWD_RECV",
        "RECV_B",
        "receive the gradient of the stage's output",
        _PIPELINE,
        transfer="recv",
        matching="SEND_B",
        peer_offset=+1,
        consumer=_input_grad_consumer,
        training_only=True,
    ),
    StepKind(
        "DATA_LOAD",
        "LOAD",
        "take the micro-batch from the data loader",
        "data",
        cost="data_load",
        colour="#bab0ac",
    ),
    StepKind(
        "DATA_SEND",
        "SEND_D",
        "send the micro-batch (inputs, targets) to a stage",
        "data",
        transfer="send",
        matching="RECV_D",
        needs=_same_load,
    ),
    StepKind(
        "DATA_RECV",
        "RECV_D",
        "receive the micro-batch from the loading stage",
        "data",
        transfer="recv",
        matching="SEND_D",
        consumer=_forward_consumer,
    ),
    StepKind(
        "UNSHARD",
        "UNSHARD",
        "FSDP: all-gather the stage's parameters",
        "fsdp",
        whole_stage=True,
        runs_while_draining=True,
        cost="unshard",
        colour="#b07aa1",
    ),
    StepKind(
        "RESHARD",
        "RESHARD",
        "FSDP: free the gathered parameters",
        "fsdp",
        whole_stage=True,
        runs_while_draining=True,
        cost="reshard",
        colour="#ff9da7",
    ),
    StepKind(
        "REDUCE_GRAD",
        "REDUCE_GRAD",
        "FSDP: reduce-scatter the stage's gradients",
        "fsdp",
        whole_stage=True,
        runs_while_draining=True,
        training_only=True,
        cost="reduce_grad",
        colour="#9c755f",
    ),
    # Structural: its halves are steps of their own ([Note: overlapped steps] in hp_pipeline.ir).
    StepKind(
        "OVERLAP_F_B",
        "OVERLAP_F_B",
        "a forward and another micro-batch's backward, run as one",
        _PIPELINE,
        compute=True,
        cost=_overlap_cost,
        colour="#8cd17d",
    ),
)


def register_builtins() -> None:
    """Register every kind hp_pipeline ships and attach the executor handlers; ``hp_pipeline`` calls it.

    The one place the package's kinds come into the registry, in a fixed order
    (the built-in kinds, MPipe's, the activation swap's: ``step_kinds()`` lists
    them so). ``hp_pipeline/__init__`` calls it before importing anything else,
    because the builders name the built-in kinds at import; the modules holding
    MPipe's and the swap's declarations and the handlers are imported here,
    after the built-in kinds exist. Calling it again changes nothing.
    """
    for kind in BUILTIN_KINDS:
        register_step_kind(kind)
    # Imported once the built-in kinds exist: importing MPipe imports the builders.
    from hp_pipeline.executor import BUILTIN_HANDLERS
    from hp_pipeline.mpipe.kinds import MPIPE_KINDS
    from hp_pipeline.mpipe.runner import MPIPE_HANDLERS
    from hp_pipeline.swap import SWAP_KINDS

    for kind in (*MPIPE_KINDS, *SWAP_KINDS):
        register_step_kind(kind)
    for code, handler in (*BUILTIN_HANDLERS, *MPIPE_HANDLERS):
        register_step_handler(code, handler)

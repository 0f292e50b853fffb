"""Step kinds as plug-ins: one registry that says what every :class:`MetaStepType` is and does.

Details: [Note: step-kind registry], [Note: running a kind].
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

__all__ = [
    "MetaStepType",
    "StepKind",
    "Transfer",
    "register_step_handler",
    "register_step_kind",
    "step_kinds",
]


# A rule sees an ``hp_pipeline._deps.OrderView`` and an ``hp_pipeline.ir.MetaStep`` and makes steps
# or ``hp_pipeline._deps.Edge`` s. They are ``Any`` here: ``ir`` imports this module, so this one
# imports nothing of the package (no import cycle, not even one for typing).
_Step = Any
_View = Any
NeedsRule = Callable[[_View, _Step], Iterable[_Step]]
EdgesRule = Callable[[_View, _Step], Iterable[Any]]
ConsumerRule = Callable[[_View, _Step], "_Step | None"]
Problems = list[tuple[str, list[tuple[int, int]]]]
CheckRule = Callable[[_View, "set[int]"], Problems]
AroundFactory = Callable[[Any, _Step], "AbstractContextManager[Any] | None"]


# [Note: running a kind]
# For each step of a rank's list the executor (``StepRunner``) calls, in the
# list's order, ``handler(runner, step)``; for a transfer kind it posts the
# tensors of ``handler.payload`` (sends) or buffers shaped by
# ``handler.metas`` (receives) and a consumer reads them back with
# ``runner.take_recv(step)``. A handler's exception marks the step failed and
# the rank drains ([Note: failures] in :mod:`hp_pipeline.executor`); raise
# ``hp_pipeline.executor.CommError`` for a broken communicator instead. A kind
# whose step must run even while the rank drains (a collective its peers wait
# in) sets ``runs_while_draining``; one that only makes sense when training
# (backward, gradient reduction) sets ``training_only``.
#
# A kind can also wrap the compute of *other* kinds: with ``wraps=("F",)`` and
# ``around=factory``, every ``F`` step of a runner whose list holds a step of
# this kind runs inside ``factory(runner, step)`` (a context manager, or
# ``None`` to leave that step alone). That is the place for an activation
# swap: ``torch.autograd.graph.saved_tensors_hooks`` entered around the forward
# of the micro-batches it swaps, with ``SWAP_OUT`` / ``SWAP_IN`` steps of its
# own moving the saved tensors. ``begin(runner)`` runs at the start of every
# step of such a runner, training or not (reset per-step state kept in ``runner.state``).


@dataclass(frozen=True)
class Transfer:
    """The executor part of a ``transfer`` kind ([Note: running a kind]).

    A send kind gives ``payload(runner, step)``, the tensors the send carries
    (zeros of the same shapes while the rank drains, so the peer still gets its
    message), and may give ``header(runner, step)``, the small object sent
    ahead of them on a schedule's first step, when peers learn the shapes
    (``"ok"`` when omitted). A receive kind gives ``metas(runner, step,
    header)``: the :class:`~hp_pipeline.stage.TensorMeta` of the buffers it
    posts, told the peer's header on the first step and ``None`` after.
    """

    payload: Callable[[Any, _Step], list[Any]] | None = None
    header: Callable[[Any, _Step], Any] | None = None
    metas: Callable[[Any, _Step, Any], list[Any]] | None = None


_CODE = re.compile(r"^[A-Z][A-Z_]*$")
_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


# [Note: step-kind registry]
# A step kind is declared once, as a :class:`StepKind`, and every pass reads
# that declaration instead of special-casing the kind:
#
# ==================  ==========================================================
# pass                what it reads from the declaration
# ==================  ==========================================================
# text form, CSV      ``code`` (and, for a transfer, ``peer_offset``)
# dependencies        ``needs``, ``edges``, ``feeds``, ``consumer`` ([Note:
#                     dependency model] in :mod:`hp_pipeline._deps`)
# ``validate_order``  the above, ``collective``, ``check`` (order-wide counts)
# ``simulate``        ``cost`` (overridable per run with ``StepCosts.by_code``),
#                     ``busy``, ``collective``
# ``render_order``    ``colour``
# executor            ``handler`` (``transfer`` kinds: a :class:`Transfer`),
#                     ``runs_while_draining``, ``training_only``, ``wraps`` /
#                     ``around``, ``begin``
# ==================  ==========================================================
#
# The built-in kinds (``F``, ``B``, ``SEND_F``, ``UNSHARD``, ...) are declared
# through :func:`register_step_kind` like any other (:mod:`hp_pipeline._builtin_kinds`);
# MPipe's (``PF``, ``SEND_P``, ...) are declared by :mod:`hp_pipeline.mpipe.kinds`
# when ``hp_pipeline`` is imported. A kind registered in one process must be
# registered in every process that reads or runs an order holding it (import the
# module that declares it on every rank): steps travel between ranks by code.
#
# Declaring the IR part and the executor part may happen in two places, so that
# a module of pure order logic needs no torch: :func:`register_step_handler`
# attaches (or replaces) the executor handler of a registered kind. This is how
# the built-in kinds get theirs (:mod:`hp_pipeline.executor`) and MPipe's
# (:mod:`hp_pipeline.mpipe.runner`).


@dataclass(frozen=True)
class StepKind:
    """The declaration of one step kind ([Note: step-kind registry]).

    Attributes:
        name: the ``MetaStepType`` member name (``"SWAP_OUT"``).
        code: the text code (``"SO"``): capital letters and ``_``; a step
            prints as ``{stage}{code}{micro}``.
        doc: one line for the docs and error messages.
        group: a family name (``"pipeline"``, ``"fsdp"``, ``"mpipe"``) that
            passes and users may filter on (``strip_mpipe`` drops its group).
        compute: the step runs the stage's module (FSDP must have it
            unsharded; it counts as model compute in the bubble).
        busy: the rank is busy during the step for the bubble figures;
            defaults to ``compute``.
        input_grad: the step makes the stage's input gradient (``B``, ``I``).
        training_only: forward-only runs leave the step out.
        whole_stage: ``micro_index`` may be ``None`` (a collective over the stage).
        collective: every rank's list holds one such step at the same point and
            they run together (validation and simulation wait for all ranks).
        transfer: ``"send"`` or ``"recv"`` for point-to-point kinds, which name
            a peer stage and pair with the ``matching`` code on the peer.
        matching: the code of the other half of a transfer.
        peer_offset: the peer a transfer gets when none is given
            (``stage + offset``); ``None`` makes the peer required.
        carries_backward: a send whose payload a backward makes (an overlapped
            pair's backward must run before it, [Note: running overlapped steps]).
        needs: ``needs(view, step)``: steps on the same stage that must come
            earlier in the rank's list.
        edges: ``edges(view, step)``: the :class:`Edge` s from other stages into
            the step.
        feeds: ``feeds(view, step)``: edges *out of* the step into steps of
            other kinds (how a plug-in adds an input to a built-in step: MPipe's
            ``PF`` feeds stage 0's ``F``).
        consumer: for a receive, ``consumer(view, step)``: the step that uses it.
        check: ``check(view, micro_batches)``: order-wide problems (counts),
            a list of ``(sentence, [(rank, position), ...])``; run once per
            distinct function when the kind occurs.
        cost: the simulator's duration: a number, the name of a
            :class:`~hp_pipeline.StepCosts` field, or ``cost(costs)``.
        colour: the SVG fill in ``render_order`` (grey when ``None``).
        resident: how the step changes the number of its micro-batch's saved
            activations on the device, for the simulator's
            ``peak_device_activations_per_rank``: ``F`` +1, ``B`` and ``W`` -1
            (they free them), ``SWAP_OUT`` -1 and ``SWAP_IN`` +1 (host memory
            and back, :mod:`hp_pipeline.swap`); 0 for every other kind.
        handler: the executor part: ``handler(runner, step)``, or a
            :class:`Transfer` for a transfer kind. May be attached later with
            :func:`register_step_handler`.
        runs_while_draining: run the handler even while the rank drains.
        wraps, around: run every step of the kinds coded in ``wraps`` inside
            ``around(runner, step)`` ([Note: running a kind]).
        begin: ``begin(runner)`` at the start of every step of a runner whose
            list holds this kind.
    """

    name: str
    code: str
    doc: str = ""
    group: str = ""
    compute: bool = False
    busy: bool | None = None
    input_grad: bool = False
    training_only: bool = False
    whole_stage: bool = False
    collective: bool = False
    transfer: Literal["send", "recv"] | None = None
    matching: str | None = None
    peer_offset: int | None = None
    carries_backward: bool = False
    needs: NeedsRule | None = None
    edges: EdgesRule | None = None
    feeds: EdgesRule | None = None
    consumer: ConsumerRule | None = None
    check: CheckRule | None = None
    cost: Any = 0
    colour: str | None = None
    resident: int = 0
    handler: Any = None
    runs_while_draining: bool = False
    wraps: tuple[str, ...] = ()
    around: AroundFactory | None = None
    begin: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"StepKind name must be an identifier in capitals (e.g. 'SWAP_OUT'), got {self.name!r}"
            )
        if not isinstance(self.code, str) or not _CODE.match(self.code):
            raise ValueError(
                f"StepKind {self.name}: code must be capital letters and '_' (no digits: the micro-batch "
                f"follows it in the text form), got {self.code!r}"
            )
        if self.transfer not in (None, "send", "recv"):
            raise ValueError(
                f"StepKind {self.name}: transfer must be None, 'send' or 'recv', got {self.transfer!r}"
            )
        if (self.transfer is None) != (self.matching is None):
            raise ValueError(
                f"StepKind {self.name}: a transfer kind names its matching code (SEND_X <-> RECV_X) and "
                f"only a transfer kind does; got transfer={self.transfer!r}, matching={self.matching!r}"
            )
        if self.peer_offset is not None and self.transfer is None:
            raise ValueError(f"StepKind {self.name}: only a transfer kind has a peer_offset")
        if bool(self.wraps) != (self.around is not None):
            raise ValueError(
                f"StepKind {self.name}: wraps and around go together (the codes, and the context)"
            )


class _Registry(type):
    """The metaclass that makes :class:`MetaStepType` behave like the enum it used to be."""

    _by_code: dict[str, MetaStepType]
    _by_name: dict[str, MetaStepType]

    def __getitem__(cls, name: str) -> MetaStepType:
        return cls._by_name[name]

    def __iter__(cls) -> Iterator[MetaStepType]:
        return iter(list(cls._by_code.values()))

    def __len__(cls) -> int:
        return len(cls._by_code)

    def __contains__(cls, item: object) -> bool:
        return isinstance(item, MetaStepType) and cls._by_code.get(item.code) is item

    def __getattr__(cls, name: str) -> MetaStepType:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"MetaStepType has no kind {name!r}; registered: {', '.join(cls._by_name)}. Plug-in kinds "
            "exist once their module is imported (MPipe's with hp_pipeline itself)"
        )


class MetaStepType(metaclass=_Registry):
    """What a :class:`~hp_pipeline.MetaStep` does: one registered :class:`StepKind`.

    Used like the enum it replaces: ``MetaStepType.FWD``, ``MetaStepType("F")``,
    ``MetaStepType["FWD"]``, ``for kind in MetaStepType``, ``kind.name``,
    ``kind.value`` / ``kind.code``. Members exist once registered
    (:func:`register_step_kind`); each is unique, so compare with ``is``.
    """

    _by_code: ClassVar[dict[str, MetaStepType]] = {}
    _by_name: ClassVar[dict[str, MetaStepType]] = {}

    # The built-in kinds (hp_pipeline._builtin_kinds) and OVERLAP_F_B; MPipe adds PREPROCESS_*.
    FWD: ClassVar[MetaStepType]
    BWD: ClassVar[MetaStepType]
    BWD_INPUT: ClassVar[MetaStepType]
    BWD_WEIGHT: ClassVar[MetaStepType]
    FWD_SEND: ClassVar[MetaStepType]
    FWD_RECV: ClassVar[MetaStepType]
    BWD_SEND: ClassVar[MetaStepType]
    BWD_RECV: ClassVar[MetaStepType]
    DATA_LOAD: ClassVar[MetaStepType]
    DATA_SEND: ClassVar[MetaStepType]
    DATA_RECV: ClassVar[MetaStepType]
    UNSHARD: ClassVar[MetaStepType]
    RESHARD: ClassVar[MetaStepType]
    REDUCE_GRAD: ClassVar[MetaStepType]
    OVERLAP_F_B: ClassVar[MetaStepType]

    spec: StepKind
    name: str
    code: str
    is_compute: bool
    busy: bool
    is_backward: bool
    is_send: bool
    is_recv: bool
    is_comm: bool
    is_collective: bool
    is_overlap: bool
    training_only: bool
    whole_stage: bool
    stable_id: int

    __slots__ = (
        "busy",
        "code",
        "is_backward",
        "is_collective",
        "is_comm",
        "is_compute",
        "is_overlap",
        "is_recv",
        "is_send",
        "name",
        "spec",
        "stable_id",
        "training_only",
        "whole_stage",
    )

    def __new__(cls, code: object) -> MetaStepType:
        """``MetaStepType("F")``: the registered kind with that text code, as ``Enum(value)``."""
        kind = cls._by_code.get(code) if isinstance(code, str) else None
        if kind is None:
            known = ", ".join(cls._by_code)
            raise ValueError(
                f"{code!r} is not a registered step code; known codes: {known}. A plug-in kind is "
                "registered by importing the module that declares it (register_step_kind)"
            )
        return kind

    def _set(self, spec: StepKind) -> None:
        # Plain attributes, not properties: the passes read them for every step.
        set_ = object.__setattr__
        set_(self, "spec", spec)
        set_(self, "name", spec.name)
        set_(self, "code", spec.code)
        set_(self, "is_compute", spec.compute)
        set_(self, "busy", spec.compute if spec.busy is None else spec.busy)
        set_(self, "is_backward", spec.input_grad)
        set_(self, "is_send", spec.transfer == "send")
        set_(self, "is_recv", spec.transfer == "recv")
        set_(self, "is_comm", spec.transfer is not None)
        set_(self, "is_collective", spec.collective)
        set_(self, "is_overlap", spec.code == "OVERLAP_F_B")
        set_(self, "training_only", spec.training_only)
        set_(self, "whole_stage", spec.whole_stage)
        # Hashed into MetaStep hashes: the same in every process, whatever the registration order.
        set_(self, "stable_id", zlib.crc32(spec.code.encode()))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a MetaStepType is immutable; register_step_handler changes its handler")

    @property
    def value(self) -> str:
        """The text code (``Enum.value`` of the enum this class replaces)."""
        return self.code

    @property
    def is_fsdp(self) -> bool:
        return self.spec.group == "fsdp"

    @property
    def group(self) -> str:
        return self.spec.group

    @property
    def matching(self) -> MetaStepType:
        """The other half of a transfer kind."""
        assert self.spec.matching is not None, f"{self.name} is not a transfer"
        return MetaStepType(self.spec.matching)

    @property
    def peer_offset(self) -> int | None:
        return self.spec.peer_offset

    def __repr__(self) -> str:
        return f"<MetaStepType.{self.name}: {self.code!r}>"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # By code: the receiving process has its own member (it registered the same kinds).
        return (MetaStepType, (self.code,))


def register_step_kind(kind: StepKind) -> MetaStepType:
    """Add a step kind to the registry and return its :class:`MetaStepType` member.

    After it, ``MetaStepType.<name>`` and ``MetaStepType(code)`` give the member,
    text and CSV forms parse it, and every pass and the executor follow the
    declaration ([Note: step-kind registry]). Registering the same declaration
    again (a module imported twice) returns the existing member; a different
    kind with a taken name or code raises ``ValueError``.
    """
    if not isinstance(kind, StepKind):
        raise TypeError(
            f"register_step_kind takes a StepKind, got {type(kind).__name__} ({kind!r}); declare the kind "
            "as StepKind(name=..., code=..., ...) and pass that"
        )
    same_code = MetaStepType._by_code.get(kind.code)
    same_name = MetaStepType._by_name.get(kind.name)
    if same_code is not None and same_code is same_name and _same_declaration(same_code.spec, kind):
        return same_code
    for taken, what in ((same_code, "code"), (same_name, "name")):
        if taken is not None:
            raise ValueError(
                f"cannot register step kind {kind.name} ({kind.code!r}): its {what} is taken by "
                f"{taken.name} ({taken.code!r}); pick another {what}"
            )
    member = _new_member(kind)
    _check_handler(member, kind.handler)
    MetaStepType._by_code[kind.code] = member
    MetaStepType._by_name[kind.name] = member
    type.__setattr__(MetaStepType, kind.name, member)
    return member


def _new_member(kind: StepKind) -> MetaStepType:
    member = object.__new__(MetaStepType)
    member._set(kind)
    return member


def _same_declaration(old: StepKind, new: StepKind) -> bool:
    """Equal but for the handler (which ``register_step_handler`` may have attached since)."""
    from dataclasses import replace

    return replace(old, handler=None) == replace(new, handler=None)


def register_step_handler(kind: MetaStepType | str, handler: Any) -> None:
    """Attach (or replace) the executor handler of a registered kind ([Note: running a kind]).

    ``kind`` is the member or its code. ``handler(runner, step)`` runs a step;
    a transfer kind takes a :class:`Transfer`.
    """
    from dataclasses import replace

    member = kind if isinstance(kind, MetaStepType) else MetaStepType(kind)
    _check_handler(member, handler)
    member._set(replace(member.spec, handler=handler))


def _check_handler(member: MetaStepType, handler: Any) -> None:
    if handler is None:
        return
    if not member.is_comm:
        if not callable(handler):
            raise TypeError(
                f"the handler of {member.name} must be callable as handler(runner, step), got {handler!r}"
            )
        return
    need = "payload" if member.is_send else "metas"
    if not isinstance(handler, Transfer) or getattr(handler, need) is None:
        raise TypeError(
            f"{member.name} is a transfer kind: its handler is a Transfer with {need}= "
            f"(hp_pipeline.Transfer), got {handler!r}"
        )


def step_kinds(group: str | None = None) -> Sequence[MetaStepType]:
    """The registered kinds in registration order; only those of ``group`` when given."""
    return [k for k in MetaStepType if group is None or k.spec.group == group]

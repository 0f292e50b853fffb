"""The schedule IR: one :class:`MetaStep` per action, one list of them per rank.

A pipeline schedule is plain data, an *order*: ``dict[rank, list[MetaStep]]``.
Builders produce compute-only orders, :func:`~hp_pipeline.insert_comms` adds
the point-to-point steps, :func:`~hp_pipeline.validate_order` checks them and
:func:`~hp_pipeline.simulate` times them. Keeping schedules as data (rather than
as code inside an executor) is what lets every one of those passes, and the
tests, look at a schedule without running a model.

Details: [Note: text form], [Note: overlapped steps].
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from hp_pipeline.kinds import MetaStepType

__all__ = [
    "MetaStep",
    "MetaStepType",
    "Order",
    "format_order",
    "read_order_csv",
    "write_order_csv",
]


# [Note: text form]
# Every step prints as ``{stage}{code}{micro}``, the torch.distributed.pipelining
# convention, so ``"2F0"`` is "stage 2 runs the forward of micro-batch 0".
# The codes below are those hp_pipeline registers (the built-in kinds and
# MPipe's); a plug-in adds its own with :func:`~hp_pipeline.register_step_kind`
# ([Note: step-kind registry] in :mod:`hp_pipeline.kinds`), and its steps
# print, parse and round-trip through CSV the same way.
#
# ============  ===============  ==================================================
# code          type             meaning
# ============  ===============  ==================================================
# ``F``         FWD              forward of one micro-batch through one stage
# ``B``         BWD              full backward (input and weight gradients)
# ``I``         BWD_INPUT        backward for the input gradient only (zero bubble)
# ``W``         BWD_WEIGHT       backward for the weight gradient only (zero bubble)
# ``SEND_F``    FWD_SEND         send the stage's output activation downstream
# ``RECV_F``    FWD_RECV         receive the stage's input activation
# ``SEND_B``    BWD_SEND         send the gradient of the stage's input upstream
# ``RECV_B``    BWD_RECV         receive the gradient of the stage's output
# ``LOAD``      DATA_LOAD        take the micro-batch from the data loader
# ``SEND_D``    DATA_SEND        send the micro-batch (inputs, targets) to a stage
# ``RECV_D``    DATA_RECV        receive the micro-batch from the loading stage
# ``UNSHARD``   UNSHARD          FSDP: all-gather the stage's parameters
# ``RESHARD``   RESHARD          FSDP: free the gathered parameters
# ``REDUCE_GRAD`` REDUCE_GRAD    FSDP: reduce-scatter the stage's gradients
# ``PF``        PREPROCESS_FWD   MPipe: run the preprocess tower on the owning rank
# ``PB``        PREPROCESS_BWD   MPipe: backpropagate through the tower
# ``SEND_P``    PREPROCESS_SEND  MPipe: send the tower's features to stage 0
# ``RECV_P``    PREPROCESS_RECV  MPipe: receive the tower's features on stage 0
# ``SEND_PG``   PREPROCESS_GRAD_SEND  MPipe: send dL/dfeatures back to the owner
# ``RECV_PG``   PREPROCESS_GRAD_RECV  MPipe: receive dL/dfeatures on the owner
# ``REDUCE_P``  PREPROCESS_REDUCE  MPipe: sum the tower's gradients over the ranks
# ``OVERLAP_F_B`` OVERLAP_F_B    a forward and another micro-batch's backward, run as one
# ============  ===============  ==================================================
#
# Communication steps name their peer stage. For activations and gradients the
# peer is the adjacent stage (``s + 1`` for ``SEND_F``/``RECV_B``, ``s - 1`` for
# ``RECV_F``/``SEND_B``), so it is left out of the text: ``"0SEND_F1"`` sends
# micro-batch 1's activation from stage 0 to stage 1. A non-default peer, and
# every data step's peer, is written after an arrow that points the way the data
# flows: ``"0SEND_D3->5"`` (stage 0 sends micro-batch 3's data to stage 5) is
# matched by ``"5RECV_D3<-0"``; the MPipe transfers name their peer the same
# way (``"2SEND_P6->0"``, ``"0SEND_PG6->2"``). The FSDP steps and ``REDUCE_P``
# act on a whole stage (a collective), so their micro-batch is optional:
# ``"1UNSHARD"``, ``"3REDUCE_P"``. The MPipe steps are described in
# :mod:`hp_pipeline.mpipe.order`.


_TEXT = re.compile(r"^(\d+)([A-Z_]+?)(\d*)(?:(->|<-)(\d+))?$")
_OVERLAP_TEXT = re.compile(r"^\(([^()]*)\)([A-Z_]+)$")
# The halves an OVERLAP_F_B may pair: a forward, then a backward that makes an input gradient.
_OVERLAP_HALVES = (frozenset({"F"}), frozenset({"B", "I"}))


# [Note: overlapped steps]
# An ``OVERLAP_F_B`` step (DualPipe's "F&B" chunk) pairs a forward with the
# backward of another micro-batch on the same rank, so that a runtime may
# let one's communication hide behind the other's compute. It is written as
# torch.distributed.pipelining writes it, the two halves in parentheses:
# ``"(0F3;7B1)OVERLAP_F_B"`` is stage 0's forward of micro-batch 3 together
# with stage 7's backward of micro-batch 1. Build one with
# :meth:`MetaStep.overlap`; the halves are ``step.sub_steps`` (a forward ``F``,
# then a ``B`` or an ``I``), and the step itself carries its forward's stage
# and micro-batch in ``stage_index`` / ``micro_index``, so a pass that only
# asks "which rank" sees it on the right one. Every pass treats the halves as
# the steps they are, at the position of the pair (:mod:`hp_pipeline.overlap`
# says how they run and are timed).


@dataclass(frozen=True)
class MetaStep:
    """One action of a pipeline schedule: ``type`` on ``stage_index`` for ``micro_index``.

    Immutable and hashable, so steps can be dictionary keys and set members in
    the passes. ``str(step)`` gives the text form described in the module
    docstring and :meth:`parse` reads it back: ``MetaStep.parse(str(s)) == s``.

    Args:
        micro_index: the micro-batch, ``>= 0``. Only the FSDP steps and
            ``REDUCE_P`` (which act on the whole stage) may leave it ``None``.
        type: a :class:`MetaStepType`.
        stage_index: the pipeline stage the step belongs to, ``>= 0``. For a
            communication step it is the stage on *this* side of the transfer.
        peer_stage: the stage on the other side of a communication step.
            Activation and gradient steps default to the adjacent stage, data
            steps must name it; every other type must leave it ``None``.
        sub_steps: the two halves of an ``OVERLAP_F_B`` step (a forward, then a
            ``B`` or ``I`` of another micro-batch), ``None`` for every other
            type. Build such a step with :meth:`overlap`, which fills
            ``micro_index`` and ``stage_index`` from the forward
            ([Note: overlapped steps]).
    """

    micro_index: int | None
    type: MetaStepType
    stage_index: int
    peer_stage: int | None = None
    sub_steps: tuple[MetaStep, ...] | None = None
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        self._check_and_normalise()
        # Steps are hashed constantly by the passes, so the hash is computed once.
        # Only ints go in (None -> -1, the type -> its ordinal): unlike str and,
        # before Python 3.12, None, their hashes are the same in every process,
        # so a pickled step stays a valid dict key on another rank (a kind hashes
        # by a checksum of its code, not by when it was registered).
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    -1 if self.micro_index is None else self.micro_index,
                    self.type.stable_id,
                    self.stage_index,
                    -1 if self.peer_stage is None else self.peer_stage,
                    *(part._hash for part in self.sub_steps or ()),
                )
            ),
        )

    def __hash__(self) -> int:
        return self._hash

    def _check_and_normalise(self) -> None:
        if not isinstance(self.type, MetaStepType):
            raise TypeError(
                f"MetaStep type must be a MetaStepType, got {self.type!r}; "
                f"use e.g. MetaStepType.FWD or MetaStepType({self.type!r}) for a text code"
            )
        if not _is_index(self.stage_index):
            raise ValueError(f"MetaStep stage_index must be an int >= 0, got {self.stage_index!r}")
        if self.type.is_overlap or self.sub_steps is not None:
            self._check_overlap()
            return
        if self.micro_index is None:
            if not self.type.whole_stage:
                whole = [k.name for k in MetaStepType if k.whole_stage]
                raise ValueError(
                    f"MetaStep of type {self.type.name} needs a micro_index (an int >= 0); "
                    f"only the whole-stage kinds {whole} may leave it None"
                )
        elif not _is_index(self.micro_index):
            raise ValueError(f"MetaStep micro_index must be an int >= 0 or None, got {self.micro_index!r}")
        if not self.type.is_comm:
            if self.peer_stage is not None:
                raise ValueError(
                    f"MetaStep of type {self.type.name} has no peer, got "
                    f"peer_stage={self.peer_stage!r}; only SEND/RECV steps take one"
                )
            return
        if self.peer_stage is None:
            offset = self.type.peer_offset
            if offset is None:
                raise ValueError(
                    f"MetaStep of type {self.type.name} must name its peer_stage "
                    "(the stage on the other side of the transfer), e.g. "
                    f"MetaStep({self.micro_index}, MetaStepType.{self.type.name}, "
                    f"{self.stage_index}, peer_stage=...)"
                )
            # Normalise so that the implicit and the explicit adjacent peer compare equal.
            object.__setattr__(self, "peer_stage", self.stage_index + offset)
        if not _is_index(self.peer_stage):
            raise ValueError(
                f"MetaStep {self.type.name} on stage {self.stage_index} has peer_stage="
                f"{self.peer_stage!r}; the peer must be a stage index >= 0 (stage 0 has no "
                "upstream stage to receive activations from or send gradients to)"
            )
        if self.peer_stage == self.stage_index:
            raise ValueError(
                f"MetaStep {self.type.name} on stage {self.stage_index} names itself as its "
                "peer; a stage does not communicate with itself"
            )

    def _check_overlap(self) -> None:
        """``OVERLAP_F_B`` <=> two halves: a forward, then a ``B``/``I``; the step mirrors the forward."""
        example = "MetaStep.overlap(MetaStep(3, MetaStepType.FWD, 0), MetaStep(1, MetaStepType.BWD, 7))"
        if not self.type.is_overlap:
            raise ValueError(
                f"MetaStep of type {self.type.name} has no sub_steps, got {self.sub_steps!r}; only "
                f"OVERLAP_F_B pairs two steps, e.g. {example}"
            )
        parts = self.sub_steps
        if (
            not isinstance(parts, tuple)
            or len(parts) != 2
            or not all(isinstance(p, MetaStep) for p in parts)
            or any(p.type.code not in allowed for p, allowed in zip(parts, _OVERLAP_HALVES, strict=True))
        ):
            raise ValueError(
                f"an OVERLAP_F_B step pairs a forward (F) with a backward (B or I) of another "
                f"micro-batch, in that order; got sub_steps={parts!r}. Build it as {example}"
            )
        forward = parts[0]
        if self.micro_index != forward.micro_index or self.stage_index != forward.stage_index:
            raise ValueError(
                f"an OVERLAP_F_B step carries its forward's micro-batch and stage "
                f"({forward.micro_index}, {forward.stage_index}), got ({self.micro_index!r}, "
                f"{self.stage_index!r}); build it with MetaStep.overlap(forward, backward)"
            )
        if self.peer_stage is not None:
            raise ValueError(f"an OVERLAP_F_B step has no peer, got peer_stage={self.peer_stage!r}")
        if forward.micro_index == parts[1].micro_index and forward.stage_index == parts[1].stage_index:
            raise ValueError(
                f"{parts[1]} needs {forward}, so they cannot run as one OVERLAP_F_B step; pair a "
                "forward with the backward of an earlier micro-batch"
            )

    @classmethod
    def overlap(cls, forward: MetaStep, backward: MetaStep) -> MetaStep:
        """The ``OVERLAP_F_B`` running ``forward`` and ``backward`` as one ([Note: overlapped steps])."""
        if not isinstance(forward, MetaStep) or not isinstance(backward, MetaStep):
            raise TypeError(
                f"MetaStep.overlap takes two MetaSteps, got {type(forward).__name__} and "
                f"{type(backward).__name__}"
            )
        pair = (forward, backward)
        return cls(forward.micro_index, MetaStepType.OVERLAP_F_B, forward.stage_index, None, pair)

    @property
    def parts(self) -> tuple[MetaStep, ...]:
        """The steps this step runs: the two halves of an ``OVERLAP_F_B``, else the step itself."""
        return self.sub_steps if self.sub_steps is not None else (self,)

    @property
    def default_peer(self) -> int | None:
        """The peer implied by the type (the adjacent stage), or ``None`` for data steps."""
        offset = self.type.peer_offset
        return None if offset is None else self.stage_index + offset

    def __str__(self) -> str:
        if self.sub_steps is not None:
            return f"({';'.join(str(part) for part in self.sub_steps)}){self.type.code}"
        micro = "" if self.micro_index is None else str(self.micro_index)
        text = f"{self.stage_index}{self.type.code}{micro}"
        if self.type.is_comm and self.peer_stage != self.default_peer:
            arrow = "->" if self.type.is_send else "<-"
            text += f"{arrow}{self.peer_stage}"
        return text

    def __repr__(self) -> str:
        if self.sub_steps is not None:
            return f"MetaStep.overlap({', '.join(repr(part) for part in self.sub_steps)})"
        extra = "" if self.peer_stage is None else f", peer_stage={self.peer_stage}"
        return f"MetaStep({self.micro_index!r}, MetaStepType.{self.type.name}, {self.stage_index}{extra})"

    @classmethod
    def parse(cls, text: str) -> MetaStep:
        """Read the text form back (``"2F0"``, ``"0SEND_D3->5"``, ``"(0F3;7B1)OVERLAP_F_B"``)."""
        text = text.strip()
        if text.startswith("("):
            return cls._parse_overlap(text)
        match = _TEXT.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse {text!r} as a MetaStep; expected "
                "'{stage}{code}{micro}' such as '2F0', '1SEND_B3' or '0SEND_D3->5'"
            )
        stage, code, micro, arrow, peer = match.groups()
        try:
            step_type = MetaStepType(code)
        except ValueError:
            codes = ", ".join(t.code for t in MetaStepType)
            raise ValueError(
                f"unknown step code {code!r} in {text!r}; known codes: {codes} (a plug-in kind "
                "parses once the module that registers it is imported)"
            ) from None
        if arrow is not None and (not step_type.is_comm or (arrow == "->") != step_type.is_send):
            raise ValueError(f"{text!r}: '->peer' belongs to SEND steps and '<-peer' to RECV steps")
        if step_type.is_overlap:
            raise ValueError(
                f"{text!r}: an OVERLAP_F_B step is written with its two halves, e.g. '(0F3;7B1)OVERLAP_F_B'"
            )
        return cls(
            int(micro) if micro else None,
            step_type,
            int(stage),
            None if peer is None else int(peer),
        )

    @classmethod
    def _parse_overlap(cls, text: str) -> MetaStep:
        match = _OVERLAP_TEXT.match(text)
        halves = match.group(1).split(";") if match else []
        if match is None or match.group(2) != MetaStepType.OVERLAP_F_B.code or len(halves) != 2:
            raise ValueError(
                f"cannot parse {text!r} as a MetaStep; a step in parentheses is an overlapped pair "
                "written '(forward;backward)OVERLAP_F_B', e.g. '(0F3;7B1)OVERLAP_F_B'"
            )
        forward, backward = (cls.parse(half) for half in halves)
        return cls.overlap(forward, backward)


Order = dict[int, list[MetaStep]]
"""A schedule: for each rank, the steps it runs, in order."""


def _is_index(value: object) -> bool:
    return type(value) is int and value >= 0  # not bool, which is an int too


def format_order(
    order: Mapping[int, Sequence[MetaStep]],
    marks: Iterable[tuple[int, int]] = (),
    *,
    context: int = 8,
) -> str:
    """The rank x step grid: one row per rank, one column per position in its list.

    Steps at the ``(rank, position)`` pairs in ``marks`` are drawn as ``>2F0<``.
    When there are marks and the rows are long, only the columns from ``context``
    before the first mark to ``context`` after the last are shown, so an error
    message stays readable for a 16-micro-batch interleaved schedule.
    """
    marked = set(marks)
    ranks = sorted(order)
    if not ranks:
        return "(empty order)"
    length = max((len(order[r]) for r in ranks), default=0)
    first, last = 0, length
    if marked:
        columns = [c for _, c in marked]
        first = max(0, min(columns) - context)
        last = min(length, max(columns) + context + 1)

    def cell(rank: int, col: int) -> str:
        steps = order[rank]
        if col >= len(steps):
            return ""
        text = str(steps[col])
        return f">{text}<" if (rank, col) in marked else text

    width = max([len(cell(r, c)) for r in ranks for c in range(first, last)] + [len(str(last - 1))])
    label = max(len(f"rank {r}") for r in ranks)
    lines = [" " * label + " | " + " ".join(f"{c:>{width}}" for c in range(first, last)).rstrip()]
    for rank in ranks:
        cells = [f"{cell(rank, c):>{width}}" for c in range(first, last)]
        prefix = "... " if first > 0 else ""
        suffix = " ..." if last < len(order[rank]) else ""
        lines.append(f"{f'rank {rank}':<{label}} | {prefix}{' '.join(cells).rstrip()}{suffix}")
    return "\n".join(lines)


def write_order_csv(order: Mapping[int, Sequence[MetaStep]], file: str | os.PathLike[str] | TextIO) -> None:
    """Write ``order`` as CSV, one row per rank: the rank, then its steps' text forms.

    Plain CSV so schedules can be diffed, kept as golden files and edited by hand.
    """
    if isinstance(file, (str, os.PathLike)):
        with open(file, "w", newline="", encoding="utf-8") as handle:
            write_order_csv(order, handle)
        return
    writer = csv.writer(file, lineterminator="\n")
    for rank in sorted(order):
        writer.writerow([rank, *(str(step) for step in order[rank])])


def read_order_csv(file: str | os.PathLike[str] | TextIO) -> Order:
    """Read an order written by :func:`write_order_csv` (blank cells are ignored)."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, newline="", encoding="utf-8") as handle:
            return read_order_csv(handle)
    order: Order = {}
    for line, row in enumerate(csv.reader(file), start=1):
        cells = [c.strip() for c in row]
        if not any(cells):
            continue
        try:
            rank = int(cells[0])
        except ValueError:
            raise ValueError(
                f"order CSV line {line}: the first cell must be the rank (an int), got {cells[0]!r}"
            ) from None
        if rank < 0 or rank in order:
            raise ValueError(
                f"order CSV line {line}: rank {rank} is negative or appears twice; write one row per rank"
            )
        steps = []
        for col, text in enumerate(cells[1:], start=2):
            if not text:
                continue
            try:
                steps.append(MetaStep.parse(text))
            except ValueError as exc:
                raise ValueError(f"order CSV line {line}, column {col}: {exc}") from None
        order[rank] = steps
    return order

"""Halo exchange: a sliding-window op (convolution, pooling) on an input cut along a spatial dim.

A window that crosses a cut reads rows of the neighbour, so each rank first
receives the few border rows it needs (its *halo*), runs the op on that
extended piece and keeps its own share of the output, which stays cut on the
same dim. The backward runs the op's own backward on the extended piece and
sends the halo's gradient back to the rank that owns those rows, where it is
added ([Note: halo plans], [Note: halo exchange]). A cut that does not line
up (a piece too short for its neighbour's window, an empty piece) has no plan
and the caller gathers that mesh dim instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hp_core
import hp_core.collectives as hc
import torch
import torch.distributed as dist
from hp_core import P2POp
from hp_core.distributed import mesh_group

from hp_dtensor.layout import Layout, chunk_sizes
from hp_dtensor.placements import Shard

__all__ = [
    "HaloDim",
    "LinePlan",
    "Window",
    "extend",
    "extended_shape",
    "fold_back",
    "full_args",
    "global_indices",
    "halo_rows",
    "line_reads",
    "local_indices",
    "narrow_output",
    "neighbourly",
    "pad_output_grad",
    "per_dim",
    "plan_halos",
    "plan_line",
    "window_count",
    "with_halo",
]


def window_count(length: int, extent: int, stride: int, padding: int, ceil_mode: bool = False) -> int:
    """How many windows of ``extent`` rows fit ``length`` rows padded by ``padding`` (PyTorch's rule).

    With ``ceil_mode`` a last window may run past the end (even a first one
    longer than the padded input), as long as it starts inside the input or
    its left padding.
    """
    count = (length + 2 * padding - extent + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (count - 1) * stride >= length + padding:
        count -= 1
    return max(count, 0)


@dataclass(frozen=True)
class Window:
    """A sliding window along one dim: ``extent = dilation * (kernel - 1) + 1`` rows, stride, padding.

    ``transposed`` is a transposed convolution's scatter (each input row
    writes ``extent`` output rows, ``stride`` apart per input row), with its
    ``output_padding``.
    """

    extent: int
    stride: int
    padding: int
    ceil_mode: bool = False
    transposed: bool = False
    output_padding: int = 0

    def count(self, rows: int) -> int:
        """How many output rows the op gives for ``rows`` input rows."""
        if not self.transposed:
            return window_count(rows, self.extent, self.stride, self.padding, self.ceil_mode)
        if rows == 0:
            return 0
        return max(0, (rows - 1) * self.stride - 2 * self.padding + self.extent + self.output_padding)

    def reads(self, first: int, stop: int, length: int) -> tuple[int, int, int]:
        """``(e0, e1, shift)``: the input rows outputs ``[first, stop)`` read, where the op on rows
        ``[e0, e1)`` puts its first output (global index ``shift``); see [Note: halo plans]."""
        s, p, extent = self.stride, self.padding, self.extent
        if not self.transposed:
            e0 = max(0, first * s - p) // s * s
            return e0, min(length, (stop - 1) * s - p + extent), e0 // s
        # output o sums input rows i with i * s <= o + p <= i * s + extent - 1
        e0 = min(max(0, -((extent - 1 - first - p) // s)), first // s)
        e1 = min(length, (stop - 1 + p) // s + 1)
        while e1 < length and self.count(e1 - e0) < stop - e0 * s:
            e1 += 1  # the local op crops its padding at the piece's end too: read further
        return e0, e1, e0 * s


@dataclass(frozen=True)
class LinePlan:
    """Per rank of one line of ranks: input pieces, extended pieces, output pieces, local output shift."""

    starts: tuple[int, ...]  # input piece starts, one per rank, then the length
    ends: tuple[tuple[int, int], ...]  # (e0, e1): the rows each rank's extended piece covers
    outs: tuple[int, ...]  # output piece starts, one per rank, then the output length
    shift: tuple[int, ...]  # c: the global index of each rank's first local output


# [Note: halo plans]
# Along one spatial dim of global length ``L`` an output row ``o`` reads the
# input rows ``o * s - p ... o * s - p + extent - 1`` (``extent = dilation *
# (kernel - 1) + 1``). The output is cut by ``torch.chunk`` like any DTensor:
# rank ``r`` owns outputs ``[O_r, O_r+1)``. It builds an extended piece of the
# input rows ``[e0, e1)`` and runs the op there *with the op's own padding*:
# ``e0`` is a multiple of the stride (so the local windows start where the
# global ones do, shifted by ``c = e0 / s`` outputs) at or before the first
# row its first window reads, and ``e1`` the last row its last window reads
# (both clamped to the tensor). Windows that touch the op's padding then only
# occur at the tensor's true ends, where the extended piece ends too: average
# pooling's divisor (``count_include_pad``, ``ceil_mode``) and max pooling's
# padding behave exactly as on the whole tensor. The local op yields outputs
# ``c ...``; rank ``r`` keeps ``[O_r - c, O_r+1 - c)``. A transposed
# convolution is the same with the roles turned: output ``o`` sums the input
# rows ``i`` with ``i * s <= o + p <= i * s + extent - 1``, and the local op on
# rows ``[e0, e1)`` starts at output ``c = e0 * s``. A plan exists when every
# input and output piece is non-empty, each rank reads some of its own rows,
# and the rest come from its two neighbours only; otherwise the caller gathers.
@dataclass(frozen=True)
class HaloDim(LinePlan):
    """The halo of one mesh dim's cut of one tensor dim ([Note: halo plans]): a line plan, placed."""

    mesh_dim: int = 0
    dim: int = 0
    window: Window = Window(1, 1, 0)

    @property
    def to_left(self) -> int:
        """Rows of the widest piece a rank sends to its left neighbour (that rank's right halo)."""
        return max(self.right_need(r) for r in range(len(self.ends)))

    @property
    def to_right(self) -> int:
        """Rows of the widest piece a rank sends to its right neighbour (that rank's left halo)."""
        return max(self.left_need(r) for r in range(len(self.ends)))

    def left_need(self, r: int) -> int:
        """Rows rank ``r`` reads from its left neighbour."""
        return max(0, self.starts[r] - self.ends[r][0])

    def right_need(self, r: int) -> int:
        """Rows rank ``r`` reads from its right neighbour."""
        return max(0, self.ends[r][1] - self.starts[r + 1])

    def local_outputs(self, r: int) -> int:
        """How many outputs the op yields on rank ``r``'s extended piece."""
        e0, e1 = self.ends[r]
        return self.window.count(e1 - e0)


def plan_line(length: int, ranks: int, window: Window) -> LinePlan | None:
    """The halo of ``length`` rows cut by ``torch.chunk`` over ``ranks`` ([Note: halo plans]), or None."""
    sizes, out_sizes = chunk_sizes(length, ranks), chunk_sizes(window.count(length), ranks)
    if ranks < 2 or min(sizes) == 0 or min(out_sizes) == 0:
        return None
    starts = tuple(sum(sizes[:r]) for r in range(ranks + 1))
    outs = tuple(sum(out_sizes[:r]) for r in range(ranks + 1))
    ends: list[tuple[int, int]] = []
    shift: list[int] = []
    for r in range(ranks):
        e0, e1, c = window.reads(outs[r], outs[r + 1], length)
        if not neighbourly(starts, r, e0, e1):
            return None
        if not 0 <= outs[r] - c <= outs[r + 1] - c <= window.count(e1 - e0):
            return None  # the local op would not give this rank's outputs: gather instead
        ends.append((e0, e1))
        shift.append(c)
    return LinePlan(starts, tuple(ends), outs, tuple(shift))


def neighbourly(starts: Sequence[int], r: int, e0: int, e1: int) -> bool:
    """Whether rank ``r`` reading rows ``[e0, e1)`` reads some of its own and none beyond a neighbour.

    A plan needs both (the exchange reaches the two neighbours only, and the
    extended piece joins the halos to the rank's own rows); otherwise the
    caller gathers.
    """
    ranks = len(starts) - 1
    if e0 < starts[max(r - 1, 0)] or e1 > starts[min(r + 2, ranks)]:
        return False
    return max(e0, starts[r]) < min(e1, starts[r + 1])


def line_reads(
    length: int, ranks: int, out_length: int, reads: Callable[[int, int], tuple[int, int]]
) -> LinePlan | None:
    """The line plan of an op whose outputs ``[first, stop)`` read the input rows ``reads(first, stop)``.

    Both lines are cut by ``torch.chunk``; None where a piece is empty or a
    rank's reads are not :func:`neighbourly`. Each rank's shift is its ``e0``.
    """
    sizes, out_sizes = chunk_sizes(length, ranks), chunk_sizes(max(out_length, 0), ranks)
    if ranks < 2 or min(sizes) == 0 or min(out_sizes) == 0:
        return None
    starts = tuple(sum(sizes[:r]) for r in range(ranks + 1))
    outs = tuple(sum(out_sizes[:r]) for r in range(ranks + 1))
    ends = tuple(reads(outs[r], outs[r + 1]) for r in range(ranks))
    if not all(neighbourly(starts, r, e0, e1) for r, (e0, e1) in enumerate(ends)):
        return None
    return LinePlan(starts, ends, outs, tuple(e0 for e0, _ in ends))


def plan_halos(layout: Layout, spatial: Sequence[int], windows: Sequence[Window]) -> dict[int, HaloDim]:
    """The halo of each mesh dim that cuts one of the ``spatial`` tensor dims of ``layout``, where one exists.

    ``windows[i]`` is the op's window along ``spatial[i]``. Mesh dims absent
    from the answer must be gathered; a dim cut by two mesh dims has no plan.
    """
    plans: dict[int, HaloDim] = {}
    for m, p in enumerate(layout.placements):
        if not isinstance(p, Shard) or p.dim not in spatial:
            continue
        cutters = [k for k, q in enumerate(layout.placements) if isinstance(q, Shard) and q.dim == p.dim]
        if len(cutters) != 1:
            continue
        window = windows[spatial.index(p.dim)]
        line = plan_line(layout.shape[p.dim], layout.mesh.shape[m], window)
        if line is not None:
            plans[m] = HaloDim(line.starts, line.ends, line.outs, line.shift, m, p.dim, window)
    return plans


def _swap_borders(
    for_left: torch.Tensor, for_right: torch.Tensor, dim: int, layout: Layout, mesh_dim: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send ``for_left`` / ``for_right`` to the neighbours; what they sent this way ([Note: halo exchange]).

    Every rank's buffers have one shape per direction (padded to the widest
    border). Returns the left neighbour's ``for_right`` and the right
    neighbour's ``for_left`` (``None`` at the line's ends).
    """
    ranks = layout.mesh.shape[mesh_dim]
    r = layout.my_coordinate()[mesh_dim]
    group = mesh_group(layout.mesh, mesh_dim)
    if ranks == 2:
        moved = torch.cat([for_left, for_right], dim).movedim(dim, 0).contiguous()
        out = moved.new_empty((ranks * moved.shape[0], *moved.shape[1:]))
        hc.all_gather_into_tensor(out, moved, group)
        pieces = [piece.movedim(0, dim) for piece in out.chunk(ranks)]
        n = for_left.shape[dim]
        return (
            pieces[0].narrow(dim, n, for_right.shape[dim]) if r == 1 else None,
            pieces[1].narrow(dim, 0, n) if r == 0 else None,
        )
    # [Note: neighbour exchange]; a direction of zero rows (the same on every rank) is not posted
    peers = dist.get_process_group_ranks(group)
    ops: list[P2POp] = []
    from_left = from_right = None
    if r > 0:
        if for_left.numel():
            ops.append(P2POp("isend", for_left.contiguous(), peers[r - 1], group))
        if for_right.numel():
            from_left = for_right.new_empty(for_right.shape)
            ops.append(P2POp("irecv", from_left, peers[r - 1], group))
    if r + 1 < ranks:
        if for_right.numel():
            ops.append(P2POp("isend", for_right.contiguous(), peers[r + 1], group))
        if for_left.numel():
            from_right = for_left.new_empty(for_left.shape)
            ops.append(P2POp("irecv", from_right, peers[r + 1], group))
    if ops:
        hp_core.batch_isend_irecv(ops).wait()
    return from_left, from_right


def _received(rows: torch.Tensor | None, sent: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The first ``n`` rows a neighbour sent this way (``sent``: this rank's buffer the other way).

    A neighbour that exists always sends once ``n > 0``, except when every
    buffer is empty (a zero-size dim elsewhere): nothing is posted then, and
    the rows are the empty piece of the same shape.
    """
    if rows is not None:
        return rows.narrow(dim, 0, n)
    shape = list(sent.shape)
    shape[dim] = n
    return sent.new_empty(shape)


def _pad_rows(rows: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - rows.shape[dim]
    if missing == 0:
        return rows
    shape = list(rows.shape)
    shape[dim] = missing
    return torch.cat([rows, rows.new_zeros(shape)], dim)


# [Note: halo exchange]
# Each rank packs the rows its left neighbour reads and the rows its right
# neighbour reads, each padded to the widest such border so every rank's
# buffers have one shape per direction, and picks its halos out of what its
# neighbours packed. On a line of two ranks both directions are one
# ``all_gather_into_tensor`` of the two buffers: a 3x3 convolution with
# padding 1 gathers 4 rows, the borders, never the tensor. On longer lines
# the ranks swap buffers with their two neighbours only ([Note: neighbour
# exchange]). The backward packs the halo's gradient the other way and each
# owner adds what it receives to its border rows. Several cut dims (H on one
# mesh dim, W on another) are extended one after the other, so corner rows
# travel through the first exchange, and folded back in the reverse order.
#
# [Note: neighbour exchange]
# An all-gather gives every rank all ``W`` buffers, ``W - 1`` of them from
# ranks whose rows it never reads, so the bytes each rank receives grow with
# the line. With ``W > 2`` each rank instead posts, in one
# ``batch_isend_irecv``, a send of each buffer to the neighbour that reads it
# and a receive from each neighbour: two borders in, two out, whatever ``W``.
# All sends and receives of a rank are posted together before any wait, so the
# ring of exchanges cannot deadlock on a backend whose sends block until
# matched (NCCL runs the batch as one group). Each direction has one width on
# every rank of the line (the widest border, as in the all-gather), so a
# receive is posted exactly where the neighbour posts its send, and every rank
# of the line takes part in the batch: NCCL leaves a batch that only some
# ranks of a group join undefined when it is the group's first communication.
# The price is a few padding rows where borders differ (a strided window,
# an uneven pad); the payload stays two borders per rank.
# With two ranks the all-gather stays: it is already just one buffer each
# way between the same two ranks (no more messages, the same padded rows),
# and it runs on the group's collective channels, while NCCL and HCCL set up
# separate point-to-point connections and buffers on a communicator's first
# send between a pair of ranks.
def halo_rows(
    local: torch.Tensor, layout: Layout, plan: HaloDim
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows this rank reads from its left and right neighbours (``None``: none), by one exchange.

    Every rank of the line must call it together ([Note: halo exchange]).
    """
    r = layout.my_coordinate()[plan.mesh_dim]
    dim = plan.dim
    to_left, to_right = plan.to_left, plan.to_right
    if not (to_left or to_right):
        return None, None
    for_left = plan.right_need(r - 1) if r > 0 else 0
    for_right = plan.left_need(r + 1) if r + 1 < len(plan.ends) else 0
    send_left = _pad_rows(local.narrow(dim, 0, for_left), dim, to_left)
    send_right = _pad_rows(local.narrow(dim, local.shape[dim] - for_right, for_right), dim, to_right)
    from_left, from_right = _swap_borders(send_left, send_right, dim, layout, plan.mesh_dim)
    left = _received(from_left, send_right, dim, plan.left_need(r)) if plan.left_need(r) else None
    right = _received(from_right, send_left, dim, plan.right_need(r)) if plan.right_need(r) else None
    return left, right


def with_halo(
    local: torch.Tensor, layout: Layout, plan: HaloDim, left: torch.Tensor | None, right: torch.Tensor | None
) -> torch.Tensor:
    """This rank's piece narrowed to the rows it reads of its own and joined to its halo rows."""
    r = layout.my_coordinate()[plan.mesh_dim]
    dim, (e0, e1) = plan.dim, plan.ends[r]
    own0, own1 = plan.starts[r], plan.starts[r + 1]
    middle = local.narrow(dim, max(e0, own0) - own0, min(e1, own1) - max(e0, own0))
    parts = [t for t in (left, middle, right) if t is not None]
    return torch.cat(parts, dim) if len(parts) > 1 else middle


def extend(local: torch.Tensor, layout: Layout, plan: HaloDim) -> torch.Tensor:
    """This rank's piece extended to the rows ``plan`` says it reads ([Note: halo exchange])."""
    return with_halo(local, layout, plan, *halo_rows(local, layout, plan))


def fold_back(grad: torch.Tensor, layout: Layout, plan: HaloDim) -> torch.Tensor:
    """The gradient of :func:`extend`: the extended piece's gradient summed back onto its owners."""
    r = layout.my_coordinate()[plan.mesh_dim]
    dim, e0 = plan.dim, plan.ends[r][0]
    own0, own1 = plan.starts[r], plan.starts[r + 1]
    left_n, right_n = plan.left_need(r), plan.right_need(r)
    shape = list(grad.shape)
    shape[dim] = own1 - own0
    out = grad.new_zeros(shape)
    middle = grad.narrow(dim, left_n, grad.shape[dim] - left_n - right_n)
    out.narrow(dim, max(e0, own0) - own0, middle.shape[dim]).add_(middle)
    to_left, to_right = plan.to_right, plan.to_left  # the halos travel back: sizes swap
    if to_left or to_right:
        mine_left = grad.narrow(dim, 0, left_n)  # rows of the left neighbour
        mine_right = grad.narrow(dim, grad.shape[dim] - right_n, right_n)
        send_left, send_right = _pad_rows(mine_left, dim, to_left), _pad_rows(mine_right, dim, to_right)
        from_left, from_right = _swap_borders(send_left, send_right, dim, layout, plan.mesh_dim)
        if r > 0 and plan.right_need(r - 1):
            n = plan.right_need(r - 1)
            out.narrow(dim, 0, n).add_(_received(from_left, send_right, dim, n))
        if r + 1 < len(plan.ends) and plan.left_need(r + 1):
            n = plan.left_need(r + 1)
            out.narrow(dim, out.shape[dim] - n, n).add_(_received(from_right, send_left, dim, n))
    return out


def narrow_output(out: torch.Tensor, layout: Layout, plan: HaloDim) -> torch.Tensor:
    """This rank's share ``[O_r - c, O_r+1 - c)`` of the op's output on its extended piece."""
    r = layout.my_coordinate()[plan.mesh_dim]
    return out.narrow(plan.dim, plan.outs[r] - plan.shift[r], plan.outs[r + 1] - plan.outs[r])


def pad_output_grad(grad: torch.Tensor, layout: Layout, plan: HaloDim) -> torch.Tensor:
    """The output gradient placed among the extended piece's outputs (zeros for outputs kept elsewhere)."""
    r = layout.my_coordinate()[plan.mesh_dim]
    before = plan.outs[r] - plan.shift[r]
    after = plan.local_outputs(r) - before - grad.shape[plan.dim]
    if before == 0 and after == 0:
        return grad
    shape = list(grad.shape)
    parts = []
    for n in (before, after):
        shape[plan.dim] = n
        parts.append(grad.new_zeros(shape))
    return torch.cat([parts[0], grad, parts[1]], plan.dim)


def _reindex(
    indices: torch.Tensor, src: Sequence[int], dst: Sequence[int], offsets: Sequence[int]
) -> torch.Tensor:
    """Flat plane indices over spatial sizes ``src`` moved by ``offsets`` and flattened over ``dst``."""
    rest = indices
    coords = []
    for size in reversed(src):
        coords.append(rest % size)
        rest = rest // size
    out = torch.zeros_like(indices)
    for coord, size, offset in zip(reversed(coords), dst, offsets, strict=True):
        out = out * size + coord + offset
    return out


def _plane(layout: Layout, plans: Sequence[HaloDim], k: int) -> tuple[list[int], list[int]]:
    """The whole plane's ``k`` spatial sizes, and where this rank's extended piece starts in each."""
    first = layout.ndim - k
    starts = [0] * k
    for plan in plans:
        starts[plan.dim - first] = plan.ends[layout.my_coordinate()[plan.mesh_dim]][0]
    return [layout.shape[d] for d in range(first, layout.ndim)], starts


def global_indices(
    indices: torch.Tensor, extended: Sequence[int], layout: Layout, plans: Sequence[HaloDim]
) -> torch.Tensor:
    """Max pooling indices into an extended piece (spatial sizes ``extended``) as whole-plane indices."""
    whole, starts = _plane(layout, plans, len(extended))
    return _reindex(indices, extended, whole, starts)


def local_indices(
    indices: torch.Tensor, extended: Sequence[int], layout: Layout, plans: Sequence[HaloDim]
) -> torch.Tensor:
    """The inverse of :func:`global_indices`: whole-plane indices into this rank's extended piece."""
    whole, starts = _plane(layout, plans, len(extended))
    return _reindex(indices, whole, extended, [-s for s in starts])


def full_args(func: object, args: tuple[object, ...], kwargs: dict[str, object]) -> list[Any]:
    """Every schema argument of ``func`` positionally: given ones, then keyword ones, then defaults.

    ``Any`` items: each argument's type is the op schema's (a tensor, a size
    list, a flag), which only the caller, knowing the op, can tell.
    """
    out: list[Any] = []
    for i, argument in enumerate(func._schema.arguments):  # type: ignore[attr-defined]
        if i < len(args):
            out.append(args[i])
        elif argument.name in kwargs:
            out.append(kwargs[argument.name])
        else:
            out.append(argument.default_value)
    return out


def per_dim(value: object, k: int, empty: Sequence[int] = ()) -> list[int]:
    """An op's int-or-list window argument as ``k`` ints; an empty list gives ``empty`` (a pool's stride)."""
    if isinstance(value, int):
        return [value] * k
    items = [int(v) for v in value]  # type: ignore[attr-defined]
    if not items:
        return list(empty)
    return items * k if len(items) == 1 else items


def extended_shape(local_shape: Sequence[int], layout: Layout, plans: Sequence[HaloDim]) -> list[int]:
    """The shape of this rank's piece after :func:`extend` along every plan (no communication)."""
    shape = list(local_shape)
    for plan in plans:
        e0, e1 = plan.ends[layout.my_coordinate()[plan.mesh_dim]]
        shape[plan.dim] = e1 - e0
    return shape

"""Redistribution planning: the cheapest sequence of one-mesh-dim steps between two placement lists.

Each step changes the placement of a single mesh dim and is one collective
(or none): [Note: redistribution steps]. The search is Dijkstra over the states
reachable by changing each mesh dim to its source placement, its target
placement or ``Replicate`` (at most 3**ndim states), with cost = bytes, ties
broken by fewer collectives. Plans are cached. Steps that would cut a tensor
dim a higher mesh dim also cuts are unavailable ([Note: nested shard order]).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hp_dtensor.layout import Layout
from hp_dtensor.placements import Placement, Replicate, Shard

__all__ = ["RedistributePlan", "RedistributeStep", "explain_redistribute", "plan_redistribute"]


@dataclass(frozen=True)
class RedistributeStep:
    """One step of a plan: mesh dim ``mesh_dim`` goes from ``src`` to ``dst`` with ``collective``."""

    mesh_dim: int
    src: Placement
    dst: Placement
    collective: str  # "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "local_chunk", "local"
    bytes: int  # bytes received per rank (estimate from the largest shard on the line)

    def __str__(self) -> str:
        return (
            f"mesh dim {self.mesh_dim}: {self.src} -> {self.dst} via {self.collective} ({self.bytes} B/rank)"
        )


@dataclass(frozen=True)
class RedistributePlan:
    """The steps of a redistribution, in execution order, with their totals."""

    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[RedistributeStep, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes received per rank over all steps."""
        return sum(step.bytes for step in self.steps)

    @property
    def num_collectives(self) -> int:
        """Steps that communicate."""
        return sum(1 for step in self.steps if not step.collective.startswith("local"))

    def __iter__(self) -> Iterator[RedistributeStep]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        head = f"[{', '.join(map(str, self.src))}] -> [{', '.join(map(str, self.dst))}]"
        if not self.steps:
            return head + ": nothing to do"
        lines = [f"{head}: {self.num_collectives} collective(s), {self.total_bytes} B/rank"]
        lines += [f"  {i + 1}. {step}" for i, step in enumerate(self.steps)]
        return "\n".join(lines)


# [Note: nested shard order]
# When two mesh dims shard the same tensor dim, the lower mesh dim cuts first.
# A step on mesh dim ``m`` that gathers or cuts tensor dim ``d`` is only right
# when no higher mesh dim currently shards ``d``: otherwise the pieces along
# ``m``'s line are not contiguous slices of one another. The planner treats
# such steps as unavailable, so plans for ``[S(0), S(0)] -> [R, R]`` gather the
# higher mesh dim first.
def _collective(state: Sequence[Placement], mesh_dim: int, target: Placement) -> str | None:
    """The collective for changing ``state[mesh_dim]`` to ``target`` directly, or None if not allowed."""
    current = state[mesh_dim]
    if current == target:
        return None
    higher = state[mesh_dim + 1 :]

    def free(dim: int) -> bool:  # see [Note: nested shard order]
        return not any(isinstance(p, Shard) and p.dim == dim for p in higher)

    return current.step_to(target, free)  # [Note: placement transforms]


# [Note: redistribution steps]
# ============  =====================  =====================================
# from -> to    collective             bytes received per rank (n ranks, L local bytes)
# ============  =====================  =====================================
# S(d) -> R     all_gather             (n - 1) * L
# R -> S(d)     none (local chunk)     0
# P -> R        all_reduce             2 (n - 1) / n * L   (ring)
# P -> S(d)     reduce_scatter         (n - 1) / n * L
# S(i) -> S(j)  all_to_all             (n - 1) / n * L
# R -> P        none (local)           0   (only for backward and internal use)
# ============  =====================  =====================================
#
# Anything else (S -> P, P(sum) -> P(max)) goes through ``Replicate``.
def _bytes(collective: str, n: int, local_bytes: int) -> int:
    if collective == "all_gather":
        return (n - 1) * local_bytes
    if collective == "all_reduce":
        return 2 * (n - 1) * local_bytes // n
    if collective in ("reduce_scatter", "all_to_all"):
        return (n - 1) * local_bytes // n
    return 0


def _local_bytes(
    state: Sequence[Placement], mesh_shape: Sequence[int], shape: Sequence[int], itemsize: int
) -> int:
    sizes = list(shape)
    for mesh_dim, placement in enumerate(state):
        if isinstance(placement, Shard):
            sizes[placement.dim] = -(-sizes[placement.dim] // mesh_shape[mesh_dim])
    return math.prod(sizes) * itemsize


@functools.lru_cache(maxsize=4096)
def _search(
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    shape: tuple[int, ...],
    itemsize: int,
) -> tuple[RedistributeStep, ...]:
    ndim = len(src)
    choices = [tuple(dict.fromkeys((src[m], dst[m], Replicate()))) for m in range(ndim)]
    start = src
    best: dict[tuple[Placement, ...], tuple[int, int]] = {start: (0, 0)}
    counter = 0
    heap: list[tuple[int, int, int, tuple[Placement, ...], tuple[RedistributeStep, ...]]] = [
        (0, 0, counter, start, ())
    ]
    while heap:
        cost, count, _, state, steps = heapq.heappop(heap)
        if state == dst:
            return steps
        if best.get(state, (cost, count)) < (cost, count):
            continue
        local = _local_bytes(state, mesh_shape, shape, itemsize)
        for m in range(ndim):
            for target in choices[m]:
                collective = _collective(state, m, target)
                if collective is None:
                    continue
                nbytes = _bytes(collective, mesh_shape[m], local)
                nxt = (*state[:m], target, *state[m + 1 :])
                key = (cost + nbytes, count + (0 if collective.startswith("local") else 1))
                if nxt in best and best[nxt] <= key:
                    continue
                best[nxt] = key
                counter += 1
                step = RedistributeStep(m, state[m], target, collective, nbytes)
                heapq.heappush(heap, (key[0], key[1], counter, nxt, (*steps, step)))
    raise AssertionError(f"no redistribution plan from {list(src)} to {list(dst)}")  # R is always reachable


def plan_redistribute(src: Layout, dst: Sequence[Placement], itemsize: int = 4) -> RedistributePlan:
    """The cheapest plan from ``src``'s placements to ``dst`` (already normalised) for ``src``'s shape."""
    dst_t = tuple(dst)
    steps = _search(src.placements, dst_t, tuple(src.mesh.shape), src.shape, itemsize)
    return RedistributePlan(src.placements, dst_t, steps)


def explain_redistribute(src: object, dst: object) -> RedistributePlan:
    """The steps ``src.redistribute(placements=dst)`` would run, with collectives and bytes per rank.

    ``src`` is a DTensor or a :class:`Layout`; ``dst`` a placement list, a
    Layout or a DTensor. Nothing is communicated.
    """
    from hp_dtensor.dtensor import DTensor
    from hp_dtensor.layout import normalize_placements

    itemsize = 4
    if isinstance(src, DTensor):
        itemsize = src.element_size()
        src = src._layout
    if not isinstance(src, Layout):
        raise TypeError(f"explain_redistribute: src must be a DTensor or a Layout, got {type(src).__name__}.")
    if isinstance(dst, DTensor):
        dst = dst._layout
    placements = dst.placements if isinstance(dst, Layout) else dst
    if not isinstance(placements, Sequence):
        raise TypeError(f"explain_redistribute: dst must be placements, a Layout or a DTensor, got {dst!r}.")
    normalized = normalize_placements(placements, src.mesh, src.ndim, "explain_redistribute")
    return plan_redistribute(src, normalized, itemsize)

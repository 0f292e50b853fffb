"""Cross-rank agreement: every rank called ``fully_shard`` alike, checked at the first communication.

See [Note: fully_shard agreement] below; the exchange is hp_core's
:func:`~hp_core.verify_across_ranks`. The units are read through the
:class:`Unit` protocol (what :class:`hp_fsdp.state.FSDPState` provides), so
this module sits below the state module that calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Protocol

import torch
from hp_core import verify_across_ranks

from hp_fsdp.param_group import FSDPParamGroup
from hp_fsdp.policies import MixedPrecisionPolicy

__all__ = ["Unit", "check_agreement"]


class Unit(Protocol):
    """What the agreement reads of a unit (an :class:`hp_fsdp.state.FSDPState`)."""

    group: FSDPParamGroup | None
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int | None
    agreed: bool

    @property
    def forward_prefetch(self) -> Sequence[Unit] | None: ...

    @property
    def backward_prefetch(self) -> Sequence[Unit] | None: ...


# [Note: fully_shard agreement]
# Each rank calls ``fully_shard`` on its own copy of the model, and nothing
# stops the copies or the arguments from differing (a rank-dependent branch,
# a config read per host). The units' collectives then disagree: a different
# parameter shape or dtype, ``mp_policy``, ``comm_fusion`` or
# ``shard_placement_fn`` changes the all-gather's size (gloo aborts the
# process, NCCL may hang), a different ``reshard_after_forward`` makes one
# rank all-gather in backward while the other does not (a hang), and a shape
# that pads to the same size (13 rows against 14 over 2 ranks) trains on
# mixed-up data without any error at all.
#
# ``fully_shard`` itself communicates nothing (wrapping order is free; under
# pipeline parallelism stages wrap different numbers of blocks), so the check
# rides on the first moment the units communicate anyway: the root's first
# forward (its lazy init), or an explicit ``unshard()`` / ``reduce_grad()``
# before any forward, before the first all-gather is issued. It cannot ride
# *inside* that all-gather: its size is what a mismatch changes. It is
# hp_core's agreement ([Note: fully_shard agreement] in hp_core.agreement) over
# the units' facts (per parameter its name, global shape, dtype, shard dim,
# replicate and requires_grad; per unit the mesh shape,
# ``reshard_after_forward``, ``mp_policy``, ``comm_fusion`` and the explicit
# prefetch lists), once per root: a 64-byte digest per mesh dim (shard, then
# replicate: a flattened group would be created collectively over the whole
# world and, inside a pipeline stage's first forward, wait for stages blocked
# receiving from it). Only on a mismatch are the facts exchanged, to name the
# first differing value rank by rank; then every rank raises, before any unit
# gathers. The units were already sharded by then, each rank consistently
# with its own arguments. Checks that read local state at that moment
# (prefetch targets under the same root) are decided after the exchange, from
# facts it compared, so they raise on every rank or on none. Flags changed
# after the first forward (``set_requires_gradient_sync`` and the other
# setters) are per-step switches and are not compared.


def _unit_facts(state: Unit, names: dict[int, str]) -> dict[str, Any]:
    """What must agree across ranks for one unit's collectives to match ([Note: fully_shard agreement])."""
    group = state.group

    def target(other: Unit) -> str:
        return names.get(id(other), "<a unit outside this tree>")

    facts: dict[str, Any] = {
        "reshard_after_forward": state.reshard_after_forward,
        **{f"mp_policy.{f.name}": _plain(getattr(state.mp_policy, f.name)) for f in fields(state.mp_policy)},
        "forward_prefetch": None
        if state.forward_prefetch is None
        else [target(t) for t in state.forward_prefetch],
        "backward_prefetch": None
        if state.backward_prefetch is None
        else [target(t) for t in state.backward_prefetch],
    }
    if group is None:
        facts["parameters"] = []
        return facts
    facts["mesh"] = tuple(group.mesh.shape)
    facts["comm_fusion"] = group.comm_fusion
    facts["parameters"] = [
        (
            p.fqn,
            p.global_shape,
            str(p.orig_dtype).removeprefix("torch."),
            "replicate" if p.replicate else f"Shard({p.shard_dim})",
            "requires_grad" if p.sharded_param.requires_grad else "frozen",
        )
        for p in group.params
    ]
    return facts


def _plain(value: Any) -> Any:
    """A dtype as its name (readable in a message, and the same text on every rank)."""
    return str(value) if isinstance(value, torch.dtype) else value


def _describe(values: list[Any], ranks: list[int]) -> str:
    """``value on ranks [..]`` per distinct value, so a large world stays one line per value."""
    by_value: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        by_value.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
    return "; ".join(
        f"{value} on rank{'s' if len(r) > 1 else ''} {r if len(r) > 1 else r[0]}"
        for value, r in by_value.items()
    )


def _first_difference(per_rank: list[list[tuple[str, dict[str, Any]]]], ranks: list[int]) -> str:
    """The first unit / field / parameter where the ranks' facts differ, with every rank's value."""
    unit_lists = [[name for name, _ in units] for units in per_rank]
    if len(set(map(tuple, unit_lists))) > 1:
        return f"the units (fully_shard calls) under this root differ: {_describe(unit_lists, ranks)}"
    for index, (name, _) in enumerate(per_rank[0]):
        facts = [units[index][1] for units in per_rank]
        for key in facts[0]:
            values = [f.get(key) for f in facts]
            if all(v == values[0] for v in values):
                continue
            if key != "parameters":
                return f"unit {name!r}: {key} differs: {_describe(values, ranks)}"
            fqns = [[p[0] for p in v or ()] for v in values]
            if any(f != fqns[0] for f in fqns):
                return f"unit {name!r}: its parameters differ: {_describe(fqns, ranks)}"
            for position, fqn in enumerate(fqns[0]):
                params = [v[position][1:] for v in values if v is not None]
                if any(p != params[0] for p in params):
                    return (
                        f"unit {name!r}: parameter {fqn!r} (shape, dtype, placement, grad) differs: "
                        f"{_describe(params, ranks)}"
                    )
    return "the units' facts differ"  # pragma: no cover - the digests differed, so some fact does


def check_agreement(names: dict[int, str], check: Sequence[Unit]) -> None:
    """Raise on every rank if the ranks built ``check``'s units differently ([Note: fully_shard agreement]).

    ``names`` holds a name, the same on every rank, for every unit of the
    tree by ``id`` (to name the units and their prefetch targets); ``check``
    are the units not compared yet; they are marked agreed on success.
    One 64-byte digest exchange per mesh dim, over the mesh of the first
    unit that has parameters; nothing when no unit communicates.
    """
    meshes = [s.group.mesh for s in check if s.group is not None]
    if not meshes:
        return
    local = [(names[id(s)], _unit_facts(s, names)) for s in check]
    verify_across_ranks(
        local,
        meshes[0],
        what="hp_fsdp: the ranks called fully_shard differently, so the units' collectives would not match "
        "(a hang, an abort, or silently mixed-up data)",
        fix="Call fully_shard on every rank with the same module structure, parameter shapes and dtypes and "
        "the same arguments (compute any rank-dependent choice identically on all ranks first). Detected at "
        "the first communication, before any unit gathered; see [Note: fully_shard agreement] in "
        "hp_fsdp.agreement.",
        explain=_first_difference,
    )
    for state in check:
        state.agreed = True

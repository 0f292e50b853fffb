"""Random fills on DTensors need one generator state on every rank of the mesh: check it, cheaply.

:func:`ensure_rng_agreement` runs at the top of every DTensor random fill; what
it compares, when, and what it costs: [Note: RNG agreement] below.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import hp_core
import torch
from hp_core import DeviceMesh

__all__ = [
    "ensure_rng_agreement",
    "get_rng_agreement_policy",
    "reset_rng_agreement",
    "rng_agreement_policy",
    "set_rng_agreement_policy",
]

# [Note: RNG agreement]
# A DTensor random fill (normal_, uniform_, dropout's bernoulli_, random_, the
# random out= factories, and the out-of-place random ops the replicated
# fallback runs: rand_like, native_dropout, multinomial, ...) draws the whole
# tensor from this rank's default generator and keeps this rank's piece. That
# equals a single process's draw only if every rank of the DTensor's mesh holds
# the same generator state; under torchrun the default seeds differ per rank
# unless the user seeds, and then a Replicate() DTensor holds different values
# on each rank (replicas drift apart over training) and a sharded one is a mix
# of unrelated draws.
#
# So the first fill over a mesh compares a 62-bit digest of (seed, state) over the mesh: one all_reduce(max)
# of two int64s ([h, -h]: the ranks agree when the max equals the min) over the
# world when an n-D mesh spans it, else one per mesh dim longer than 1 (in
# turn: the max over each dim's lines is the max over the mesh), then one host
# read. Only the DTensor's own mesh takes part: pipeline stages on other meshes
# may seed differently on purpose. Every later fill over that mesh looks up one
# set entry on the host: no collective, no host sync. On
# disagreement every rank takes coordinate 0's state (one broadcast per
# exchange above; dim by dim, coordinate 0 along each dim in turn) and a
# warning names the fix, once per process; under the "error" policy every rank
# raises the same error instead.
#
# The decision to check must be the same on every rank, or a rank would wait
# in the exchange for peers that skipped it: "the first random op over this
# mesh" is (every rank runs the same DTensor ops), "the seed changed since the
# last check" is not (after a sync, a per-rank reseed can leave one rank's
# seed equal to the checked one), so reseeds are not re-checked, as torch's
# DTensor syncs once too: seeding every rank alike stays the user's part, and
# reset_rng_agreement() on every rank asks for a new check. A fill given an
# explicit generator= is not checked: the user chose its state.
# Inside torch.compile nothing is checked (a traced graph cannot hold the
# exchange): call ensure_rng_agreement(mesh, device) eagerly before the first
# compiled step, or seed every rank alike.

_POLICIES = ("sync", "error")
_ENV = "HP_DTENSOR_RNG_AGREEMENT"


def _initial_policy() -> str:
    value = os.environ.get(_ENV, "sync").strip().lower() or "sync"
    if value not in _POLICIES:
        raise ValueError(
            f"{_ENV}={value!r} is not an RNG agreement policy; use one of {list(_POLICIES)} "
            "(sync: use mesh coordinate 0's generator state and warn once; error: raise instead)."
        )
    return value


_policy = _initial_policy()
_checked: set[tuple[Any, ...]] = set()  # (mesh identity, device) pairs checked
_warned = False


def set_rng_agreement_policy(policy: str) -> str:
    """Choose what a DTensor random fill does when the mesh's ranks hold different generator states.

    ``"sync"`` (the default): every rank takes mesh coordinate 0's state and
    a warning says so once; ``"error"``: raise ``RuntimeError`` on every rank
    of the mesh (for users who want their seeding fixed, not patched). The
    environment variable ``HP_DTENSOR_RNG_AGREEMENT`` sets the policy at
    import. Returns the previous policy.
    """
    global _policy
    if policy not in _POLICIES:
        raise ValueError(f"set_rng_agreement_policy: {policy!r} is not one of {list(_POLICIES)}.")
    previous, _policy = _policy, policy
    return previous


def get_rng_agreement_policy() -> str:
    """The current RNG agreement policy (see :func:`set_rng_agreement_policy`)."""
    return _policy


@contextlib.contextmanager
def rng_agreement_policy(policy: str) -> Iterator[None]:
    """``with rng_agreement_policy("error"): ...``: the policy inside the block, the old one after."""
    previous = set_rng_agreement_policy(policy)
    try:
        yield
    finally:
        set_rng_agreement_policy(previous)


def reset_rng_agreement() -> None:
    """Forget every check (and the warning given): the next fill on each mesh checks again.

    Call it on every rank of a mesh at once (the next fill there exchanges).
    """
    global _warned
    _checked.clear()
    _warned = False


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator a fill on ``device`` draws from when given none (None: the runtime lists none)."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    if not hasattr(module, "default_generators"):
        return None
    if hasattr(module, "init"):
        module.init()  # default_generators is filled when the device runtime starts
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def _digest(generator: torch.Generator) -> int:
    """A 62-bit digest of the generator's seed and state, the same for equal states on any rank."""
    state = generator.get_state()  # a CPU byte tensor, also for device generators: no sync
    data = generator.initial_seed().to_bytes(8, "little", signed=False) + state.numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _long_dims(mesh: DeviceMesh) -> list[int]:
    return [d for d in range(mesh.ndim) if mesh.size(d) > 1]


def _routes(mesh: DeviceMesh) -> list[tuple[Any, int]]:
    """(group, global rank holding coordinate 0 there) for each exchange the check needs.

    One: the world's group when an n-D mesh spans the whole world, else this
    rank's group along each dim longer than 1 (an n-D slice has no single
    group, and creating one would be a collective over the whole world).
    """
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    long_dims = _long_dims(mesh)
    if len(long_dims) > 1 and mesh.size() == hp_core.get_world_size():
        return [(None, int(mesh.mesh.reshape(-1)[0]))]
    routes = []
    for d in long_dims:
        source = list(coordinate)
        source[d] = 0  # coordinate 0 along d on this rank's line: after every dim, coordinate (0, ..., 0)
        routes.append((mesh.get_group(d), int(mesh.mesh[tuple(source)])))
    return routes


def ensure_rng_agreement(
    mesh: DeviceMesh, device: torch.device, generator: torch.Generator | None = None
) -> None:
    """Make the ranks of ``mesh`` draw alike before a random fill on ``device``; see [Note: RNG agreement].

    Costs a set lookup on the host, except on the first fill over ``mesh``,
    which exchanges a digest over ``mesh`` only. Does nothing for an explicit ``generator``, on a rank
    outside ``mesh``, on meta tensors, while ``torch.compile`` traces, and
    on a device whose runtime lists no default generators.
    """
    if generator is not None or device.type == "meta" or torch.compiler.is_compiling():
        return
    if mesh.get_coordinate() is None or not _long_dims(mesh):
        return
    default = _default_generator(device)
    if default is None:
        return
    key = (mesh.identity, device)
    if key in _checked:
        return
    _check(mesh, device, default)
    _checked.add(key)


def _check(mesh: DeviceMesh, device: torch.device, generator: torch.Generator) -> None:
    """One digest exchange over ``mesh``; on disagreement, coordinate 0's state everywhere or an error."""
    own = _digest(generator)
    both = torch.tensor([own, -own], dtype=torch.int64, device=device)
    routes = _routes(mesh)
    for group, _ in routes:
        hp_core.all_reduce(both, "max", group=group)
    largest, negated_smallest = both.tolist()  # the one host sync, at check time only
    if largest + negated_smallest == 0:
        return
    if _policy == "error":
        raise RuntimeError(
            f"hp_dtensor: a random op on a DTensor over {mesh} found the ranks' random generator states "
            f"different (this rank's seed is {generator.initial_seed()}), so replicated values would "
            "differ between ranks. Call torch.manual_seed(seed) with one seed on every rank of the mesh "
            "before the first random op, or set_rng_agreement_policy('sync') to use mesh coordinate 0's "
            "state on every rank."
        )
    _adopt_coordinate_zero(routes, device, generator)
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"hp_dtensor: the ranks of {mesh} held different random generator states at a random op on a "
            "DTensor (a Replicate() result would differ between ranks); every rank now uses mesh coordinate "
            "0's state. Call torch.manual_seed(seed) with one seed on every rank to choose it yourself "
            "(set_rng_agreement_policy('error') raises instead).",
            stacklevel=4,
        )


def _adopt_coordinate_zero(
    routes: list[tuple[Any, int]], device: torch.device, generator: torch.Generator
) -> None:
    """Broadcast coordinate 0's generator state over each route in turn, then take it."""
    state = generator.get_state().to(device)
    for group, source in routes:
        hp_core.broadcast(state, src=source, group=group)
    generator.set_state(state.cpu())

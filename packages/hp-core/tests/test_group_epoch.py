"""``group_epoch`` and ``mesh_group``: the cheap freshness check hot paths use instead of ``get_group``.

See [Note: group epoch] in ``hp_core.distributed``. The memo must answer like
``DeviceMesh.get_group`` every time: the same group while nothing changed, and
``StaleMeshError`` once the groups were released or the default group was
destroyed and re-created (also behind hp_core's back, with plain torch calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hp_core import DeviceMesh, StaleMeshError, init_device_mesh
from hp_core.distributed import group_epoch, mesh_group
from hp_core.mesh import clear_group_cache


def _count_get_group(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every real ``DeviceMesh.get_group`` call (the memo should make hits skip it)."""
    calls: list[Any] = []
    original: Callable[..., Any] = DeviceMesh.get_group

    def counted(self: DeviceMesh, dim: Any = None) -> Any:
        calls.append(dim)
        return original(self, dim)

    monkeypatch.setattr(DeviceMesh, "get_group", counted)
    return calls


@pytest.mark.distributed(world_size=2)
def test_mesh_group_is_memoised_and_right(rank, world_size, monkeypatch):  # type: ignore[no-untyped-def]
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    expected = {dim: mesh.get_group(dim) for dim in ("dp", "tp", 0, 1)}
    calls = _count_get_group(monkeypatch)
    epoch = group_epoch()
    for _ in range(3):
        for dim, group in expected.items():
            assert mesh_group(mesh, dim) is group
    assert len(calls) == len(expected), f"get_group ran {len(calls)} times for {len(expected)} keys"
    assert group_epoch() == epoch  # nothing changed, so the epoch did not either
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=mesh_group(mesh, "dp"))
    assert t.item() == 3.0
    with pytest.raises(KeyError, match="no dim named 'pp'"):  # errors are get_group's own
        mesh_group(mesh, "pp")


@pytest.mark.distributed(world_size=1)
def test_mesh_group_never_returns_a_released_group(rank, monkeypatch):  # type: ignore[no-untyped-def]
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    assert mesh_group(mesh) is dist.group.WORLD
    epoch = group_epoch()

    # 1. the group cache is cleared (destroy_distributed and the test harness do this)
    clear_group_cache()
    assert group_epoch() != epoch
    with pytest.raises(StaleMeshError, match="build it again with init_device_mesh"):
        mesh_group(mesh)

    # 2. the default group is destroyed and re-created with plain torch calls, bypassing hp_core
    fresh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    old_world = mesh_group(fresh)
    epoch = group_epoch()
    dist.destroy_process_group()
    assert group_epoch() != epoch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert group_epoch() != epoch
    with pytest.raises(StaleMeshError, match="build it again with init_device_mesh"):
        mesh_group(fresh)
    newest = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    group = mesh_group(newest)
    assert group is dist.group.WORLD and group is not old_world
    t = torch.tensor([2.0])
    dist.all_reduce(t, group=group)
    assert t.item() == 2.0


@pytest.mark.distributed(world_size=2)
def test_group_facts_are_memoised_and_never_stale(rank, world_size, monkeypatch):  # type: ignore[no-untyped-def]
    """See [Note: group facts] in ``hp_core._checks``: hits skip torch's lookups, dead groups miss."""
    import hp_core.collectives as hc
    from hp_core._checks import group_facts, resolve_group
    from hp_core.capabilities import capabilities_for

    group = dist.new_group([0, 1])
    facts = group_facts(group)
    assert (facts.rank, facts.size, facts.backend) == (rank, 2, str(dist.get_backend(group)))
    caps = capabilities_for(group)
    calls: list[str] = []
    for name in ("get_rank", "get_world_size", "get_backend"):
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    for _ in range(3):
        assert resolve_group("f", group) is group
        assert group_facts(group) is facts
        assert capabilities_for(group) == caps
    assert calls == [], f"a live group's facts were looked up again: {calls}"
    t = torch.tensor([rank + 1.0])
    assert hc.all_reduce(t, "avg", group=group).item() == 1.5
    monkeypatch.undo()

    # destroyed behind hp_core's back: the memo must not vouch for it any more
    dist.destroy_process_group(group)
    with pytest.raises(ValueError):
        resolve_group("f", group)
    again = dist.new_group([0, 1])
    assert group_facts(again).size == 2 and resolve_group("f", again) is again
    dist.destroy_process_group(again)

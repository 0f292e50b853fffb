"""A rank's ``monkeypatch`` in local mode: its patches are in place only while that rank runs.

Why: [Note: a rank's monkeypatches] (above :class:`RankMonkeyPatch`).
"""

from __future__ import annotations

import os
import pkgutil
import sys
from typing import Any

import pytest

__all__: list[str] = []

_ABSENT = object()  # an attribute or key that is not there


def _read(kind: str, target: Any, name: Any) -> Any:
    if kind == "cwd":
        return os.getcwd()
    if kind == "syspath":
        return list(sys.path)
    if kind == "attr":
        return getattr(target, name, _ABSENT)
    return target.get(name, _ABSENT) if hasattr(target, "get") else target[name]


def _write(kind: str, target: Any, name: Any, value: Any) -> None:
    if kind == "cwd":
        os.chdir(value)
    elif kind == "syspath":
        sys.path[:] = value
    elif kind == "attr":
        if value is _ABSENT:
            if hasattr(target, name):
                delattr(target, name)
        else:
            setattr(target, name, value)
    elif value is _ABSENT:
        target.pop(name, None)
    else:
        target[name] = value


# [Note: a rank's monkeypatches]
# ``monkeypatch.setattr(dist, "new_group", fake)`` patches a module: process
# state. In the multi-process mode each rank patches its own process; in local
# mode every rank shares the module, and rank 0, having patched it, blocks in a
# collective while rank 1, still before its own patch, calls the fake (hp-core's
# test_mesh.py::test_2x2_concatenate_and_permute). Each rank's monkeypatch
# therefore records which (object, name) it touched and, at each switch
# between ranks, takes its values out (putting back what the process had) when
# its rank leaves and puts them in again when its rank enters; the other ranks
# see the unpatched process. ``setenv`` / ``delenv`` go through ``setitem`` /
# ``delitem`` and are covered (each rank owns its whole environment anyway:
# [Note: each rank's environment] in :mod:`hp_testing._local_state`);
# ``chdir`` and ``syspath_prepend`` take the working directory and the whole
# ``sys.path`` out and in the same way (a plain ``os.chdir`` stays shared).
# pytest marks MonkeyPatch final for typing only; a subclass (not a wrapper) is
# what routes its own setenv/delenv through the setitem/delitem below.
class RankMonkeyPatch(pytest.MonkeyPatch):  # type: ignore[misc]
    """``pytest.MonkeyPatch`` whose patches the local world withdraws while another rank runs."""

    def __init__(self) -> None:
        super().__init__()
        self._touched: dict[tuple[str, int, Any], tuple[str, Any, Any]] = {}
        self._base: dict[tuple[str, int, Any], Any] = {}  # the process's values under this rank's
        self._mine: dict[tuple[str, int, Any], Any] = {}  # this rank's values while it is out

    def _touch(self, kind: str, target: Any, name: Any) -> None:
        key = (kind, id(target), name)
        if key not in self._touched:
            self._touched[key] = (kind, target, name)
            self._base[key] = _read(kind, target, name)

    def setattr(self, target: Any, name: Any, value: Any = _ABSENT, raising: bool = True) -> None:
        if value is _ABSENT:  # setattr("package.module.attr", value)
            if not isinstance(target, str):
                raise TypeError(
                    f"monkeypatch.setattr({target!r}, {name!r}): give a value, or a dotted 'module.attr' "
                    "string and the value"
                )
            value, (path, name) = name, target.rsplit(".", 1)
            target = pkgutil.resolve_name(path)
        self._touch("attr", target, name)
        super().setattr(target, name, value, raising=raising)

    def delattr(self, target: Any, name: Any = _ABSENT, raising: bool = True) -> None:
        if name is _ABSENT:  # delattr("package.module.attr")
            path, name = str(target).rsplit(".", 1)
            target = pkgutil.resolve_name(path)
        self._touch("attr", target, name)
        super().delattr(target, name, raising=raising)

    def chdir(self, path: str | os.PathLike[str]) -> None:
        self._touch("cwd", os, "getcwd")
        super().chdir(path)

    def syspath_prepend(self, path: Any) -> None:
        self._touch("syspath", sys, "path")
        super().syspath_prepend(path)

    def setitem(self, dic: Any, name: Any, value: Any) -> None:
        self._touch("item", dic, name)
        super().setitem(dic, name, value)

    def delitem(self, dic: Any, name: Any, raising: bool = True) -> None:
        self._touch("item", dic, name)
        super().delitem(dic, name, raising=raising)

    def withdraw(self) -> None:
        """This rank leaves: keep its values, put the process's back."""
        for key, (kind, target, name) in self._touched.items():
            self._mine[key] = _read(kind, target, name)
            _write(kind, target, name, self._base[key])

    def reapply(self) -> None:
        """This rank enters: note the process's values, put this rank's in."""
        for key, (kind, target, name) in self._touched.items():
            self._base[key] = _read(kind, target, name)
            _write(kind, target, name, self._mine[key])

    def undo(self) -> None:
        super().undo()
        self._touched.clear()
        self._base.clear()
        self._mine.clear()

"""Build every package's wheel and install each one alone in a fresh environment.

This is the repository contract "every package builds a wheel with hatchling
and installs alone with its floor-pinned siblings", checked on every test run:

1. ``python -m build --wheel`` for each package under ``packages/``;
2. for each package, a new virtual environment that sees only a shared
   third-party site (torch, pytest, numpy and what they require) through a
   ``.pth`` file, so torch is not unpacked five times; the site links to the
   project environment's copies when it has exactly the pinned versions (no
   unpacking at all: about 45 s less on a fresh CI clone), else pip installs
   the pins into it; then ``pip install --no-index`` of that package from
   the freshly built wheels only, which fails if a sibling pin cannot be met;
3. every module of the package is imported there, which fails if a package
   reaches into a sibling it does not declare.

Run it with the project's environment active: ``python scripts/check_packaging.py``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import pathlib
import shutil
import subprocess
import sys

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "packaging"
DIST = CACHE / "dist"
THIRD_PARTY = CACHE / "third-party-site"
THIRD_PARTY_PINS = ["torch==2.13.0", "pytest==9.1.1", "numpy==2.4.6"]


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"[packaging] failed: {' '.join(cmd)}")
    return proc


def packages() -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def build_wheels() -> None:
    if DIST.exists():
        shutil.rmtree(DIST)
    for pkg in packages():
        run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(DIST), str(pkg)])
    print(
        f"[packaging] built {len(list(DIST.glob('*.whl')))} wheels: "
        + ", ".join(sorted(w.name for w in DIST.glob("*.whl")))
    )


def third_party_site() -> None:
    linked = _pinned_closure()
    wanted = "\n".join([*THIRD_PARTY_PINS, "linked" if linked else "installed"])
    stamp = THIRD_PARTY / ".pins"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    if THIRD_PARTY.exists():
        shutil.rmtree(THIRD_PARTY)
    if linked:
        THIRD_PARTY.mkdir(parents=True)
        for dist in linked:
            _link_top_levels(dist)
    else:
        run([sys.executable, "-m", "pip", "install", "-q", "--target", str(THIRD_PARTY), *THIRD_PARTY_PINS])
    stamp.write_text(wanted)


def _pinned_closure() -> list[metadata.Distribution]:
    """The pins and everything they require, from this environment; [] unless every pin matches."""
    found: dict[str, metadata.Distribution] = {}
    todo = [Requirement(pin) for pin in THIRD_PARTY_PINS]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return []
        if not req.specifier.contains(dist.version, prereleases=True):
            return []
        found[name] = dist
        for text in dist.requires or []:
            dep = Requirement(text)
            if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                todo.append(dep)
    return list(found.values())


def _link_top_levels(dist: metadata.Distribution) -> None:
    """Link each top-level file or folder of ``dist`` in site-packages (its package, its metadata)."""
    site = pathlib.Path(str(dist.locate_file("")))
    tops = {pathlib.PurePath(f).parts[0] for f in dist.files or []}
    for top in sorted(tops - {"..", "__pycache__"}):
        link = THIRD_PARTY / top
        if not link.exists() and (site / top).exists():
            link.symlink_to(site / top)


def check_alone(pkg: pathlib.Path) -> None:
    meta = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
    name = meta["name"]
    module = name.replace("-", "_")
    env = CACHE / "alone" / name
    if env.exists():
        shutil.rmtree(env)
    run([sys.executable, "-m", "venv", "--without-pip", str(env)])
    py = env / "bin" / "python"
    site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    extra = [Requirement(d) for d in meta["dependencies"] if not d.startswith(("hp-", "torch>", "torch="))]
    sites = [str(THIRD_PARTY)] + ([str(integration_site(name, extra))] if extra else [])
    pathlib.Path(site, "third_party.pth").write_text("\n".join(sites) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-index", "--find-links"]
    if extra:
        # The siblings from the fresh wheels (their floor pins checked), then the package itself
        # without resolving the framework's own requirements (see integration_site).
        siblings_only = sorted({d.split(">")[0].split("=")[0].strip() for d in meta["dependencies"]} - {""})
        run([*pip, str(DIST), *[s for s in siblings_only if s.startswith("hp-")]])
        run([*pip, str(DIST), "--no-deps", name])
    else:
        run([*pip, str(DIST), name])
    names = "sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].startswith('hp-'))"
    installed = run(
        [
            str(py),
            "-c",
            f"import importlib.metadata as m\nprint(' '.join({names}))",
        ]
    ).stdout.split()
    siblings = {d.split(">")[0].split("=")[0].strip() for d in meta["dependencies"] if d.startswith("hp-")}
    expected = sorted({name} | siblings | _transitive(siblings))
    if installed != expected:
        raise SystemExit(f"[packaging] {name} installed {installed}, expected exactly {expected}")
    code = (
        "import importlib, pkgutil\n"
        f"import {module}\n"
        f"mods = [m.name for m in pkgutil.walk_packages({module}.__path__, '{module}.')]\n"
        "[importlib.import_module(m) for m in mods]\n"
        "print(len(mods) + 1)\n"
    )
    count = run([str(py), "-c", code], cwd=str(CACHE)).stdout.strip()
    print(f"[packaging] {name}: installed alone with {expected}; imported {count} modules")


def integration_site(name: str, requirements: list[Requirement]) -> pathlib.Path:
    """A site with the project environment's copies of an integration's framework (hp-torchtitan).

    torchtitan's wheel requires its Trainer's whole stack (datasets,
    tensorboard, wandb, ...), which the project installs without
    (``scripts/requirements-torchtitan.txt``, ``--no-deps``). The package is
    installed alone from its wheel with its hp siblings; the framework and
    whatever of its requirements the environment holds are linked here.
    """
    target = CACHE / "integration-site" / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key in seen or key in {"torch", "numpy", "pytest"}:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue  # a requirement of the framework's Trainer that the project does not install
        files = {pathlib.PurePath(f).parts[0] for f in dist.files or []}
        home = pathlib.Path(str(dist.locate_file("")))
        for top in sorted(files - {"..", "__pycache__"}):
            if not (target / top).exists() and (home / top).exists():
                (target / top).symlink_to(home / top)
        for text in dist.requires or []:
            dep = Requirement(text)
            if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                todo.append(dep)
    return target


def _transitive(names: set[str]) -> set[str]:
    out: set[str] = set()
    for pkg in packages():
        meta = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
        if meta["name"] in names:
            deps = {
                d.split(">")[0].split("=")[0].strip() for d in meta["dependencies"] if d.startswith("hp-")
            }
            out |= deps | _transitive(deps)
    return out


def main() -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    build_wheels()
    third_party_site()
    for pkg in packages():
        check_alone(pkg)


if __name__ == "__main__":
    main()

"""Build every package's wheel and install each one alone in a fresh environment.

This is the repository contract "every package builds a wheel with hatchling
and installs alone with its floor-pinned siblings", checked on every test run:

1. ``python -m build --wheel`` for each package under ``packages/``;
2. for each package, a new virtual environment that sees only a shared
   third-party site (torch, pytest) through a ``.pth`` file, so torch is not
   unpacked five times; then ``pip install --no-index`` of that package from
   the freshly built wheels only, which fails if a sibling pin cannot be met;
3. every module of the package is imported there, which fails if a package
   reaches into a sibling it does not declare.

Run it with the project's environment active: ``python scripts/check_packaging.py``.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import tomllib

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
    stamp = THIRD_PARTY / ".pins"
    if stamp.exists() and stamp.read_text() == "\n".join(THIRD_PARTY_PINS):
        return
    if THIRD_PARTY.exists():
        shutil.rmtree(THIRD_PARTY)
    run([sys.executable, "-m", "pip", "install", "-q", "--target", str(THIRD_PARTY), *THIRD_PARTY_PINS])
    stamp.write_text("\n".join(THIRD_PARTY_PINS))


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
    pathlib.Path(site, "third_party.pth").write_text(str(THIRD_PARTY) + "\n")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(DIST),
            name,
        ]
    )
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

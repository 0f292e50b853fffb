# Shared by scripts/demo.sh and scripts/test.sh: make (or reuse) the project's
# virtual environment in .venv with every package installed editable.
# Sourced, not run: it sets VENV and PY for the caller.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HP_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.hp-installed"

# Re-install when the requirements or any package's metadata changed since the
# last run, so a fresh clone and an old checkout both end up consistent.
want="$(cat "$ROOT"/scripts/requirements-*.txt "$ROOT"/packages/*/pyproject.toml | sha256sum | cut -c1-16)"
# pip's configuration on some machines names local indexes that may be absent;
# its warnings about them are noise, its errors are not (pipefail keeps them).
quiet_pip() { "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

if [ ! -x "$PY" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  base="${HP_PYTHON:-$(command -v python3.11 || command -v python3)}"
  echo "[hp] preparing $VENV with $("$base" --version)" >&2
  "$base" -m venv "$VENV"
  # torch first and pinned exactly: the CPU wheel on this machine's disk.
  # An unpinned torch would pull a CUDA build of several GB.
  quiet_pip install -q --disable-pip-version-check "torch==2.13.0"
  quiet_pip install -q --disable-pip-version-check -r "$ROOT/scripts/requirements-dev.txt"
  quiet_pip install -q --disable-pip-version-check --no-deps -r "$ROOT/scripts/requirements-torchtitan.txt"
  quiet_pip install -q --disable-pip-version-check --no-deps \
    -e "$ROOT/packages/hp-core" -e "$ROOT/packages/hp-dtensor" -e "$ROOT/packages/hp-fsdp" \
    -e "$ROOT/packages/hp-pipeline" -e "$ROOT/packages/hp-testing" -e "$ROOT/packages/hp-torchtitan"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

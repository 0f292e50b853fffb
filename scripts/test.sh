#!/usr/bin/env bash
# Run every package's tests: prepares .venv on first use (Python 3.11, the CPU
# torch wheel, the packages editable), checks that each package builds its
# wheel and installs alone, then runs one pytest session over all packages and the
# cross-package tests (tests/composition) so the pooled rank processes are shared. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
python scripts/check_packaging.py
exec python -m pytest packages tests "$@"

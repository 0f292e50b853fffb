#!/usr/bin/env bash
# On a machine with one CUDA GPU (nothing in CI needs one): NCCL at world size 1, the compiled
# cases (fully_shard per block and whole model, bf16, TP with fullgraph=True) on inductor and
# hp-pipeline's activation swap (ZB-V, pinned host memory, side stream), each against an eager
# copy on the same GPU; prints PASS / FAIL per check and a summary. Under 5
# minutes. Uses the python whose torch has CUDA (PYTHON=..., default python3) and installs the
# packages into it editable, without dependencies.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PY has no CUDA-enabled torch or sees no GPU; set PYTHON= to one that does" >&2
  exit 2
fi
"$PY" -m pip install -q --no-deps -e packages/hp-core -e packages/hp-dtensor -e packages/hp-fsdp \
  -e packages/hp-pipeline -e packages/hp-testing
exec "$PY" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_check.py

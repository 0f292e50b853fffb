#!/usr/bin/env bash
# The main job: train a small transformer LM data-parallel on 4 emulated CPU
# ranks through hp-run, then compare with the same model trained in one process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
exec hp-run -n 4 examples/train_lm.py "$@"

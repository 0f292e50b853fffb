#!/usr/bin/env bash
# The main job: a small Llama-style decoder trained with pipeline x FSDP x tensor parallelism on
# 8 local CPU ranks under emulated NCCL (hp-run checks every collective against NCCL's rules),
# against the same model trained in one process; a DCP checkpoint mid-run, then a resume on a
# different layout (4 ranks) that continues with the same losses. Writes demo-out/.
# With --mpipe, the multimodal variant instead: a vision tower + text decoder on 4 ranks under
# ScheduleMPipe with in-schedule loading against 1F1B with the tower on stage 0 (and one process).
set -euo pipefail
usage() {
  cat <<'TXT'
usage: bash scripts/demo.sh [--backend nccl-emu|hccl-emu|gloo] [--layout PP,DP,TP] [--resume-layout PP,DP,TP]
                            [--schedule NAME] [--steps N] [--save-at N] [--out DIR]
       bash scripts/demo.sh --mpipe [--backend nccl-emu|hccl-emu|gloo] [--steps N] [--out DIR]
  --mpipe          the multimodal variant instead of the 3-D job: a tiny vision tower + text decoder,
                   one pipeline stage per rank on 4 ranks, trained under ScheduleMPipe (the tower
                   spread over the ranks, in-schedule loading) and under 1F1B with the tower on
                   stage 0, both against one process; prints both step times and the dataset bytes
                   each rank read; writes DIR/timeline-mpipe.svg and DIR/mpipe.json
  --backend        what hp-run emulates (default nccl-emu; gloo: no emulation checks)
  --layout         the first run's mesh (default 2,2,2: 8 ranks)
  --resume-layout  the layout that resumes from the checkpoint (default 2,1,2: 4 ranks)
  --schedule       Interleaved1F1B (default), InterleavedZeroBubble, LoopedBFS, ZBVZeroBubble, DualPipeV
  --steps          optimizer steps in all (default 6, both jobs)
  --save-at        the step after which the checkpoint is saved (default 3)
  --out            where the timeline, losses, loss.png and checkpoint go (default demo-out)
Everything else: python examples/llama_3d.py --help (--mpipe: examples/multimodal_mpipe.py --help)
TXT
}
backend=nccl-emu layout=2,2,2 resume_layout=2,1,2 steps=6 save_at=3 out=demo-out schedule=Interleaved1F1B
mpipe=0 only_3d=()  # only_3d: options of the 3-D job that were given (an error with --mpipe)
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --mpipe) mpipe=1; shift ;;
    --backend) backend="$2"; shift 2 ;;
    --layout) layout="$2"; only_3d+=("$1"); shift 2 ;;
    --resume-layout) resume_layout="$2"; only_3d+=("$1"); shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --schedule) schedule="$2"; only_3d+=("$1"); shift 2 ;;
    --save-at) save_at="$2"; only_3d+=("$1"); shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "demo.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$backend" in
  nccl-emu) emulate=(--emulate nccl) ;;
  hccl-emu) emulate=(--emulate hccl) ;;
  gloo) emulate=() ;;
  *) echo "demo.sh: --backend must be nccl-emu, hccl-emu or gloo, got $backend" >&2; exit 2 ;;
esac
if [ "$mpipe" = 1 ] && [ ${#only_3d[@]} -gt 0 ]; then
  echo "demo.sh: ${only_3d[*]}: option(s) of the 3-D job; --mpipe takes only --backend, --steps and --out" >&2
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
if [ "$mpipe" = 1 ]; then
  echo "== multimodal: ScheduleMPipe (in-schedule loading) against 1F1B with the tower on stage 0, 4 ranks, $backend, against one process"
  hp-run -n 4 "${emulate[@]}" examples/multimodal_mpipe.py --steps "$steps" --out "$out"
  echo "files: $out/timeline-mpipe.svg (MPipe's order), $out/mpipe.json (losses, step times, bytes read)"
  exit 0
fi
ranks() { local IFS=,; set -- $1; echo $(( $1 * $2 * $3 )); }
rm -rf "$out/checkpoint"
echo "== pipeline x FSDP x TP on $(ranks "$layout") ranks (pp,dp,tp = $layout), $backend, against one process"
hp-run -n "$(ranks "$layout")" "${emulate[@]}" examples/llama_3d.py \
  --layout "$layout" --steps "$steps" --save-at "$save_at" --out "$out" --schedule "$schedule"
echo "== resume from the checkpoint on $(ranks "$resume_layout") ranks (pp,dp,tp = $resume_layout)"
hp-run -n "$(ranks "$resume_layout")" "${emulate[@]}" examples/llama_3d.py \
  --layout "$resume_layout" --steps "$steps" --resume "$out/checkpoint" --out "$out" --schedule "$schedule"
echo "== summary"
python examples/demo_report.py "$out"
echo "files: $out/timeline-pp*.svg (the schedule), $out/loss.png, $out/checkpoint/, $out/losses-*.json"

#!/usr/bin/env bash
# Issue 40 on two GPUs of one host (NCCL, one process per GPU, NVLink multicast off), by stage:
#   bash perf/two_gpu.sh [OUTDIR] STAGE...     (OUTDIR default $OUT, else perf/results/two_gpu)
# Stages (one 10-minute device call runs cp and train-fa4, the next train-flamia; compare runs anywhere):
#   cp            perf/two_gpu_cp.py: context-parallel forward+backward at world size 2 on 1x64k and 2x32k
#                 (H=16, D=128) against world size 1, leakage across the rank boundary, time against FA4 bf16
#                 in the same all-gather wrapper (~3 min)
#   train-fa4     train/ with FSDP2 at world size 2, FA4, 300 steps of 16,384-token documents (~5 min)
#   train-flamia  the same with the FP8 default recipe on the kernels (~5 min)
#   compare       train.run --compare: the loss curves overlaid (PNG kept), tokens/s and peak memory per GPU;
#                 it needs both runs' files in OUTDIR: with one call per training run (each call's $OUT starts
#                 empty), run it afterwards on any machine over the fetched files (it needs no GPU)
# NPROC (default 2), STEPS (300), DOC_TOKENS (16384), TOKENS_PER_STEP (65536 per rank), SEED (0).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
cd "$(dirname "$0")/.."
DIR=${OUT:-perf/results/two_gpu}
if [ $# -gt 0 ] && [[ $1 != cp && $1 != train-* && $1 != compare ]]; then DIR=$1; shift; fi
mkdir -p "$DIR"
[ -f /root/gpu-bundle/env.sh ] && . /root/gpu-bundle/env.sh
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
NPROC=${NPROC:-2}
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
COMMIT=${FLAMIA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
{ echo "- $(date -u '+%F %H:%M UTC'), commit $COMMIT, stages: $*"
  echo "- GPUs: $(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>&1 | paste -sd';')"; } >> "$DIR/MANIFEST.md"
TRAIN=(-m train.run --fsdp --preset llama_125m --steps "${STEPS:-300}" --timing-warmup 10
       --tokens-per-step "${TOKENS_PER_STEP:-65536}" --doc-tokens "${DOC_TOKENS:-16384}" --seed "${SEED:-0}"
       --eval-every 50 --eval-batches 2 --leak-samples 0 --log-every 10 --out "$DIR")
rc=0
step() {  # step NAME LIMIT CMD...: its output in $DIR/NAME.log, the command and rc in MANIFEST.md
  local name=$1 limit=$2; shift 2; echo "=== $name: $*"
  timeout "$limit" "$@" > "$DIR/$name.log" 2>&1; local r=$?; tail -20 "$DIR/$name.log"
  printf -- '- `%s` -> `%s.log`, rc %s\n' "$*" "$name" "$r" >> "$DIR/MANIFEST.md"; echo "=== $name rc=$r"
  [ $r -ne 0 ] && rc=1; }
for stage in "$@"; do
  case $stage in
    cp) step cp 400 "${RUN[@]}" perf/two_gpu_cp.py --out "$DIR" ;;
    train-fa4) step train_fa4 560 "${RUN[@]}" "${TRAIN[@]}" --attention fa4 ;;
    train-flamia) step train_flamia 560 "${RUN[@]}" "${TRAIN[@]}" --attention flamia --recipe fp8_tokenblock_dsbf16 --backend cute ;;
    compare) step compare 120 "$PY" -m train.run --compare "$DIR" ;;
    *) echo "unknown stage $stage (cp, train-fa4, train-flamia, compare)"; rc=2 ;;
  esac
done
exit $rc

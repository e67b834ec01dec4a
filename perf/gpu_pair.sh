#!/usr/bin/env bash
# One device call on a 2-GPU machine: GPU 0 runs the stages in $GPU0, GPU 1 those in $GPU1, at once
# (separate logs under $OUT/g0 and $OUT/g1; training runs share $OUT/train). Everything comes back as
# ONE archive, $OUT/all.tgz (the device tool returns at most 8 files), plus both session logs.
#   GPU0="setup fwd-tests-all" GPU1="train" TRAIN_WHAT=fa4 OUT=$OUT bash perf/gpu_pair.sh
set -uo pipefail
. /root/gpu-bundle/env.sh
python3 -c "import flamia_cute.quant" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . \
  >"$OUT/pip.log" 2>&1
export TRAIN_DIR=${TRAIN_DIR:-$OUT/train}
mkdir -p "$OUT/g0" "$OUT/g1" "$TRAIN_DIR"
# each side stops at PAIR_LIMIT seconds so the archive is written inside the device call's 600 s
lim=${PAIR_LIMIT:-575}
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1 TRAIN_WHAT=${TRAIN_WHAT1:-${TRAIN_WHAT:-}} timeout "$lim" bash perf/gpu_session.sh ${GPU1:-} \
  > "$OUT/g1/console.log" 2>&1) &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0 TRAIN_WHAT=${TRAIN_WHAT0:-${TRAIN_WHAT:-}} timeout "$lim" bash perf/gpu_session.sh ${GPU0:-} \
  2>&1 | tail -60
wait
echo "=== g1 console tail"; tail -30 "$OUT/g1/console.log"
cp "$OUT/g0/session.log" "$OUT/session_g0.log" 2>/dev/null; cp "$OUT/g1/session.log" "$OUT/session_g1.log" 2>/dev/null
tar czf /tmp/all.tgz -C "$OUT" --exclude='*.ncu-rep' g0 g1 "$(basename "$TRAIN_DIR")" 2>/dev/null
rm -rf "$OUT/g0" "$OUT/g1" "$TRAIN_DIR"; mv /tmp/all.tgz "$OUT/all.tgz"; ls -la "$OUT"

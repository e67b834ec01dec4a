#!/usr/bin/env bash
# Long-context training step, FA4 (bf16) against ours (the default FP8 recipe), in one run: the train/
# model (llama_125m, 6 heads of 128) on 16,384-token documents (consecutive corpus files concatenated,
# train.run --doc-tokens), 65,536 tokens a step (four documents), the same seed, data and weights.
# Reports the median tokens/s after a timing warm-up (compiles, allocator) and the peak memory of a
# training step (torch.cuda.max_memory_allocated: the largest over the steps, and that peak over what a
# step starts with: weights, optimizer state, the batch), then train.run --compare's table.
# Usage: bash perf/train_long.sh [OUTDIR]   (default $OUT, else perf/results/train_long)
# STEPS (default 40), TIMING_WARMUP (10), DOC_TOKENS (16384), TOKENS_PER_STEP (65536), SEED (0),
# WHAT ("fa4 flamia"), TRAIN_LIMIT (seconds per run, 300), TRAIN_BUDGET (seconds for all runs: the runs left
# share what is left of it, so no run outlives a caller's time limit). About 1.5 min on one H200 (two runs of
# ~40 s, each with its compiles).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
cd "$(dirname "$0")/.."
DIR=${1:-${OUT:-perf/results/train_long}}
mkdir -p "$DIR"
[ -f /root/gpu-bundle/env.sh ] && . /root/gpu-bundle/env.sh
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
COMMON=(--preset llama_125m --steps "${STEPS:-40}" --timing-warmup "${TIMING_WARMUP:-10}"
        --tokens-per-step "${TOKENS_PER_STEP:-65536}" --doc-tokens "${DOC_TOKENS:-16384}" --seed "${SEED:-0}"
        --eval-every 0 --eval-batches 1 --leak-samples 0 --log-every 10 --out "$DIR")
rc=0
RUNS=(${WHAT:-fa4 flamia}); END=$((SECONDS + ${TRAIN_BUDGET:-100000}))
for i in "${!RUNS[@]}"; do
  what=${RUNS[$i]}
  lim=$(( (END - SECONDS - 10) / (${#RUNS[@]} - i) )); (( lim > ${TRAIN_LIMIT:-300} )) && lim=${TRAIN_LIMIT:-300}
  case $what in
    fa4) args=(--attention fa4);;
    flamia) args=(--attention flamia --recipe fp8_tokenblock_dsbf16 --backend cute);;
    *) echo "WHAT: fa4 and/or flamia"; exit 2;;
  esac
  echo "=== $what: $PY -m train.run ${args[*]} ${COMMON[*]}"
  (( lim < 20 )) && { echo "=== $what: no time left in TRAIN_BUDGET"; rc=1; continue; }
  timeout -k 10 "$lim" "$PY" -m train.run "${args[@]}" "${COMMON[@]}" 2>&1
  r=$?; echo "=== $what rc=$r"
  [ $r -ne 0 ] && rc=1  # a run that fails (FA4 not importable, ...) is reported; the other still runs
done
"$PY" -m train.run --compare "$DIR" 2>&1 | tee "$DIR/compare.txt"
rm -f "$DIR"/*.png  # the loss curves of 40 steps say nothing; the device returns 8 files at most
"$PY" - "$DIR" <<'EOF' 2>&1 | tee -a "$DIR/compare.txt"
import glob, json, sys
runs = {}
for p in glob.glob(f"{sys.argv[1]}/*.summary.json"):
    s = json.load(open(p))
    runs[s["attention"]["kind"]] = s
print()
print(f"{'attention':10s} {'tokens/s':>10s} {'step ms':>8s} {'attn ms':>8s} {'peak MiB':>9s} {'step MiB':>9s} {'final loss':>10s}")
for kind in ("fa4", "flamia"):
    s = runs.get(kind)
    if s is None:
        print(f"{kind:10s} (no run)")
        continue
    t = s["throughput"]
    f = lambda x, w, p=0: f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}s}"
    print(f"{kind:10s} {f(t['tokens_per_s'], 10)} {f(t['step_ms'], 8, 1)} {f(t['attn_ms'], 8, 1)} "
          f"{f(t['peak_mem_mb'], 9)} {f(t['step_mem_mb'], 9)} {f(s['final_train_loss'], 10, 4)}")
if "fa4" in runs and "flamia" in runs:
    a, b = runs["fa4"]["throughput"], runs["flamia"]["throughput"]
    print(f"ours / FA4: tokens/s {b['tokens_per_s'] / a['tokens_per_s']:.3f}x, step peak "
          f"{(b['step_mem_mb'] or 0) - (a['step_mem_mb'] or 0):+.0f} MiB ({runs['flamia']['doc_tokens']}-token documents, "
          f"{runs['flamia']['tokens_per_step']} tokens a step, median of {b['timed_steps']} steps)")
EOF
exit $rc

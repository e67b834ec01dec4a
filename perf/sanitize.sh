#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on every shipping sm_90a kernel, tiny odd packs
# (perf/sanitize_driver.py says which). Usage: bash perf/sanitize.sh [OUTDIR]   (default $OUT, else
# perf/results/sanitize). Writes one log per step and summary.txt (each tool's exit code and its
# "ERROR SUMMARY" line); exits 0 when every tool reported 0 errors and the planted error was caught.
# Steps: a plain run (compiles every kernel into the disk cache, so that no run under a tool compiles),
# the planted out-of-bounds write under memcheck (must fail: a memcheck that reports nothing there
# checks nothing), then memcheck (all cases, PyTorch's caching allocator off so that each tensor is its
# own allocation and an overrun past its end is seen), racecheck and synccheck (the small set).
# SANITIZE_STEPS: which steps (default "warmup control memcheck racecheck synccheck"; the disk cache
# of FLAMIA_CUTE_CACHE_DIR keeps the warm-up's kernels for a later call); SANITIZE_LIMIT: seconds per step (300);
# SANITIZE_BUDGET: seconds for all steps together (560); WARMUP_SET: the warm-up's kernel set (full, or small
# for racecheck and synccheck alone).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
cd "$(dirname "$0")/.."
DIR=${1:-${OUT:-perf/results/sanitize}}
mkdir -p "$DIR"
LIMIT=${SANITIZE_LIMIT:-300}
export PYTHONUNBUFFERED=1
[ -f /root/gpu-bundle/env.sh ] && . /root/gpu-bundle/env.sh
SAN=$(command -v compute-sanitizer || true)
for c in "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer \
         /usr/local/cuda-*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer \
         /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
  [ -z "$SAN" ] && [ -x "$c" ] && SAN=$c
done
SUMMARY="$DIR/summary.txt"
{ echo "# compute-sanitizer on the sm_90a kernels ($(date -u '+%F %H:%M UTC'))"
  echo "commit: ${FLAMIA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
  echo "sanitizer: ${SAN:-NOT FOUND} $([ -n "$SAN" ] && "$SAN" --version 2>&1 | grep -i version | head -1)"
  echo "steps: ${SANITIZE_STEPS:-warmup control memcheck racecheck synccheck}"; echo; } >> "$SUMMARY"
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*)" | tee -a "$SUMMARY"; exit 2; fi
fail=0
END=$((SECONDS + ${SANITIZE_BUDGET:-560}))  # every step together (one device call is 600 s)
STEPS=" ${SANITIZE_STEPS:-warmup control memcheck racecheck synccheck} "
step() {  # step NAME EXPECT(pass|fail) CMD...: the command under a time limit, its log, its line in summary.txt
  local name=$1 expect=$2; shift 2
  [[ $STEPS == *" ${name%%_*} "* ]] || return 0
  local t0=$SECONDS lim=$LIMIT
  # never past the script's budget: an outer timeout kills only bash, and the sanitizer would run on orphaned
  (( END - SECONDS < lim )) && lim=$(( END - SECONDS ))
  (( lim < 10 )) && { echo "$name: no time left in SANITIZE_BUDGET" | tee -a "$SUMMARY"; fail=1; return 0; }
  echo "=== $name: $*"
  timeout -k 15 "$lim" "$@" > "$DIR/$name.log" 2>&1; local rc=$?
  local errs; errs=$(grep -hE "(ERROR|RACECHECK) SUMMARY" "$DIR/$name.log" | sed "s/^=* *//" | paste -sd";" -)
  local verdict=ok
  if [ "$expect" = pass ] && [ "$rc" -ne 0 ]; then verdict=FAILED; fail=1; fi
  if [ "$expect" = fail ] && { [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then verdict="FAILED (the planted error was not reported)"; fail=1; fi
  [ "$rc" -eq 137 ] && rc=124  # killed after the grace period: a timeout too
  # cut short: how far it got (the driver runs its cases cover first: see its first line for how many launch
  # every kernel), and no tool report so far is in errs above
  [ "$rc" -eq 124 ] && verdict="$verdict (timed out after ${lim} s; $(grep -oE '^\[[0-9]+/[0-9]+\]' "$DIR/$name.log" | tail -1 | tr -d '[]' || true) cases ran)"
  printf '%-10s rc %-3s %4d s  %s  %s\n' "$name" "$rc" $((SECONDS - t0)) "${errs:-(no ERROR SUMMARY line)}" "$verdict" | tee -a "$SUMMARY"
  grep -m5 -E "Error:|Barrier error|Invalid|Race reported|hazard" "$DIR/$name.log" | sed 's/^/    /' >> "$SUMMARY"
  tail -5 "$DIR/$name.log"
}
DRIVER=("${PYTHON:-python3}" perf/sanitize_driver.py)
# CUDA API calls that fail are not what the tools are here for: the DSL's cuda-python layer probes driver
# entry points that fail by design, and they would count in ERROR SUMMARY (a real API failure raises in torch)
SANX=(--report-api-errors no --error-exitcode 1)
step warmup pass "${DRIVER[@]}" --set "${WARMUP_SET:-full}" --compile-ahead
step control_oob fail env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool memcheck "${SANX[@]}" "${DRIVER[@]}" --control oob
[[ $STEPS != *" control "* ]] || grep -q "Invalid __global__ write" "$DIR/control_oob.log" || { echo "control_oob: no 'Invalid __global__ write' in the log" | tee -a "$SUMMARY"; fail=1; }
step memcheck pass env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool memcheck "${SANX[@]}" "${DRIVER[@]}" --set full
step racecheck pass "$SAN" --tool racecheck "${SANX[@]}" "${DRIVER[@]}" --set small
step synccheck pass "$SAN" --tool synccheck "${SANX[@]}" "${DRIVER[@]}" --set small
echo "result: $([ $fail = 0 ] && echo 'all clean' || echo FAILED)" | tee -a "$SUMMARY"
exit $fail

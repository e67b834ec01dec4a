#!/usr/bin/env bash
# Blackwell acceptance, one command for whoever first holds a B200/B300: bash perf/blackwell_acceptance.sh
# Runs the sm100 tests, the leakage checks through the API (FLAMIA_CUTE_SM100=1, recipe mxfp8), the MX
# quantizations' tests (the forward's Q/K/V, the backward's dO) and the forward side by side with FA4 bf16 and
# cuDNN FP8. Writes acceptance.log and acceptance.csv (each check's status, then the bench rows) to $OUT, else
# perf/results/<date>-blackwell-acceptance/.
# On another GPU the Blackwell parts skip, saying so. WORKLOADS: the bench's --only (default: every workload).
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f /root/gpu-bundle/env.sh ] && . /root/gpu-bundle/env.sh
PY=${PYTHON:-python3}
$PY -c "import flamia_cute.quant" 2>/dev/null || { echo "install the package first: $PY -m pip install -e ." >&2; exit 2; }
R=${OUT:-perf/results/$(date -u +%F)-blackwell-acceptance}; mkdir -p "$R"
STEPS=$R/.steps.csv; BENCH=$R/.bench; echo "step,status,seconds,detail" > "$STEPS"
exec > >(tee "$R/acceptance.log") 2>&1
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name() + ' sm_%d%d' % torch.cuda.get_device_capability()
              if torch.cuda.is_available() else 'no GPU')")
BW=$($PY -c "import torch; print(int(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10))")
echo "== $(date -u '+%F %H:%M UTC') on $GPU, commit ${FLAMIA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
[ "$BW" = 1 ] && export FLAMIA_CUTE_SM100=1  # the opt-in to the kernels that have never run on hardware

step() {  # step NAME BLACKWELL_ONLY CMD...: run CMD (off Blackwell skip it if BLACKWELL_ONLY), record its status
  local name=$1 bw_only=$2 t0=$SECONDS; shift 2; echo; echo "== $name: $*"
  if [ "$bw_only" = 1 ] && [ "$BW" != 1 ]; then
    echo "SKIPPED: needs a Blackwell (sm_100) GPU; this is $GPU"; echo "$name,skipped,0,needs a Blackwell GPU" >> "$STEPS"
    return; fi
  "$@"; local rc=$?; echo "$name,$([ $rc = 0 ] && echo pass || echo FAIL),$((SECONDS - t0)),rc $rc" >> "$STEPS"; }

step sm100_tests 1 $PY -m pytest -q -p no:cacheprovider -m sm100 tests
step sm100_files 1 $PY -m pytest -q -p no:cacheprovider tests/test_attention_fwd_sm100.py tests/test_dispatch.py
step mx_quantize 0 $PY -m pytest -q -p no:cacheprovider tests/test_quantize_mx_kernel.py tests/test_quantize_do_mx.py
step leakage_api 1 $PY - <<'EOF'
from flamia_cute.testing import attention_fn_for, check_leakage, make_inputs
q, k, v, do, cu, scale = make_inputs([1000, 1, 0, 517, 4096, 33, 129], 2, 2, 128, device="cuda", seed=4)
ok = True
for cut in (None, 128, 129, 1001):  # backend 'cute': the sm_100a forward or an error, never the emulator
    rep = check_leakage(attention_fn_for("mxfp8", scale, backend="cute"), q, k, v, cu, do, doc=4, cut=cut)
    print(f"mxfp8 on the sm_100a forward, cut {cut}: {rep}"); ok &= rep.ok
ctl = check_leakage(attention_fn_for("mxfp8_unsafe", scale, backend="emulate"), q, k, v, cu, do, doc=4, cut=173)
print(f"control mxfp8_unsafe (emulator) must leak: {ctl}"); raise SystemExit(0 if ok and not ctl.ok else 1)
EOF
step bench 0 $PY -m flamia_cute.cli bench --recipe mxfp8 --impls flamia,fa4,cudnn --modes fwd \
  ${WORKLOADS:+--only $WORKLOADS} --out "$BENCH"  # off Blackwell the flamia_mxfp8 column skips: no kernel there
for miss in "fa4_fp8_fwd:flash_attn.cute" "cudnn_mxfp8:cudnn"; do  # baselines the bench has no column for yet
  have=$($PY -c "import ${miss#*:}" 2>/dev/null && echo importable || echo "not importable")
  echo "SKIPPED ${miss%%:*}: flamia_cute.bench has no column for it yet (${miss#*:} $have)"
  echo "${miss%%:*},skipped,0,no bench column yet; ${miss#*:} $have" >> "$STEPS"; done
$PY - "$R" <<'EOF'
import glob, sys, pandas as pd
r = sys.argv[1]
parts = [pd.read_csv(f"{r}/.steps.csv")] + [pd.read_csv(f).assign(step="bench") for f in glob.glob(f"{r}/.bench/*.csv")]
pd.concat(parts, ignore_index=True).to_csv(f"{r}/acceptance.csv", index=False)
EOF
rm -rf "$STEPS" "$BENCH"; echo; echo "== wrote $R/acceptance.log and $R/acceptance.csv"; head -12 "$R/acceptance.csv"
! grep -q ",FAIL," "$R/acceptance.csv"

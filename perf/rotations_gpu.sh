#!/usr/bin/env bash
# The GPU runs of the rotations (issue: RoPE fused into the quantization, the Hadamard recipe), on one
# H200 with flash-attn-4: logs and CSVs under $OUT (default perf/out/rotations). About 12 minutes from
# a cold compile cache, most of it compiles; set STAGES to run a subset (tests layer accuracy passes;
# "tests accuracy" and "layer passes" take about 6 minutes each).
set -uo pipefail
OUT="${OUT:-perf/out/rotations}"
STAGES="${STAGES:-tests layer accuracy passes}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
rc=0
for stage in $STAGES; do
  case "$stage" in
    tests)   # the rotations' GPU tests, and the compiled path with rotary
      $PY -m pytest -q -n "${GPU_WORKERS:-8}" -m gpu tests/test_rotary.py \
        "tests/test_custom_op.py::test_compile_fullgraph_inductor_cute_with_rotary" 2>&1 | tee "$OUT/tests.log" \
        || rc=1 ;;
    layer)   # RoPE + attention forward and backward, ours fused against FA4 + RoPE, plain calls beside them
      $PY -m flamia_cute.cli bench --only 16x1k,1x16k --layer --impls flamia,fa4 --modes fwd,fwdbwd \
        --recipe fp8_tokenblock_dsbf16,fp8_tokenblock_hadamard --sustain 3 --graph --out "$OUT/layer" \
        2>&1 | tee "$OUT/layer.log" || rc=1 ;;
    accuracy)  # the recipes against fp64 on the kernels (backend cute), without and with RoPE
      $PY -m flamia_cute.cli accuracy --recipes fp8_tokenblock_dsbf16,fp8_tokenblock_hadamard --device cuda \
        --backend cute --json "$OUT/accuracy_kernels.json" 2>&1 | tee "$OUT/accuracy_kernels.log" || rc=1
      $PY -m flamia_cute.cli accuracy --recipes fp8_tokenblock_dsbf16,fp8_tokenblock_hadamard --device cuda \
        --backend cute --rotary 10000 --json "$OUT/accuracy_kernels_rope.json" 2>&1 \
        | tee "$OUT/accuracy_kernels_rope.log" || rc=1 ;;
    passes)  # the quantization launch and the dQ conversion with each rotation, per launch bound
      $PY perf/bench_rotations.py "$OUT" 2>&1 | tee "$OUT/passes.log" || rc=1 ;;
    train)   # not in the default STAGES: 1,000 steps of train/ with the fused RoPE (~6 min of GPU time per run,
             # perf/results/2026-11-30-training's command), and FA4 bf16's at this commit with TRAIN_FA4=1
      for att in flamia ${TRAIN_FA4:+fa4}; do
        $PY -m train.run --attention "$att" --recipe "${TRAIN_RECIPE:-fp8_tokenblock_dsbf16}" --preset llama_125m \
          --steps 1000 --tokens-per-step 65536 --max-doc-tokens 4096 --seed 0 --eval-every 100 --leak-samples 128 \
          --log-every 50 --out "$OUT/train" 2>&1 | tee "$OUT/train_$att.log" || rc=1
      done
      $PY -m train.run --compare "$OUT/train" 2>&1 | tee "$OUT/train_compare.log" ;;
    *) echo "unknown stage $stage (tests layer accuracy passes train)" >&2; rc=2 ;;
  esac
done
exit $rc

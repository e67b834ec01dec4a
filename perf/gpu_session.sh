#!/usr/bin/env bash
# Everything one device-tool call runs, by stage: bash perf/gpu_session.sh STAGE...
# Stages: see the case below (setup first; bench-main is the side-by-side fwd/bwd/fwdbwd run).
# Logs go to $OUT (at most 8 files come back).
set -uo pipefail
OUT=${OUT:-/tmp/flamia-out}
mkdir -p "$OUT"
. /root/gpu-bundle/env.sh
export FLAMIA_CUTE_CACHE_DIR=/tmp/flamia_cache PYTHONUNBUFFERED=1
if ! python3 -c "import flamia_cute.quant" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || {
    echo "editable install failed; linking sub-packages instead" | tee -a "$OUT/pip.log"
    ln -sfn ../quant flamia_cute/quant && ln -sfn ../schedules flamia_cute/schedules
    export PYTHONPATH=$PWD:$PYTHONPATH
  }
fi
run() { local name=$1 limit=$2; shift 2; echo "=== $name" | tee -a "$OUT/session.log"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40; echo "=== $name rc=${PIPESTATUS[0]}" | tee -a "$OUT/session.log"; }
# ncu --set full of one kernel per workload: TAG (file names), REGEX (kernel name), WHAT (profile_kernels.py's
# first argument), WORKLOAD...; the details page and the per-SASS-address stall samples come back
ncu_kernel() { local tag=$1 regex=$2 what=$3; shift 3
  for wl in "$@"; do
    run ncu_${tag}_$wl 240 ncu -k regex:"$regex" --launch-skip 1 --launch-count 1 --set full --import-source no \
      -o "$OUT/${tag}_$wl" -f python3 perf/profile_kernels.py "$what" "$wl"
    ncu -i "$OUT/${tag}_$wl.ncu-rep" --page details > "$OUT/ncu_${tag}_${wl}_details.txt" 2>&1
    ncu -i "$OUT/${tag}_$wl.ncu-rep" --page source --print-source sass --csv 2>/dev/null | gzip > "$OUT/ncu_${tag}_${wl}_sass.csv.gz"
    rm -f "$OUT/${tag}_$wl.ncu-rep"
  done; }
# dq_first_store with its fences traced as nothing, against the zero-filled default (perf/experiments)
first_store_fences() { mkdir -p "$OUT/fences"
  run ds_first_store_fences 300 env OUT="$OUT/fences" BREAKDOWN_WORKLOADS="${FENCE_WORKLOADS:-1x16k,1x64k,4x4k}" \
    python3 perf/experiments/dq_first_store_fences.py; }
# a mutant run: NAME FILE SED_EXPR GREP_MARK K_EXPR TEST_FILE. The kernel file patched by sed (the count of
# GREP_MARK lines goes to NAME_applied.txt: 0 means the patch missed), the tests run (they must fail), the
# file restored
mutant_run() { local name=$1 file=$2 expr=$3 mark=$4 k=$5 tests=$6
  cp "$file" "/tmp/${name}_keep.py"; sed -i "$expr" "$file"
  grep -c "$mark" "$file" | tee "$OUT/${name}_applied.txt"
  run "$name" 300 python3 -m pytest -q -m gpu -p no:cacheprovider "$tests" -k "$k"
  cp "/tmp/${name}_keep.py" "$file"; }
# the forward kernel alone per build variant (bench_fwd_breakdown's labels), rotated over three rounds
fwd_rounds() { run "$1" 400 env OUT="$OUT" BREAKDOWN_ONLY=fwd BREAKDOWN_ROUNDS=3 BREAKDOWN_DS_VARIANTS="$2" \
  python3 perf/bench_fwd_breakdown.py; }
for stage in "$@"; do
  case $stage in
    setup) nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/env.txt"
           python3 -c "import torch, cutlass; print(torch.__version__, cutlass.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.txt" ;;
    quant-tests) run quant_tests 460 python3 -m pytest -q -x -m gpu tests/test_quantize_kernel.py ;;
    quant-bench) run quant_bench 240 env OUT="$OUT" python3 perf/bench_quantize.py ;;
    fwd-tests) run fwd_tests 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py ${FWD_TESTS_K:+-k "$FWD_TESTS_K"} ;;
    gpu-tests) run gpu_tests 450 python3 -m pytest -q -m gpu -p no:cacheprovider ;;
    bench-smoke) run bench_smoke 240 python3 -m flamia_cute.cli bench --only 1x16k,16x1k --modes fwd,fwdbwd \
                   --reps 10 --out "$OUT" ;;
    bench) run bench 540 python3 -m flamia_cute.cli bench --modes fwd,bwd,fwdbwd --out "$OUT" ;;
    bench-fwd) run bench_fwd 420 python3 -m flamia_cute.cli bench --modes fwd --impls flamia,fa4,cudnn --reps 20 \
                 --out "$OUT" ;;
    bench-main) run bench_main 480 python3 -m flamia_cute.cli bench --modes fwd,bwd,fwdbwd --impls flamia,fa4,cudnn \
                  --reps 15 --out "$OUT" ;;
    bench-gputime) run bench_gputime 480 python3 -m flamia_cute.cli bench --modes fwd,bwd,fwdbwd --impls flamia,fa4,cudnn \
                  --reps 15 --gpu-time --out "$OUT/gputime" ;;
    bench-det)  # the deterministic backward's cost (issue 5): GPU time of bwd and fwd+bwd, ours only
      run bench_det 300 env FLAMIA_CUTE_DETERMINISTIC=1 python3 -m flamia_cute.cli bench --modes bwd,fwdbwd \
        --impls flamia --reps 15 --gpu-time --out "$OUT/det" ;;
    align-experiment)  # issue 3 hypothesis: data_dt documents at 16-column starts split 32-byte sectors
      for a in 32 128 16; do  # ends on 16: the committed layout
        sed -i "s/^DT_DOC_ALIGN = .*/DT_DOC_ALIGN = $a/" quant/quantize.py
        run "quant_tests_align$a" 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_quantize_kernel.py -k qkv
        run "quant_bench_align$a" 200 env OUT="$OUT/align$a" python3 perf/bench_quantize.py
      done ;;
    tune-test) run tune_test 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tuning.py ;;
    tune) run tune 420 python3 -m flamia_cute.cli tune --only 1x16k,16x1k,longtail32k --reps 10 ;;
    demo) run demo 240 python3 -m flamia_cute ;;
    train-smoke)  # issue 8 pipeline on the GPU: short runs (TRAIN_STEPS, default 200), same seed and data
      steps=${TRAIN_STEPS:-200}; each=${TRAIN_SECONDS:-85}
      common="--preset llama_125m --steps $steps --tokens-per-step 65536 --max-doc-tokens 4096 --seed 0 \
        --eval-every 50 --leak-samples 32 --log-every 25 --out $OUT/train"
      run train_fa4 "$each" python3 -m train.run --attention fa4 $common
      run train_fp8 "$each" python3 -m train.run --attention flamia --recipe fp8_tokenblock $common
      run train_leaky "$each" python3 -m train.run --attention flamia --recipe fp8_tensor_current $common
      run train_compare 60 python3 -m train.run --compare "$OUT/train" ;;
    train)  # issue 8, one full run: TRAIN_WHAT = fa4 | fp8 | leaky | dsbf16, TRAIN_STEPS (1000), TRAIN_SEED (0), into $TRAIN_DIR
      what=${TRAIN_WHAT:?TRAIN_WHAT=fa4|fp8|leaky|dsbf16}
      case $what in
        fa4) attn="--attention fa4" ;;
        fp8) attn="--attention flamia --recipe fp8_tokenblock" ;;
        leaky) attn="--attention flamia --recipe fp8_tensor_current" ;;
        dsbf16) attn="--attention flamia --recipe fp8_tokenblock_dsbf16" ;;  # the bf16-dS backward
        *) echo "unknown TRAIN_WHAT $what"; continue ;;
      esac
      run "train_$what" "${TRAIN_SECONDS:-560}" python3 -m train.run $attn --preset llama_125m \
        --steps "${TRAIN_STEPS:-1000}" --tokens-per-step 65536 --max-doc-tokens 4096 --seed "${TRAIN_SEED:-0}" --eval-every 100 \
        --leak-samples 128 --log-every 50 --out "${TRAIN_DIR:-$OUT/train}" ;;
    train-compare) run train_compare 60 python3 -m train.run --compare "${TRAIN_DIR:-$OUT/train}" ;;
    op-tests) run op_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_custom_op.py ;;
    quant-new) run quant_new 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quantize_kernel.py \
                 -k "dout_delta or argument_paths or random_document_mixes or qkv_random or tiny or one_launch" ;;
    api-tests) run api_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cute_backend.py ;;
    bwd-tests) run bwd_tests 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_bwd_kernel.py ;;
    kernel-accuracy) run kernel_accuracy 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_accuracy.py ;;
    dvref-tests) run dvref_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quantize_kernel.py \
      -k "dv_fold or dout_delta or forward_only or reduced" ;;
    ds-tests) run ds_tests 260 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py ;;
    codes-tests) run codes_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_codes_kernel.py ;;
    ds-bench) run ds_bench 420 python3 -m flamia_cute.cli bench --recipe fp8_tokenblock,fp8_tokenblock_dsbf16 \
                --modes fwd,bwd,fwdbwd --impls flamia,fa4,cudnn --reps 15 --gpu-time --out "$OUT/ds_gputime" ;;
    ds-bench-api) run ds_bench_api 420 python3 -m flamia_cute.cli bench --recipe fp8_tokenblock,fp8_tokenblock_dsbf16 \
                --modes fwd,bwd,fwdbwd --impls flamia,fa4,cudnn --reps 15 --out "$OUT/ds_api" ;;
    quant-tests-x) run quant_tests 90 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_quantize_kernel.py ;;
    castsum-tests)  # session 14: the castsum recipe's forward (row_sum_mma) against its emulator and fp64
      run castsum_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py \
        tests/test_kernel_accuracy.py -k castsum ;;
    castsum-rounds) fwd_rounds castsum_rounds "default,row sum mma,row sum mma + poly 1/8" ;;
    castsum-bench)  # end to end beside the default recipe (GPU time), FA4 in the same run
      run bench_castsum 480 python3 -m flamia_cute.cli bench --modes fwd,fwdbwd --impls flamia,fa4 --reps 15 --gpu-time \
        --recipe fp8_tokenblock_dsbf16,fp8_tokenblock_dsbf16_castsum --out "$OUT/castsum" ;;
    mx-quant)  # session 15: the Blackwell forward's fused MXFP8 quantization, runnable on the H200
      run mx_quant_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quantize_mx_kernel.py \
        tests/test_codes_kernel.py
      run mx_quant_bench 240 env OUT="$OUT" python3 perf/bench_quantize_mx.py ;;
    fuse-q)  # session 16: Q quantized in the forward kernel (FwdConfig.fuse_q_quant), tests then timing
      run fuse_q_tests 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py \
        -k "fused_q and (matches_emulator or bit_identical or leakage or empty or beyond or many_documents or many_tiles)"
      run fuse_q_bench 300 env OUT="$OUT" python3 perf/bench_fuse_q.py ;;
    fwd-tests-all) run fwd_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py ;;
    timeline) run kernel_timeline 200 python3 perf/kernel_timeline.py ${TIMELINE_WORKLOADS:-} ;;
    fwd-rounds)  # the forward's variants timed in rotated order over three rounds (medians): builds told
      # apart from their timing position (a build timed first ran up to 9% faster, run s11e)
      fwd_rounds fwd_rounds "${ROUND_VARIANTS:-default,unstaged inputs,stride,heavy first,longest documents}" ;;
    fwd-next)  # session 12's first call: the tests of claim_ahead, q_stages=3, documents longest first on
      # the staged build (its candidate default) and the unstaged builds (reordered by a refactor late
      # in session 11), then the new variants timed in rotated rounds
      run fwd_next_tests 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py \
        -k "claim_ahead or longest_documents or q_stages3 or beyond_the_document_table or unstaged"
      fwd_rounds fwd_next_rounds "default,claim ahead,3 q stages,longest documents" ;;
    accum)  # session 21: what the e4m3 wgmma keeps when it adds into a running accumulator (Triton probe)
      run fp8_accumulation 200 python3 perf/experiments/fp8_accumulation_gpu.py --out "$OUT/fp8_accumulation.json" ;;
    token-ds-tests)  # session 21: the named per-token bf16-dS recipe through the API (emulator, fp64, leakage)
      run token_ds_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cute_backend.py \
        tests/test_kernel_accuracy.py -k "token_dsbf16" ;;
    token-ds-bench)  # session 21: the per-token recipe beside the block-scaled default, FA4 in the same run (GPU time)
      run bench_token_ds 480 python3 -m flamia_cute.cli bench --modes fwd,bwd,fwdbwd --impls flamia,fa4 --reps 15 \
        --gpu-time --recipe fp8_tokenblock_dsbf16,fp8_token_dsbf16 --out "$OUT/token_ds" ;;
    tune-fq)  # session 21: the forward and the Q/K/V launch tuned on one workload of each class (the first named)
      run tune_fq 480 python3 -m flamia_cute.cli tune --only 16x1k,1x16k,longtail32k,mixed16k --kernels fwd,quant --reps 10 ;;
    tune-b) run tune_b 480 python3 -m flamia_cute.cli tune --only 16x1k,1x16k,longtail32k,mixed16k --kernels bwd --reps 10 ;;
    bench-tuned)  # session 21: GPU time with the tuning file, then with it ignored, FA4 in each run
      run bench_tuned 300 python3 -m flamia_cute.cli bench --modes fwd,bwd,fwdbwd --impls flamia,fa4 --reps 15 \
        --gpu-time --out "$OUT/tuned"
      run bench_untuned 300 env FLAMIA_CUTE_NO_TUNING=1 python3 -m flamia_cute.cli bench --modes fwd,bwd,fwdbwd \
        --impls flamia,fa4 --reps 15 --gpu-time --out "$OUT/untuned"
      run tune_print 60 python3 -m flamia_cute.cli tune --print ;;
    tune-window-check)  # session 21: the bf16-dS record's automatic window, re-tuned on 16x1k, applied to 4x4k
      run tune_window 300 python3 -m flamia_cute.cli tune --only 16x1k --kernels bwd --reps 10 --force
      run bench_window_tuned 200 python3 -m flamia_cute.cli bench --only 16x1k,4x4k --modes bwd --impls flamia,fa4 \
        --reps 15 --gpu-time --out "$OUT/window_tuned"
      run bench_window_untuned 200 env FLAMIA_CUTE_NO_TUNING=1 python3 -m flamia_cute.cli bench --only 16x1k,4x4k \
        --modes bwd --impls flamia,fa4 --reps 15 --gpu-time --out "$OUT/window_untuned" ;;
    short-pairs-tests)  # session 22: two short documents per forward query tile (FwdConfig.short_pairs)
      run short_pairs_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py \
        -k "short_pairs or short_mix" ;;
    short-pairs-mutant)  # the same tests with the second warpgroup's mask of the first document's keys removed:
      # the leakage and bit-identity tests must fail (rc != 0 expected)
      mutant_run short_pairs_mutant flamia_cute/attention_fwd_sm90.py 's/if col < key_lo:/if col < key_lo - 1000:/' \
        "key_lo - 1000" "short_pairs_bit_identical and fp8_tokenblock- and 128 or short_pairs_leakage and fp8_tokenblock]" \
        tests/test_attention_fwd_kernel.py ;;
    bwd-pairs-tests)  # two short documents per backward CTA (BwdDsBf16Config.short_pairs)
      run bwd_pairs_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k "short_pairs" ;;
    bwd-pairs-mutant)  # the same with the first warpgroup's mask of the second document's queries removed: must fail
      mutant_run bwd_pairs_mutant flamia_cute/attention_bwd_dsbf16_sm90.py \
        's/lim_i = Int32(0)  # every key/lim_i = lim  # every key/' "lim_i = lim  # every key" \
        "short_pairs_match_unpaired and fp8_tokenblock_dsbf16 and 128-4-2 or short_pairs_leakage" \
        tests/test_attention_bwd_dsbf16_kernel.py ;;
    bwd-pairs-rounds)  # the bf16-dS backward kernel alone, the untuned default against short pairs, rotated rounds
      run bwd_pairs_rounds 420 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="auto window,auto window short pairs" \
        BREAKDOWN_WORKLOADS="${PAIR_WORKLOADS:-256x64,128x128,16x1k,4x4k,longtail32k,mixed16k,1x16k}" \
        python3 perf/bench_fwd_breakdown.py ;;
    short-pairs-rounds)  # the forward kernel alone, default against short pairs, rotated rounds
      run short_pairs_rounds 420 env OUT="$OUT" BREAKDOWN_ONLY=fwd BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="default,short pairs,short pairs longest" \
        BREAKDOWN_WORKLOADS="${PAIR_WORKLOADS:-256x64,128x128,16x1k,4x4k,longtail32k,mixed16k,1x16k}" \
        python3 perf/bench_fwd_breakdown.py ;;
    trips-tests)  # session 23: the forward's diagonal scales in fewer round trips (FwdConfig.diagonal_scale_trips)
      run trips_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py \
        -k "scale_trips" ;;
    trips-mutant)  # the same with the one-trip build's second half loading the first half's scales: must fail
      mutant_run trips_mutant flamia_cute/attention_fwd_sm90.py \
        's/kv_head, head, doc_start, doc_len, m_block,$/kv_head, head, doc_start, doc_len, m_block * 0,/' \
        "m_block \* 0," "scale_trips1 and fp8_tokenblock and not unsafe" tests/test_attention_fwd_kernel.py ;;
    trips-rounds)  # the forward kernel alone, two round trips (the default since session 23) against three and one
      run trips_rounds 500 env OUT="$OUT" BREAKDOWN_ONLY=fwd BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="default,scale trips 3,scale trips 1,short pairs" \
        BREAKDOWN_WORKLOADS="${TRIPS_WORKLOADS:-128x128,16x1k,4x4k,longtail32k,mixed16k,1x16k}" \
        python3 perf/bench_fwd_breakdown.py ;;
    fwd-tests-schedules)  # the forward suite over the main schedules (every build whose scale warp changed in session 23)
      run fwd_tests_schedules 520 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_fwd_kernel.py -k \
        "(default or serial or per_tile or overlap_tiles or scale_trips or q_stages3 or longest) and not unstaged and not selects and not pinned and not serial_max and not fused and not pingpong and not short_pairs" ;;
    bench-e2e)  # the training call and the forward call, ours against FA4 in the same run, GPU time
      run bench_e2e 480 python3 -m flamia_cute.cli bench --modes fwd,fwdbwd --impls flamia,fa4 --reps 15 --gpu-time \
        --out "$OUT/e2e" ;;
    bwd-half-ds)  # the ceiling of e4m3 dK and dQ: their bf16 products' every other k-step skipped (timing only)
      run bwd_half_ds 400 env FLAMIA_CUTE_DISK_CACHE=0 BWD_ABLATIONS="full,half dK dQ,half dK dQ no K cvt" \
        python3 perf/experiments/bwd_ablations.py 1x16k 4x4k 16x1k ;;
    bwd-dk-cvt)  # e4m3 dK alone's ceiling; K's conversion skipped against converted to zeros (work or operand data?)
      run bwd_dk_cvt 500 env FLAMIA_CUTE_DISK_CACHE=0 BWD_ABLATIONS="full,half dK,no K cvt,zero K,half dK dQ" \
        python3 perf/experiments/bwd_ablations.py 1x16k 4x4k 16x1k ;;
    bwd-power)  # sustained runs of the full and zero-K builds with nvidia-smi sampling clock, power, clock-event reasons
      run bwd_power 400 env FLAMIA_CUTE_DISK_CACHE=0 BWD_POWER_BUILDS="full,zero K,half dK dQ" \
        python3 perf/experiments/bwd_power.py 1x16k ;;
    bwd-ds-bits)  # bf16 dS with 3 / 0 mantissa bits: burst timing on three workloads, then sustained with clocks
      run bwd_ds_bits 300 env FLAMIA_CUTE_DISK_CACHE=0 BWD_ABLATIONS="full,dS m3,dS m0" \
        python3 perf/experiments/bwd_ablations.py 1x16k 4x4k 16x1k
      run bwd_ds_bits_power 300 env FLAMIA_CUTE_DISK_CACHE=0 BWD_POWER_BUILDS="full,dS m3,dS m0" \
        python3 perf/experiments/bwd_power.py 1x16k ;;
    dk-e4m3-tests)  # BwdDsBf16Config.dk_e4m3 (recipe fp8_tokenblock_dke4m3): its GPU tests, kernel and API
      run dk_e4m3_tests 500 python3 -m pytest -q -m gpu tests/test_attention_bwd_dsbf16_kernel.py -k dk_e4m3 ;;
    dk-e4m3-kernel)  # the kernel alone against the default build
      run dk_e4m3_kernel 300 python3 perf/experiments/bwd_dk_e4m3.py 1x16k 4x4k 16x1k ;;
    bwd-energy)  # which parts of the backward's tile cost clock at the power cap: the ablations sustained, with clocks
      run bwd_energy 560 env FLAMIA_CUTE_DISK_CACHE=0 BWD_POWER_SECONDS=3 \
        BWD_POWER_BUILDS="full,no exp,no P pack,no dS,no dQ store,half dK dQ,zero K" \
        python3 perf/experiments/bwd_power.py 1x16k ;;
    train-power)  # ours and FA4's training call sustained with nvidia-smi: is FA4 power-capped too?
      run train_power 240 env POWER_SECONDS=3 python3 perf/experiments/train_call_power.py 1x16k ;;
    bench-sustained)  # the training call back to back after 3 s of it (the power-capped clock), ours against FA4
      run bench_sustained 500 python3 -m flamia_cute.cli bench --modes fwdbwd,fwd --impls flamia,fa4 --reps 7 \
        --sustain 3 --out "$OUT/sustained" ;;
    bench-graph)  # the same from CUDA graph replays: GPU time at the sustained clock, host time left out
      run bench_graph 500 python3 -m flamia_cute.cli bench --modes fwdbwd,fwd --impls flamia,fa4 --reps 7 \
        --sustain 3 --graph --out "$OUT/graph" ;;
    host-ab)  # host time per call with cute_backend's config memo and without it, same machine and process order
      run host_memo 200 python3 perf/profile_api.py 16x1k,4x4k,1x16k
      run host_nomemo 200 python3 perf/profile_api.py 16x1k,4x4k,1x16k nomemo ;;
    host-tests)  # session 25's host-path changes: the API, the custom op and the bench's CUDA graphs on the GPU
      run host_tests 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cute_backend.py \
        tests/test_custom_op.py tests/test_bench.py ;;
    dk-e4m3-bench)  # the kernel alone against the default build, then end to end against FA4 (both recipes)
      run dk_e4m3_kernel 300 python3 perf/experiments/bwd_dk_e4m3.py 1x16k 4x4k 16x1k
      run dk_e4m3_e2e 400 python3 -m flamia_cute.cli bench --recipe fp8_tokenblock_dsbf16,fp8_tokenblock_dke4m3 \
        --modes fwdbwd --impls flamia,fa4 --reps 15 --gpu-time --out "$OUT/dk8" ;;
    bench-16x1k)  # 16x1k (the pair build by the forward's mean-length rule) and 4x4k (unchanged: the control), GPU time
      run bench_16x1k 300 python3 -m flamia_cute.cli bench --only 16x1k,4x4k --modes fwd,fwdbwd --impls flamia,fa4 \
        --reps 15 --gpu-time --out "$OUT/b16" ;;
    bench-short)  # packs of documents at or below one tile (issue 7's short documents), GPU time, against FA4
      run bench_short 300 python3 -m flamia_cute.cli bench --workloads perf/workloads_short.json --modes fwd,fwdbwd \
        --impls flamia,fa4 --reps 15 --gpu-time ;;
    profile)  # host ms per call and sync points, ours and FA4, every workload; cProfile and stages on 16x1k
      run profile_api 300 python3 perf/profile_api.py 16x1k,4x4k,longtail32k,mixed16k,1x16k,1x64k profile stages ;;
    ncu)  # where the backward kernel's time goes, and the quantization kernel's DRAM traffic
      run ncu_bwd 300 ncu -k regex:'[Bb]wd' --launch-skip 1 --launch-count 1 --set full --import-source no \
        -o "$OUT/bwd" -f python3 perf/profile_kernels.py bwd 1x4k
      ncu -i "$OUT/bwd.ncu-rep" --page details > "$OUT/ncu_bwd_details.txt" 2>&1
      ncu -i "$OUT/bwd.ncu-rep" --page source --print-source sass --csv 2>/dev/null | gzip > "$OUT/ncu_bwd_sass.csv.gz"
      rm -f "$OUT/bwd.ncu-rep"
      run ncu_quant 200 ncu -k regex:'[Qq]uant' --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --metrics dram__bytes_read.sum,dram__bytes_write.sum \
        python3 perf/profile_kernels.py quant longtail32k ;;
    ncu-ds)  # where the bf16-dS backward kernel's time goes: one long and one short-document workload
      ncu_kernel ds BwdDsBf16 bwd_dsbf16 ${NCU_WORKLOADS:-1x16k 16x1k} ;;
    ncu-s14)  # session 14: the row_sum_mma forward and the dq_first_store backward against their defaults
      # (1x16k, same run; details pages only: the file count that comes back is limited)
      for spec in "fwd FlamiaFwd fwd FWD_CONFIG {}" "fwdrs FlamiaFwd fwd FWD_CONFIG {\"row_sum_mma\":true}" \
                  "ds BwdDsBf16 bwd_dsbf16 BWD_DSBF16_CONFIG {}" \
                  "dsfs BwdDsBf16 bwd_dsbf16 BWD_DSBF16_CONFIG {\"dq_first_store\":true}"; do
        read -r tag regex what var json <<<"$spec"
        env "$var=$json" timeout 240 ncu -k regex:"$regex" --launch-skip 1 --launch-count 1 --set full \
          --import-source no -o "$OUT/$tag" -f python3 perf/profile_kernels.py "$what" 1x16k >>"$OUT/ncu_s14.log" 2>&1
        ncu -i "$OUT/$tag.ncu-rep" --page details > "$OUT/ncu_${tag}_1x16k_details.txt" 2>&1; rm -f "$OUT/$tag.ncu-rep"
      done ;;
    ncu-fwd)  # where the forward kernel's time goes (stall samples per SASS address)
      ncu_kernel fwd FlamiaFwd fwd ${NCU_WORKLOADS:-1x16k} ;;
    ncu-fwd-short)  # session 11: the forward's per-tile cost on one-step tiles (128x128) and 16x1k, and
      # the same with overlap_tiles (s11a: +16% on 16x1k where -8..-15% was predicted)
      ncu_kernel fwd FlamiaFwd fwd 128x128 16x1k
      export FWD_CONFIG='{"overlap_tiles": true}'; ncu_kernel fwdovl FlamiaFwd fwd 16x1k; unset FWD_CONFIG ;;
    ds-orders) run ds_orders 300 env OUT="$OUT" BREAKDOWN_ONLY=ds python3 perf/bench_fwd_breakdown.py ;;
    ds-next)  # session 13's first call: transpose_v_under_s's GPU tests, then it against the default in
      # three rotated rounds (kernel alone)
      run ds_next_tests 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k "transpose_v_under_s or matches_emulator and 128"
      run ds_next_rounds 300 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="default,transpose V under S^T" python3 perf/bench_fwd_breakdown.py ;;
    ds-first-store)  # session 13: the bf16-dS backward without the dQ zero fill (dq_first_store, opt-in): the
      # GPU suite (DS_TESTS_K filters it), then it against the zero-filled default in three rotated rounds
      # (the timed call includes the fill, or the claim words' zeroing), then with its fences traced as
      # nothing (perf/experiments/dq_first_store_fences.py: where its cost is)
      run ds_tests 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        ${DS_TESTS_K:+-k "$DS_TESTS_K"}
      run ds_first_store_rounds 300 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="default,dQ first store" python3 perf/bench_fwd_breakdown.py
      first_store_fences ;;
    ds-first-store-fences) first_store_fences ;;
    ds-early-scales)  # session 19's first call: early_block_scales and ds_buffers=1 (built in session 18,
      # CPU-checked only): their GPU tests beside the default's, then both against the default in rounds
      run ds_tests 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k "late_phase or one_ds_buffer or matches_emulator"
      run ds_early_scales_rounds 300 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="default,early block scales,late phase change,one dS buffer" \
        BREAKDOWN_WORKLOADS="16x1k,4x4k,longtail32k,1x16k" python3 perf/bench_fwd_breakdown.py ;;
    ds-persistent)  # session 19: the persistent bf16-dS backward (BwdDsBf16Config.persistent): its GPU tests, then
      # both item claims against the untuned call's grid build (its window by document length) in rotated rounds
      run ds_persistent_tests 330 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k "${DS_TESTS_K:-persistent}"
      run ds_persistent_rounds 400 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="${ROUND_VARIANTS:-auto window,persistent,persistent stride,auto window early scales}" \
        BREAKDOWN_WORKLOADS="${ROUND_WORKLOADS:-16x1k,4x4k,longtail32k,mixed16k,1x16k}" python3 perf/bench_fwd_breakdown.py ;;
    ds-stamps)  # session 19: where a backward CTA's fixed time goes: the stamped timeline build's GPU test, the
      # per-step means (perf/bwd_cta_timeline.py's segments), then ncu of the grid and persistent builds on
      # 1x16k (the persistent build's +3..+9% there), the summary sections only
      run ds_timeline_test 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k cta_timeline
      run ds_timeline 240 env OUT="$OUT" BREAKDOWN_WORKLOADS="${TIMELINE_WORKLOADS:-16x1k,4x4k,1x16k}" python3 perf/bwd_cta_timeline.py
      for spec in "grid {}" "persistent {\"persistent\":true,\"early_block_scales\":false}"; do
        read -r tag json <<<"$spec"
        env BWD_DSBF16_CONFIG="$json" timeout 150 ncu -k regex:BwdDsBf16 --launch-skip 1 --launch-count 1 \
          --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
          --section Occupancy python3 perf/profile_kernels.py bwd_dsbf16 1x16k > "$OUT/ncu_ds_${tag}_1x16k.txt" 2>&1
        echo "=== ncu $tag rc=$?" | tee -a "$OUT/session.log"
      done ;;
    bwd-passes)  # session 20: the passes around the bf16-dS kernel on two streams, and the dO launch's settings
      run bwd_passes_tests 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k "overlapped"
      run bwd_passes 300 env OUT="$OUT" python3 perf/bench_bwd_passes.py ;;
    ds-entry)  # session 19's last call: scales_at_entry's GPU tests, then it against the default in rounds
      run ds_entry_tests 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k "scales_at_entry"
      run ds_entry_rounds 200 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="auto window,auto window scales at entry" \
        BREAKDOWN_WORKLOADS="${ROUND_WORKLOADS:-16x1k,4x4k,1x16k}" python3 perf/bench_fwd_breakdown.py ;;
    ds-phase)  # session 18: the early phase change (BwdDsBf16Config.phase_prefetch, default) and the auto head
      # window: the whole bf16-dS GPU suite, the CTA timeline, then rotated rounds against the late phase
      # change and the plain order (kernel alone; "default" there is window 1)
      run ds_tests 420 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        ${DS_TESTS_K:+-k "$DS_TESTS_K"}
      run ds_timeline 240 env OUT="$OUT" python3 perf/bwd_cta_timeline.py
      run ds_phase_rounds 300 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="default,late phase change,window 4,window 16" \
        BREAKDOWN_WORKLOADS="16x1k,4x4k,longtail32k,1x16k" python3 perf/bench_fwd_breakdown.py ;;
    ds-windows)  # session 18: the blocks order in windows of KV heads (BwdDsBf16Config.head_window): its GPU
      # tests and the emulator suites on the auto window, each CTA's time on its SM (cta_timeline), then
      # every window against the plain order in three rotated rounds (kernel alone)
      run ds_window_tests 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_attention_bwd_dsbf16_kernel.py \
        -k "head_windows or cta_timeline or matches_emulator"
      run ds_timeline 240 env OUT="$OUT" python3 perf/bwd_cta_timeline.py
      run ds_window_rounds 400 env OUT="$OUT" BREAKDOWN_ONLY=ds BREAKDOWN_ROUNDS=3 \
        BREAKDOWN_DS_VARIANTS="${WINDOW_VARIANTS:-default,window 2,window 4,window 8,window 16}" \
        BREAKDOWN_WORKLOADS="${WINDOW_WORKLOADS:-16x1k,4x4k,longtail32k,mixed16k,1x16k}" python3 perf/bench_fwd_breakdown.py ;;
    fwd-ablations) run fwd_ablations 300 env FLAMIA_CUTE_DISK_CACHE=0 python3 perf/experiments/fwd_ablations.py ${ABLATION_WORKLOADS:-} ;;
    bwd-ablations) run bwd_ablations 300 env FLAMIA_CUTE_DISK_CACHE=0 python3 perf/experiments/bwd_ablations.py ${ABLATION_WORKLOADS:-} ;;
    fwd-orders) run fwd_orders 300 env OUT="$OUT" BREAKDOWN_ONLY=fwd python3 perf/bench_fwd_breakdown.py ;;
    fwd-breakdown) run fwd_breakdown ${BREAKDOWN_SECONDS:-420} env OUT="$OUT" python3 perf/bench_fwd_breakdown.py ;;
    *) echo "unknown stage $stage" ;;
  esac
done

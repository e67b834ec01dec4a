#!/usr/bin/env bash
# The GPU runs a maintainer repeats, by stage: bash perf/gpu_session.sh STAGE...   (perf/README.md)
# Stages: setup tests tests-full bench breakdown api-profile tune ablations go36 train accuracy sanitize
# sanitize-race fuzz soak robust train-long cudnn-direct cuda12 cache-out.
# Each stage writes $RESULTS/<date>-<stage>/: its log, its outputs and a MANIFEST.md (commit, command,
# GPU, clock regime, SM clock samples where taken). RESULTS defaults to $OUT (the device tool returns
# what is under $OUT), else perf/results. WORKLOADS, ABLATIONS, TRAIN_WHAT, TRAIN_SEED, SANITIZE_STEPS,
# FUZZ_SEED: see the stages.
# One device call runs at most 10 minutes: setup and robust fit one call; the timed stages take a call each
# (bench), or two to a call (cudnn-direct train-long). STAGE_BUDGET caps a correctness stage's seconds.
set -uo pipefail
RESULTS=${RESULTS:-${OUT:-perf/results}}; mkdir -p "$RESULTS"
export FLAMIA_CUTE_CACHE_DIR=${FLAMIA_CUTE_CACHE_DIR:-/tmp/flamia_cache} PYTHONUNBUFFERED=1
[ -f /root/gpu-bundle/env.sh ] && . /root/gpu-bundle/env.sh
# the commit: FLAMIA_COMMIT (set it where the tree has no .git or a stale one, as on the device), else git's HEAD
COMMIT=${FLAMIA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
[ -z "${FLAMIA_COMMIT:-}" ] && [ -n "$(git status --porcelain 2>/dev/null)" ] && COMMIT="$COMMIT (working tree modified)"
WL=${WORKLOADS:-16x1k,1x16k,longtail32k,mixed16k}  # one workload per tuner class
DIR=; SAMPLER=
begin() {  # begin STAGE REGIME: the stage's folder and the head of its MANIFEST.md
  DIR="$RESULTS/$(date -u +%F)-$1"; mkdir -p "$DIR"
  { echo "# $1"; echo; echo "- Date: $(date -u '+%F %H:%M UTC')"; echo "- Commit: $COMMIT"
    echo "- Source hash: $(python3 -c 'from flamia_cute.compile_cache import package_source_hash as h; print(h())' 2>&1 | tail -1) (compile_cache.package_source_hash of the package that ran)"
    echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -1)"
    echo "- Software: $(software)"
    echo "- Clock regime: $2"; echo; echo "## Commands"; echo; } > "$DIR/MANIFEST.md"; }
software() {  # the Python packages that run (under the caller's PYTHONPATH), with the DSL's CUDA libraries
  python3 -c 'import torch, cutlass; from flamia_cute.compile_cache import dsl_cuda_version as v
print("torch", torch.__version__, "cutlass-dsl", cutlass.__version__, "with its CUDA", v(), "libraries")' 2>&1 | tail -1; }
robust_budget() {  # what is left before DEADLINE (less the packing's margin), at most ROBUST_BUDGET
  local b=$((DEADLINE - SECONDS - 20)); (( ${ROBUST_BUDGET:-$b} < b )) && b=$ROBUST_BUDGET; echo "$b"; }
# DEADLINE: seconds from this script's start by which every command has ended (a device call is cut at 600 s,
# and what is still running then, with the packing below, is lost); 575 unless set
DEADLINE=${DEADLINE:-575}
run() {  # run NAME SECONDS CMD...: CMD under a timeout (never past DEADLINE), its output in $DIR/NAME.log, the
  # command and rc in MANIFEST.md
  local name=$1 limit=$2; shift 2; local left=$((DEADLINE - SECONDS - 10))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then echo "=== $name: not run, no time left before DEADLINE"
    printf -- '- `%s`: not run (no time left before DEADLINE)\n' "$*" >> "$DIR/MANIFEST.md"; return; fi
  echo "=== $name: $*"
  timeout -k 10 "$limit" "$@" > "$DIR/$name.log" 2>&1; local rc=$?; tail -25 "$DIR/$name.log"
  printf -- '- `%s` -> `%s.log`, rc %s\n' "$*" "$name" "$rc" >> "$DIR/MANIFEST.md"; echo "=== $name rc=$rc"; }
clocks_on() { nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader,nounits -lms 200 > "$DIR/clocks.csv" 2>&1 & SAMPLER=$!; }
clocks_off() { kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null
  awk -F', ' 'NF == 5 && $3 + 0 > 300 { n++; c += $2; w += $3; r[$5] = 1 } END { if (n) {
    printf "\nSM clock samples (clocks.csv, every 200 ms): %d under load (> 300 W), mean %.0f MHz, %.0f W;", n, c / n, w / n
    printf " clock-event reasons"; for (k in r) printf " %s", k; print "" } }' "$DIR/clocks.csv" >> "$DIR/MANIFEST.md"; }
for stage in "$@"; do
  case $stage in
    setup)  # the GPU bundle (make_bundle.sh; part a at /root/gpu-bundle/a or .gpu-bundle/a), then this package
      [ -f .gpu-bundle/b/install.sh ] && bash .gpu-bundle/b/install.sh
      { . /root/gpu-bundle/env.sh && python3 -m pip install -q --no-deps --no-build-isolation -e . && echo "setup ok"; } ||
        { echo "setup failed: the later stages would only fail (bundle part a missing? see perf/README.md)"; exit 1; }
      # a disk cache an earlier machine sent back (cache-out) or one built ahead without a GPU (perf/README.md),
      # carried as .gpu-bundle/cache: its keys hash the kernel sources, so entries of changed kernels are never loaded
      if [ -f .gpu-bundle/cache/kernel-cache.tar.xz ]; then mkdir -p "$FLAMIA_CUTE_CACHE_DIR" &&
        xz -dc .gpu-bundle/cache/kernel-cache.tar.xz | tar xf - -C "$FLAMIA_CUTE_CACHE_DIR" &&
        echo "kernel cache: $(ls "$FLAMIA_CUTE_CACHE_DIR" | grep -c '\.o$') builds restored"; fi
      # the cuda12 stage's runtime part, kept for a later call that carries its compiler part (c)
      [ -d .gpu-bundle/d ] && mkdir -p /root/gpu-bundle && cp -r .gpu-bundle/d /root/gpu-bundle/ ;;
    cache-out)  # this machine's compiled kernels (not its tuning files, which are not keyed by the code) as one
      # archive under $RESULTS: carry it to the next machine as .gpu-bundle/cache/kernel-cache.tar.xz and `setup`
      # restores it (no compiles for unchanged kernels). The device returns files of at most 16 MiB
      arc="$RESULTS/kernel-cache.tar.xz"
      tar cf - -C "$FLAMIA_CUTE_CACHE_DIR" --exclude='*.lock' --exclude=./tuning . | xz -T0 -6 > "$arc"
      echo "kernel cache: $(ls "$FLAMIA_CUTE_CACHE_DIR" | grep -c '\.o$') builds, $(du -h "$arc" | cut -f1)"
      [ "$(stat -c %s "$arc")" -le 16777216 ] || echo "kernel cache archive over 16 MiB: it will not come back" ;;
    tests|tests-full)  # make test-gpu / test-gpu-full run pytest-xdist workers; without xdist, the same tests in one process
      begin "$stage" "not timed (correctness)"
      if [ "$stage" = tests ]; then target=test-gpu; marks="gpu and not gpu_full"; limit=560; else target=test-gpu-full; marks=gpu; limit=590; fi
      limit=${STAGE_BUDGET:-$limit}
      if python3 -c 'import xdist' 2>/dev/null; then run "${target//-/_}" "$limit" make "$target" PYTHON=python3 \
        PYTEST_ARGS="${PYTEST_ARGS:--v --durations=25}"
      else echo "- pytest-xdist not installed: pytest in one process, the make target's markers" >> "$DIR/MANIFEST.md"
        run "${target//-/_}" "$limit" python3 -m pytest -q -m "$marks" ${PYTEST_ARGS:-}; fi ;;
    bench)  # ours against FA4 and cuDNN on all six workloads: burst GPU time, then sustained CUDA-graph replays
      begin bench "burst (--gpu-time: each call behind a queued GPU sleep), then sustained (3 s of calls, then CUDA-graph replays back to back; clocks sampled)"
      clocks_on
      run bench_gputime 280 python3 -m flamia_cute.cli bench --impls flamia,fa4,cudnn --modes fwd,bwd,fwdbwd --reps 15 --gpu-time --out "$DIR/gputime"
      run bench_graph 300 python3 -m flamia_cute.cli bench --impls flamia,fa4,cudnn --modes fwd,fwdbwd --reps 7 --sustain 3 --graph --out "$DIR/graph"
      clocks_off; rm -f "$DIR"/*/*.png ;;
    breakdown)  # kernels alone (BREAKDOWN_ONLY, BREAKDOWN_DS_VARIANTS, BREAKDOWN_WORKLOADS, BREAKDOWN_ROUNDS pass through)
      begin breakdown "burst (CUDA-graph replays of 10 launches, medians; rounds rotated)"
      run breakdown 560 env OUT="$DIR" python3 perf/bench_fwd_breakdown.py ;;
    api-profile)  # host ms per call, ours and FA4, sync points; cProfile and stages of our 16x1k training call
      begin api-profile "host time (the GPU held busy by a queued sleep), eager"
      run profile_api 400 python3 perf/profile_api.py 16x1k,4x4k,longtail32k,mixed16k,1x16k,1x64k profile stages ;;
    tune)  # one workload per class; the tuning file is copied into the folder
      begin tune "burst (each config timed behind a queued GPU sleep)"
      run tune 560 python3 -m flamia_cute.cli tune --only "$WL" --reps 10
      run tune_print 60 python3 -m flamia_cute.cli tune --print; cp "$FLAMIA_CUTE_CACHE_DIR"/tuning/*.json "$DIR"/ 2>/dev/null ;;
    ablations)  # kernel builds with parts removed (outputs wrong, timing only). ABLATIONS: any of fwd bwd power;
      # BWD_ABLATIONS and BWD_POWER_BUILDS (comma lists of the scripts' labels) pass through. The scripts keep
      # patched builds out of the disk cache themselves
      begin ablations "burst (CUDA graphs, SM clock sampled); power: sustained 3 s per build, clocks sampled by bwd_power.py"
      for a in ${ABLATIONS:-fwd bwd}; do case $a in
        fwd|bwd) run "${a}_ablations" 560 python3 "perf/ablations/${a}_ablations.py" 1x16k 4x4k 16x1k ;;
        power) run bwd_power 300 env BWD_POWER_SECONDS=3 python3 perf/ablations/bwd_power.py 1x16k ;;
      esac; done ;;
    go36)  # issue 36's go/no-go for a split backward, 1x16k and 1x64k: the dK/dV-only kernel against the full
      # backward kernel (go if <= 0.60), the forward with a third FP8 GEMM against the full backward (go if <= 0.40)
      begin go36 "burst (CUDA graphs, SM clock sampled by nvidia-smi during the replays)"
      run bwd_dkdv_only 280 python3 perf/ablations/bwd_ablations.py --go
      run fwd_third_product 280 python3 perf/ablations/fwd_ablations.py --go ;;
    train)  # one 1,000-step run of train/ (~5 min): TRAIN_WHAT = fp8 (the default recipe) | fa4 | leaky; TRAIN_SEED
      what=${TRAIN_WHAT:-fp8}; case $what in fa4) attn="--attention fa4";; leaky) attn="--attention flamia --recipe fp8_tensor_current";;
        fp8) attn="--attention flamia --recipe fp8_tokenblock_dsbf16";; *) echo "TRAIN_WHAT: fp8, fa4 or leaky"; continue;; esac
      begin train "eager training steps"
      run "train_$what" 560 python3 -m train.run $attn --preset llama_125m --steps 1000 --tokens-per-step 65536 \
        --max-doc-tokens 4096 --seed "${TRAIN_SEED:-0}" --eval-every 100 --leak-samples 128 --log-every 50 --out "$DIR"
      run train_compare 60 python3 -m train.run --compare "$DIR" ;;
    accuracy)  # errors against fp64 (emulator table, kernels on fresh data) and the demo's kernel-vs-emulator checks
      begin accuracy "not timed (numerics)"
      run demo 200 python3 -m flamia_cute
      run kernel_accuracy 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_accuracy.py
      run accuracy_table 180 python3 -m flamia_cute.cli accuracy --json "$DIR/accuracy_emulator.json" ;;
    sanitize|sanitize-race)  # compute-sanitizer on every shipping kernel, tiny odd packs (perf/sanitize.sh):
      # sanitize = the warm-up that compiles, the planted out-of-bounds write memcheck must report, memcheck (~6-9 min);
      # sanitize-race = its own warm-up of the small set, racecheck and synccheck (~4-8 min)
      begin "$stage" "not timed (correctness)"
      # (sanitize-race warms its small set up first: a machine does not keep sanitize's compile cache between calls)
      if [ "$stage" = sanitize ]; then steps="warmup control memcheck"; ws=full; limit=420
      else steps="warmup racecheck synccheck"; ws=small; limit=280; fi
      budget=${STAGE_BUDGET:-560}; (( budget > DEADLINE - SECONDS - 35 )) && budget=$((DEADLINE - SECONDS - 35))
      (( limit > budget )) && limit=$budget
      run "${stage//-/_}" $((budget + 20)) env SANITIZE_STEPS="${SANITIZE_STEPS:-$steps}" SANITIZE_LIMIT="$limit" \
        WARMUP_SET="$ws" SANITIZE_BUDGET="$budget" bash perf/sanitize.sh "$DIR" ;;
    fuzz)  # 320 random packs (1..16k-token documents, every head config, training and no_grad) against the
      # emulator within the kernel tests' bounds; FUZZ_SEED replays a run (~2-3 min with its compiles)
      begin fuzz "not timed (correctness)"
      run fuzz_stdout "${STAGE_BUDGET:-560}" python3 perf/fuzz_gpu.py --out "$DIR" ${FUZZ_SEED:+--seed "$FUZZ_SEED"} ;;
    soak)  # 2,000 random calls: allocated memory flat, reserved at a plateau, no kernel built after the warm-up
      begin soak "not timed (memory and compiles)"
      run soak_stdout "${STAGE_BUDGET:-400}" python3 perf/soak.py --out "$DIR" ;;
    robust)  # the correctness stages at once, each in its own process and folder: sanitize, sanitize-race,
      # fuzz, soak and tests: the make test-gpu tier of ROBUST_TESTS (default: the files whose GPU tests changed
      # after the last full GPU run, listed below: keep the list current; "all" for every file), GPU_WORKERS 6.
      # Nothing is timed, so they may share the GPU; the
      # disk cache's locks make each kernel compile once. ROBUST_BUDGET seconds for all (default: what is
      # left before DEADLINE, so that setup fits the same device call); a stage that runs out of it says so in its log
      b=$(robust_budget); pids=()
      tests=${ROBUST_TESTS:-tests/test_nonfinite.py tests/test_cross_length_kernel.py tests/test_torch_backend.py \
        tests/test_checkpointing.py tests/test_dense_api.py tests/test_custom_op.py}
      [ "$tests" = all ] && tests=
      # the kernels of sanitize, fuzz and soak compiled once, on all cores, before the five start (each would
      # otherwise start its own pool of compiles at the same moment)
      begin robust-warmup "not timed (compiles)"
      run warmup $((b / 3)) python3 perf/kernel_warmup.py --sets sanitize,fuzz,soak
      b=$(robust_budget)
      for s in sanitize sanitize-race fuzz soak tests; do
        DEADLINE=$((b + 15)) STAGE_BUDGET=$b GPU_WORKERS=${GPU_WORKERS:-6} NO_PACK=1 \
          PYTEST_ARGS="${PYTEST_ARGS:--v --durations=15} $tests" bash "$0" "$s" \
          > "$RESULTS/robust-$s.out" 2>&1 & pids+=($!)
      done
      for i in "${!pids[@]}"; do wait "${pids[$i]}"; done
      for s in sanitize sanitize-race fuzz soak tests; do
        echo "##### $s"; grep -E '^=== .* rc=' "$RESULTS/robust-$s.out"; tail -8 "$RESULTS/robust-$s.out"
      done; rm -f "$RESULTS"/robust-*.out ;;
    train-long)  # FA4 against ours, train/ on 16k-token documents: tokens/s and a training step's peak memory
      begin train-long "eager training steps (median tokens/s after 10 warm-up steps)"
      lim=${STAGE_BUDGET:-590}; (( lim > DEADLINE - SECONDS - 10 )) && lim=$((DEADLINE - SECONDS - 10))
      run train_long "$lim" env TRAIN_BUDGET=$((lim - 15)) bash perf/train_long.sh "$DIR" ;;
    cuda12)  # the DSL's CUDA 12.9 builds (what a default install runs) against its 13.4 ones (the bundle's, which
      # every other stage runs), burst GPU time, alternating; needs bundle parts c and d (perf/README.md)
      begin cuda12 "burst (--gpu-time: each call behind a queued GPU sleep), the two builds alternating"
      if [ ! -f /tmp/site12/.cu12-ok ]; then  # the compiler (part c, carried) and the runtime (part d, kept by setup)
        c=$(ls {.gpu-bundle,/root/gpu-bundle}/c/dsl-cu12-compiler.tar.xz 2>/dev/null | head -1)
        d=$(ls {.gpu-bundle,/root/gpu-bundle}/d/dsl-cu12-runtime.tar.xz 2>/dev/null | head -1)
        [ -n "$c" ] && [ -n "$d" ] || { echo "cuda12: needs bundle parts c and d (perf/README.md)"; continue; }
        # /tmp/site with the cu12 flavour only: the DSL takes the newest flavour the driver supports
        rm -rf /tmp/site12 && cp -a /tmp/site /tmp/site12 && rm -rf /tmp/site12/nvidia_cutlass_dsl/cu13 \
          /tmp/site12/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.* &&
          xz -dc "$c" | tar xf - -C /tmp/site12 && xz -dc "$d" | tar xf - -C /tmp/site12 && touch /tmp/site12/.cu12-ok ||
          { echo "cuda12: /tmp/site12 not built (is /tmp/site, setup's, there?)"; continue; }
      fi
      p12=/tmp/site12:/tmp/site12/nvidia_cutlass_dsl/dsl_packages
      echo "- The 12.9 runs: $(PYTHONPATH=$p12 software) (PYTHONPATH=$p12)" >> "$DIR/MANIFEST.md"
      # each flavour's kernels compiled first, on all cores, so that the timed runs share the time left evenly
      run warm13 90 python3 perf/kernel_warmup.py --sets bench
      run warm12 90 env PYTHONPATH="$p12" python3 perf/kernel_warmup.py --sets bench
      per=$(( (DEADLINE - SECONDS - 20) / 4 ))
      for r in 1 2; do for v in 13 12; do
        if [ $v = 12 ]; then pp=$p12; else pp=${PYTHONPATH:-}; fi
        run "cu${v}_$r" "$per" env PYTHONPATH="$pp" python3 -m flamia_cute.cli bench --impls flamia --only 1x16k,4x4k,16x1k \
          --modes fwd,fwdbwd --reps 15 --gpu-time --out "$DIR/cu${v}_$r"
      done; done ;;
    cudnn-direct)  # the cuDNN FP8 baseline against a direct cudnn-frontend call: GPU time, then graph replays
      begin cudnn-direct "burst (--gpu-time: each call behind a queued GPU sleep); sustained CUDA-graph replays for --graph"
      left=$((DEADLINE - SECONDS - 10)); l1=330; (( left * 3 / 5 < l1 )) && l1=$((left * 3 / 5))  # the graph run gets the rest
      run cudnn_direct "$l1" python3 perf/cudnn_direct.py --only 1x16k,4x4k,16x1k --bwd --out "$DIR"
      run cudnn_direct_graph 220 python3 perf/cudnn_direct.py --only 1x16k --graph --out "$DIR/graph" ;;
    *) echo "unknown stage $stage (see perf/README.md)" ;;
  esac
done
# at most 8 files come back from a device call: more than that go back as one archive
if [ -z "${NO_PACK:-}" ] && [ -n "${OUT:-}" ] && [ "$RESULTS" = "$OUT" ] && [ "$(find "$RESULTS" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/flamia_results.tgz -C "$RESULTS" . && find "$RESULTS" -mindepth 1 -delete && mv /tmp/flamia_results.tgz "$RESULTS/"
  echo "more than 8 result files: packed into $RESULTS/flamia_results.tgz"
fi

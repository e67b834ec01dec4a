#!/usr/bin/env bash
# Device-side triage of the forward kernel: each variant in its own process (a fault ends the context).
. /root/gpu-bundle/env.sh
export FLAMIA_CUTE_CACHE_DIR=/tmp/flamia_cache PYTHONUNBUFFERED=1
python3 -c "import flamia_cute.quant" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
for lengths in "$@"; do
  timeout 120 python3 perf/debug_fwd.py --lengths "$lengths" 2>&1 | grep -E "variant|Error" | head -3
done

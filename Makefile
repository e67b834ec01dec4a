# flamia_cute developer targets. PYTHON is the interpreter of the active environment.
PYTHON ?= python3
PYTEST_ARGS ?=

# GPU tests run in parallel processes: the kernels' compiles are CPU-bound, one core each
GPU_WORKERS ?= 8

.PHONY: install demo test test-gpu test-gpu-full bench ptx lint accuracy

# The DSL's CUDA 13 builds where the driver runs CUDA 13 (R580 or newer): their forward is 4-11% faster
# than the CUDA 12.9 builds' on the H200 (perf/results/2026-12-05-h200-cuda12)
EXTRAS ?= test,sass$(shell nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | awk -F. '$$1 >= 580 {print ",cu13"}')

# torch: CPU machines get the CPU build; a GPU machine keeps the torch it has.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[$(EXTRAS)]"

demo:
	$(PYTHON) -m flamia_cute

# pytest exits 5 when nothing is collected: that is a failure of the suite, said plainly. Two
# processes: the kernels' CPU compiles are single-threaded.
CPU_WORKERS ?= 2

test:
	$(PYTHON) -m pytest -q -n $(CPU_WORKERS) -m "not gpu" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests collected" >&2; exit 1; fi; exit $$rc

# every shipping kernel path, the leakage checks and the API (marker gpu, not gpu_full)
test-gpu:
	$(PYTHON) -m pytest -q -n $(GPU_WORKERS) -m "gpu and not gpu_full" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-gpu: no tests collected" >&2; exit 1; fi; exit $$rc

# every GPU test
test-gpu-full:
	$(PYTHON) -m pytest -q -n $(GPU_WORKERS) -m gpu $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-gpu-full: no tests collected" >&2; exit 1; fi; exit $$rc

accuracy:
	$(PYTHON) -m flamia_cute.cli accuracy

bench:
	$(PYTHON) -m flamia_cute.cli bench

ptx:
	$(PYTHON) -m flamia_cute.cli ptx --all --out perf/out/ptx

lint:
	$(PYTHON) -m ruff check flamia_cute quant schedules tests perf train

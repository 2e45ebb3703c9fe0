#!/usr/bin/env bash
# One call on the GPU machine: build DeepGEMM (carry .device; staged by
# ../shared/device/fetch-deepgemm.py), run the GPU tests, then the benchmark
# (extra arguments go to the benchmark).  Logs, JSON and trace land in $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -f .device/install-deepgemm.sh ]; then
  bash .device/install-deepgemm.sh > "$OUT/deepgemm-install.log" 2>&1; echo "rc=$?" >> "$OUT/deepgemm-install.log"
  tail -2 "$OUT/deepgemm-install.log"
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -rs -m gpu ${GPU_TESTS:-tests/ops tests/test_plan.py tests/vllm_0_27/utils/test_deep_gemm_real.py} \
    2>&1 | tee "$OUT/gpu-tests.log" | tail -25
fi
python3 benchmarks/benchmark_indexer_decode.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"

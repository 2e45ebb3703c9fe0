#!/usr/bin/env bash
# One call on the GPU machine: build DeepGEMM in the background (carry .device),
# run the GPU tests, then the benchmark (extra arguments go to the benchmark).
# Logs and the JSON land in $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}; mkdir -p "$OUT"
if [ -f .device/install-deepgemm.sh ]; then
  (bash .device/install-deepgemm.sh > "$OUT/deepgemm-install.log" 2>&1; echo "rc=$?" >> "$OUT/deepgemm-install.log") &
  dg=$!
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests/ops tests/test_plan.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -20
fi
[ -n "${dg:-}" ] && wait "$dg" && tail -2 "$OUT/deepgemm-install.log"
python3 benchmarks/benchmark_indexer_decode.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"

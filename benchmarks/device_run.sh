#!/usr/bin/env bash
# One call on the GPU machine: DeepGEMM 2.8.2 (a prebuilt wheel in $DEV when there
# is one, else built from the staged sdist), the GPU tests, then the benchmark
# (python3 -m vllm_dsa_varlen.bench) with every peer on the same inputs: the portable
# Triton kernel and DeepGEMM 2.8.2 in the main process, this project's sm_90 CUDA kernel
# in a process of its own, vLLM 0.33's DeepGEMM 2.8.1 in another (the
# two DeepGEMMs crash when loaded together), merged into one table (bench.json;
# benchmarks/summarize.py prints it).  Extra arguments go to every benchmark process.
# Logs, JSON land in $OUT.
#   DEV=.device (default; ../.device from a copy one level down)  SKIP_TESTS=1  TESTS_LAST=1
#   RUN_VDG=0  RUN_SM90=0  GPU_TESTS=...  TEST_TIMEOUT/PEER_TIMEOUT/MAIN_TIMEOUT (seconds)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}; mkdir -p "$OUT"
DEV=${DEV:-.device}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
whl=$(ls "$DEV"/deepgemm-*.whl 2>/dev/null | head -1)
if [ -n "$whl" ]; then
  python3 -m pip install -q --no-deps --no-index "$whl" > "$OUT/deepgemm-install.log" 2>&1; echo "rc=$?" >> "$OUT/deepgemm-install.log"
elif [ -f "$DEV/install-deepgemm.sh" ]; then
  bash "$DEV/install-deepgemm.sh" > "$OUT/deepgemm-install.log" 2>&1; echo "rc=$?" >> "$OUT/deepgemm-install.log"
fi
tail -1 "$OUT/deepgemm-install.log" 2>/dev/null
run_tests() {
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs -m gpu ${GPU_TESTS:-tests/ops tests/test_plan.py tests/vllm_0_27/utils/test_deep_gemm_real.py} \
    > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"; tail -25 "$OUT/gpu-tests.log"
}
[ "${SKIP_TESTS:-0}" != 1 ] && [ "${TESTS_LAST:-0}" != 1 ] && run_tests
peers=()
if [ "${RUN_VDG:-1}" = 1 ] && [ -f "$DEV/vllm-deep-gemm-0.33.0.tgz" ]; then
  mkdir -p /tmp/vdg && tar xzf "$DEV/vllm-deep-gemm-0.33.0.tgz" -C /tmp/vdg
  PYTHONPATH=/tmp/vdg timeout ${PEER_TIMEOUT:-600} python3 -m vllm_dsa_varlen.bench --peer vdg --json "$OUT/bench-vdg.json" "$@" \
    > "$OUT/bench-vdg.log" 2>&1; echo "vdg peer rc=$?"
  [ -f "$OUT/bench-vdg.json" ] && peers+=("$OUT/bench-vdg.json")
fi
# The sm_90 kernel in a process of its own too (a fault there cannot take the other paths
# down); RUN_SM90=0 times it in the main process instead.
if [ "${RUN_SM90:-1}" = 1 ]; then
  timeout ${PEER_TIMEOUT:-600} python3 -m vllm_dsa_varlen.bench --peer sm90 --json "$OUT/bench-sm90.json" "$@" \
    > "$OUT/bench-sm90.log" 2>&1; echo "sm90 peer rc=$?"
  [ -f "$OUT/bench-sm90.json" ] && peers+=("$OUT/bench-sm90.json")
fi
merge=()
[ ${#peers[@]} -gt 0 ] && merge=(--merge "${peers[@]}")
nosm90=(); [ "${RUN_SM90:-1}" = 1 ] && nosm90=(--no-sm90)
timeout ${MAIN_TIMEOUT:-900} python3 -m vllm_dsa_varlen.bench "${nosm90[@]}" --json "$OUT/bench.json" "${merge[@]}" "$@" > "$OUT/bench.log" 2>&1
echo "main rc=$?"; sed -n '/^case /,$p' "$OUT/bench.log"
[ "${SKIP_TESTS:-0}" != 1 ] && [ "${TESTS_LAST:-0}" = 1 ] && run_tests
exit 0

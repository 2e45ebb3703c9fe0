#!/usr/bin/env bash
# Device spike: DeepGEMM 2.8.2 wheel built in the background (niced), the Gluon
# kernel's checks and timings, then vLLM 0.33's DeepGEMM in its own process.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}; mkdir -p "$OUT"
DEV=${DEV:-../.device}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${BUILD_WHEEL:-1}" = 1 ]; then
  ( work=$(mktemp -d); tar xzf "$DEV"/deepinfer_gemm-*.tar.gz -C "$work"; cd "$work"/deepinfer_gemm-*;
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} CPLUS_INCLUDE_PATH="$(cd "$OLDPWD" && cd "$DEV" && pwd)/inc";
    CC=/usr/bin/gcc CXX=/usr/bin/g++ DG_FORCE_BUILD=1 MAX_JOBS=6 nice -n 19 \
      python3 -m pip wheel --no-build-isolation --no-deps -w "$OUT" . > "$OUT/wheel.log" 2>&1;
    echo "wheel rc=$?" >> "$OUT/wheel.log" ) &
  WPID=$!
fi
python3 benchmarks/hopper_spike.py 2>&1 | tee "$OUT/spike.log"
mkdir -p /tmp/vdg && tar xzf "$DEV"/vllm-deep-gemm-0.33.0.tgz -C /tmp/vdg
[ "${RUN_PEER:-1}" = 1 ] && PYTHONPATH=/tmp/vdg python3 benchmarks/hopper_spike.py --peer vdg 2>&1 | tee "$OUT/vdg.log"
if [ "${BUILD_WHEEL:-1}" = 1 ]; then wait $WPID; tail -3 "$OUT/wheel.log"; ls -la "$OUT"; fi

#!/usr/bin/env bash
# On the GPU host, from the project root: receive one staged transfer folder
# (scripts/stage-offline-gpu.py; skip with "-"), then, once the staged vLLM is
# complete, run the end-to-end benchmark with the remaining arguments.
#   bash benchmarks/e2e_device.sh .device/offline/call-2 --out "$OUT/e2e" --k 3 ...
set -euo pipefail
target=${OFFLINE_GPU:-/tmp/offline-gpu}
line=$(bash scripts/offline-gpu-install.sh "$1" "$target" | tail -1)
shift
echo "$line"
case "$line" in complete:*) ;; *) exit 0 ;; esac
export PYTHONPATH=${line#complete: export PYTHONPATH=}
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[ $# -gt 0 ] && exec python3 benchmarks/e2e_decode.py "$@"

#!/usr/bin/env bash
# On the GPU host, from the project root: receive one staged transfer folder
# (scripts/stage-offline-gpu.py with --deps <a release's list> scripts/offline-gpu/serve-extra-deps.txt;
# skip with "-"), then, once the staged vLLM is complete, run benchmarks/serve.py with the
# remaining arguments inside one call's time: TIME_LIMIT seconds for the whole call (default
# 570), install included; serve.py gets what is left (less STOP_MARGIN, default 20 s) as its
# --time-limit and shares it out per server, and `timeout` stops it for good past that.
# serve.py works in $WORK (default /tmp/serve-work); $OUT/serve (default /tmp/serve-out/serve)
# gets serve.json, the table (table.txt), serve.py's output and logs.tar.xz (client and identity
# files, each server's log, nvidia-smi before and after; not the model): few files, as a
# device call brings back only a handful.
#   bash benchmarks/serve_device.sh .device/offline/call-3 --quick --config proxy --k 3
#   OUT=$OUT TIME_LIMIT=590 bash benchmarks/serve_device.sh - --quick --aa --concurrency 32
set -uo pipefail
start=$SECONDS
target=${OFFLINE_GPU:-/tmp/offline-gpu}
line=$(bash scripts/offline-gpu-install.sh "$1" "$target" | tail -1)
shift
echo "$line"
case "$line" in complete:*) ;; *) exit 0 ;; esac
export PYTHONPATH=${line#complete: export PYTHONPATH=}
# a server runs vLLM's default: its engine core in a process of its own
unset VLLM_ENABLE_V1_MULTIPROCESSING
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${WORK:-/tmp/serve-work}/serve
back=${OUT:-/tmp/serve-out}/serve
mkdir -p "$out" "$back"
# an earlier call's files out (the model folder kept: its path is in vLLM's compile-cache key)
[ "$out" != "$back" ] && find "$out" -mindepth 1 -maxdepth 1 ! -name 'model-*' -exec rm -rf {} +
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$out/gpu-before.txt" 2>&1
left=$(( ${TIME_LIMIT:-570} - (SECONDS - start) - ${STOP_MARGIN:-20} ))
if [ "$left" -lt 60 ]; then echo "only ${left} s left after the install: not started"; exit 0; fi
echo "serve.py: ${left} s"
timeout -k 10 $((left + ${STOP_MARGIN:-20} - 5)) python3 benchmarks/serve.py --out "$out" --time-limit "$left" "$@" \
  > "$out/serve-stdout.txt" 2>&1
echo "serve.py rc=$?"
nvidia-smi --query-gpu=memory.used --format=csv > "$out/gpu-after.txt" 2>&1
sed -n '/^| point /,$p' "$out/serve-stdout.txt" | tee "$out/table.txt"
grep -E '^\[(stock|plugin|control)\] ' "$out/serve-stdout.txt" | tail -40
if [ "$out" != "$back" ]; then
  cp "$out"/serve.json "$out"/table.txt "$out"/serve-stdout.txt "$back"/ 2>/dev/null
  tar -C "$out" --exclude='./model-*' --exclude=./serve.json -cJf "$back/logs.tar.xz" .
fi
exit 0

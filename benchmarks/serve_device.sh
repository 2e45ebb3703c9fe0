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
# RUN_S=<seconds> gives serve.py that long, from this call's start, beyond one call's limit (a
# 10-minute soak): it then runs in a session of its own (setsid), which the device keeps only
# while the machine stays warm; this call returns at TIME_LIMIT saying "detached", and each next
# call, made within the warm window, `bash benchmarks/serve_device.sh --attach`, waits for it
# (again up to TIME_LIMIT) and brings the files back once it has ended.
set -uo pipefail
start=$SECONDS
out=${WORK:-/tmp/serve-work}/serve
back=${OUT:-/tmp/serve-out}/serve
margin=${STOP_MARGIN:-20}
limit=${TIME_LIMIT:-570}

finish() {   # serve.py has ended (its status in $out/rc): the table, then the few files back
  echo "serve.py rc=$(cat "$out/rc")"
  nvidia-smi --query-gpu=memory.used --format=csv > "$out/gpu-after.txt" 2>&1
  sed -n '/^| point /,$p' "$out/serve-stdout.txt" | tee "$out/table.txt"
  grep -E '^\[(stock|plugin|control)\] ' "$out/serve-stdout.txt" | tail -40
  if [ "$out" != "$back" ]; then
    mkdir -p "$back"
    cp "$out"/serve.json "$out"/table.txt "$out"/serve-stdout.txt "$back"/ 2>/dev/null
    tar -C "$out" --exclude='./model-*' --exclude=./serve.json --exclude=./rc -cJf "$back/logs.tar.xz" .
  fi
}

wait_or_leave() {   # a detached run: wait for it until this call's time is up
  while [ ! -f "$out/rc" ] && [ $(( SECONDS - start )) -lt $(( limit - margin )) ]; do
    sleep 2
  done
  if [ -f "$out/rc" ]; then finish
  else echo "detached: serve.py still running (pid $(cat "$out/pid")); attach within the warm window"
  fi
}

if [ "${1:-}" = "--attach" ]; then
  [ -f "$out/pid" ] || { echo "attach: no detached serve.py under $out"; exit 0; }
  wait_or_leave
  exit 0
fi

target=${OFFLINE_GPU:-/tmp/offline-gpu}
line=$(bash scripts/offline-gpu-install.sh "$1" "$target" | tail -1)
shift
echo "$line"
case "$line" in complete:*) ;; *) exit 0 ;; esac
export PYTHONPATH=${line#complete: export PYTHONPATH=}
# a server runs vLLM's default: its engine core in a process of its own
unset VLLM_ENABLE_V1_MULTIPROCESSING
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
mkdir -p "$out" "$back"
# an earlier call's files out (the model folder kept: its path is in vLLM's compile-cache key)
[ "$out" != "$back" ] && find "$out" -mindepth 1 -maxdepth 1 ! -name 'model-*' -exec rm -rf {} +
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$out/gpu-before.txt" 2>&1
left=$(( ${RUN_S:-$limit} - (SECONDS - start) - margin ))
if [ "$left" -lt 60 ]; then echo "only ${left} s left after the install: not started"; exit 0; fi
echo "serve.py: ${left} s"
run() {
  timeout -k 10 $((left + margin - 5)) python3 benchmarks/serve.py --out "$out" --time-limit "$left" "$@" \
    > "$out/serve-stdout.txt" 2>&1 < /dev/null
  echo $? > "$out/rc.tmp" && mv "$out/rc.tmp" "$out/rc"
}
if [ -n "${RUN_S:-}" ]; then
  export -f run
  export out left margin
  setsid bash -c 'run "$@"' run "$@" &
  echo $! > "$out/pid"
  wait_or_leave
else
  run "$@"
  finish
fi
exit 0

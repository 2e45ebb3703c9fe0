#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}; mkdir -p "$OUT"
timeout 120 python3 benchmarks/hopper_spike.py --mode check > "$OUT/check.log" 2>&1; rc=$?; echo "check rc=$rc"
grep -a "^check\|correctness\|failed" "$OUT/check.log" | cut -c1-160
if [ $rc != 0 ]; then
timeout 100 compute-sanitizer --tool memcheck --show-backtrace no --print-limit 3 python3 benchmarks/hopper_spike.py --mode check > "$OUT/sanitize.log" 2>&1; echo "sanitizer rc=$?"
grep -a -v "^=========     \|^$" "$OUT/sanitize.log" | head -30
fi
timeout 200 python3 benchmarks/hopper_spike.py --mode time --variant 0 > "$OUT/time.log" 2>&1; echo "time rc=$?"
grep -a '^{"case"' "$OUT/time.log" | python3 -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l); print(f\"{d['case']:16} {d['path'][:60]:60} {d['graph_us']:8.1f} {d['eager_us']:8.1f}\")"
grep -a "failed" "$OUT/time.log" | cut -c1-300

#!/usr/bin/env bash
# Nsight Compute on the GPU machine: one call of each path of the given cases
# (benchmarks/profile_paths.py), the sm_90 kernel in one process and vLLM 0.33's
# DeepGEMM 2.8.1 (native kernels) in another; each report's details page (CSV),
# raw metrics and per-SASS-instruction page (gzipped CSV) and one log land in $OUT.
#   CASES="B64 L32K 4tok|B64 L32K 2tok"  SET=full  SM90="k=v;..."  DEV=.device
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}; mkdir -p "$OUT"
DEV=${DEV:-.device}
SET=${SET:-full}
IFS='|' read -r -a cases <<< "${CASES:-B64 L32K 4tok|B64 L32K 2tok}"
ncu --version | tail -1
prof() {  # name, then the profiled command's arguments
  local name=$1; shift
  timeout ${NCU_TIMEOUT:-240} ncu --profile-from-start off --clock-control none --set "$SET" \
    --import-source no -f -o "/tmp/$name" python3 benchmarks/profile_paths.py --cases "${cases[@]}" "$@" \
    >> "$OUT/ncu.log" 2>&1; echo "$name rc=$?"
  ncu -i "/tmp/$name.ncu-rep" --page details --csv > "$OUT/$name-details.csv" 2>> "$OUT/ncu.log"
  ncu -i "/tmp/$name.ncu-rep" --page raw --csv 2>> "$OUT/ncu.log" | gzip > "$OUT/$name-raw.csv.gz"
  ncu -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass 2>> "$OUT/ncu.log" | gzip > "$OUT/$name-sass.csv.gz"
}
prof gluon --peer gluon ${SM90:+--sm90 "$SM90"}
if [ -f "$DEV/vllm-deep-gemm-0.33.0.tgz" ]; then
  mkdir -p /tmp/vdg && tar xzf "$DEV/vllm-deep-gemm-0.33.0.tgz" -C /tmp/vdg
  PYTHONPATH=/tmp/vdg prof vdg --peer vdg --paths native
fi
grep -E "profiling|rror" "$OUT/ncu.log" | head -30
python3 benchmarks/ncu_summary.py "$OUT"/*-details.csv
exit 0

export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}
R=benchmarks/sm90_repeat_check.py
run() { echo "== $*"; timeout 45 python3 $R --repeats 10 "$@" > /tmp/r.log 2>&1; rc=$?; grep -v -i warn /tmp/r.log | tail -3 | cut -c1-300; echo "rc=$rc"; }
run --cases 2tok-short --sets "consumers=4"
run --cases 2tok-short --sets "consumers=2"
run --cases 2tok --sets "consumers=2"
run --cases 2tok --sets "consumers=4"
run --cases 2tok --sets "consumers=4,stages=8"
run --cases 4tok --sets "consumers=4"
echo "== sanitizer 2tok consumers=4"
timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python3 $R --repeats 1 --cases 2tok-short 2tok --sets "consumers=4" > $OUT/san.log 2>&1; echo rc=$?
grep -v -i warn $OUT/san.log | head -60 | cut -c1-250

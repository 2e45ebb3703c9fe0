export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/dsa-out}
timeout 200 python3 benchmarks/sm90_repeat_check.py --repeats 40 --sets "consumers=4;consumers=2;consumers=1;consumers=4,direct_store=0;consumers=4,stages=8" 2>&1 | tee $OUT/repeat.log | grep -v Warning
timeout 200 python3 benchmarks/benchmark_indexer_decode.py --peer gluon --rep-ms 20 --cases "B64 L32K 2tok" "B256 L4K 2tok" "B64 L32K 4tok" "B64 L8K 1..4" --sm90-variants "consumers=2;stages=8;stages=10" --json $OUT/b.json > $OUT/b.log 2>&1; echo rc=$?
sed -n '/^case /,$p' $OUT/b.log

#!/usr/bin/env bash
# One GPU call for the copy-engine work: focused correctness (direct/auto kit, copy-engine tests) first,
# then the timing probes alone.  Logs and JSON go to $OUT (steps: tests, host, stall, bench, timeline).
set -uo pipefail
OUT=${OUT:-/tmp/hicache-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_first -e plugins/page_first \
  -e plugins/kv_split -e tests/plugins/page_head -e tests/plugins/fake_vendor >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
PYT="python3 -m pytest -q -p no:cacheprovider --hicache-device cuda"
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests) timeout ${TESTS_T:-300} $PYT tests/test_direct.py tests/test_pitched.py tests/test_relayout.py >"$OUT/t_direct.log" 2>&1 & a=$!
      timeout ${TESTS_T:-300} $PYT hicache_core/testing --hicache-io-backend direct --hicache-io-backend auto >"$OUT/t_kit.log" 2>&1 & b=$!
      wait $a; echo "tests direct rc=$? $(tail -1 "$OUT/t_direct.log")"; wait $b; echo "tests kit rc=$? $(tail -1 "$OUT/t_kit.log")" ;;
    host) for pl in separate one-allocation-descending; do
        mkdir -p "$OUT/host-$pl"; HICACHE_BENCH_PLACEMENT=$pl timeout 200 python3 benchmarks/host_time.py --out "$OUT/host-$pl" \
          --backends ${HOST_BACKENDS:-kernel,direct,auto} --reps 100 >"$OUT/host-$pl.log" 2>&1; echo "host $pl rc=$?"; cat "$OUT/host-$pl.log"; done ;;
    timeline) timeout 200 python3 benchmarks/staged_timeline.py >"$OUT/staged_timeline.log" 2>&1; echo "timeline rc=$?"; grep -v "^    trace" "$OUT/staged_timeline.log" ;;
    stall) timeout 200 python3 benchmarks/sched_stall.py --out "$OUT" >"$OUT/stall.log" 2>&1; echo "stall rc=$?"; cat "$OUT/stall.log" ;;
    bench) HICACHE_BENCH_PLACEMENT=${PLACEMENT:-separate} timeout ${BENCH_T:-300} hicache bench --out "$OUT/bench-${PLACEMENT:-separate}" --reps 10 --gemm \
        ${BENCH_ARGS:-} >"$OUT/bench-${PLACEMENT:-separate}.log" 2>&1; echo "bench rc=$?"; grep -v "^hicache bench" "$OUT/bench-${PLACEMENT:-separate}.log" | tail -40 ;;
  esac
  echo "  ($step took $(( $(date +%s) - t0 )) s)"
done

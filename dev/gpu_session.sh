#!/usr/bin/env bash
# One GPU call, several steps; every log goes into $OUT/logs.tgz (the device tool returns few files),
# a one-line-per-step summary into $OUT/summary.txt and stdout.
# Usage (on a CUDA machine): bash dev/gpu_session.sh STEP...
#   tune        kernel launch-shape sweep with a GEMM beside it (benchmarks/tune_tiles.py; TUNE_ARGS)
#   tests       the whole GPU suite in three concurrent pytest processes (conformance kit, tests/, plugins/)
#   stress      benchmarks/stress.py (interleaved transfers, SGLang-shaped threads, 100 lifecycles)
#   focus       the kit for kernel/direct/auto, the copy-engine, row-copy and launch tests, plugins/, tests/gpu, with both
#               sanitizers over the kernel tests, all at once
#   full        the whole suite (pytest's testpaths: tests/, plugins/, the kit) in eleven concurrent processes,
#               SGLang's pools included when .whl/ is carried (FULL_T seconds each, default 480); FULL_PARTS names
#               some of them only (kit_kernel kit_direct kit_auto tests_core tests_direct tests_direct2 tests_tma
#               tests_replay tests_rest tests_rest2 plugins)
#   checks      tests and sanitize at once (correctness only: they may share the GPU)
#   sanitize    compute-sanitizer memcheck and racecheck (concurrently) over the kernel tests and kit
#   calibrate   hicache calibrate into $OUT/calibration.json; the later steps of the call use it (HICACHE_CALIBRATION),
#               unless KEEP_CALIBRATION=1
#   kernelroom  auto where the kernels' loads are slow (HICACHE_KERNEL_PROGRAMS=KR_PROGRAMS, default 2): hicache calibrate
#               measures them, then pace probes with that calibration and without its kernel_load_ratio, in turn
#   lone        benchmarks/lone_probe.py: single loads through the kernel and auto, call by call (LONE_CELLS, LONE_REPS,
#               LONE_ARGS: --tight times them as the peers harness does)
#   bench       hicache bench (BENCH_ARGS) with GEMM slowdown and host time
#   tma         TMA loads: tests/test_tma.py and the kernel tests (TMA automatic), then load_layer/load_burst of the
#               kernel strategies with TMA on and off (TMA_BENCH_ARGS; the TMA-off run takes TMA_ROW_ARGS when set), GEMM slowdown and host time beside
#   hosttime    benchmarks/host_time.py for the kernel strategies with TMA on and off (cProfile in logs.tgz; HT_ARGS,
#               e.g. "--shapes mla61x576-bf16,mla61x656-fp8 --layouts layer_first,page_first_direct")
#   launchcost  benchmarks/launch_cost.py: a kernel load_layer's host time, part by part (TMA on and off)
#   launchfloor benchmarks/launch_floor.py: one launch's host time by route (driver alone, compiled call, ctypes, Triton)
#   ir          dev/tma_ir.py: shared memory, registers and spills of the TMA load kernel (IR_LAYOUTS)
#   tmasan      compute-sanitizer memcheck and racecheck (concurrently) over tests/test_tma.py -k TMA_SAN_K
#   sanall      both sanitizers over every test file that launches a transfer kernel (the plugins' kernel tests, row
#               copies, relayout, page loads, TMA, replays, launches) and a slice of the kit: one process per tool and
#               part, all at once (SANALL_T seconds each, default 420; SANALL_PARTS names some parts only, SANALL_TOOLS
#               one tool); a line per tool and part
#   place       benchmarks/backup_place_probe.py (why page-major kernel backups of fp8 656-byte rows run at half the
#               link; PLACE_ARGS, e.g. --loads; PLACE_VARIANTS: labels joined by ",", spaces kept), then Nsight
#               Compute over the all-layer backups of PLACE_NCU's variants (labels joined by ";"), one log each, GPU
#               clocks left as they are
#   hints       benchmarks/backup_hint_probe.py: all-layer backups by the row copy with cache hints, a per-tile fence or
#               other launch shapes, the GEMM beside each (HINTS_SHAPES, e.g. mha; HINTS_VARIANTS: labels joined by ",",
#               spaces kept)
#   ncu         Nsight Compute sections of each plugin kernel (one backup, one load; NCU_LAYOUTS, NCU_OPTIONS)
#   pacetests   tests/test_pace.py, test_pace_waits.py, test_reprobe.py and test_direct.py (the copy engine and auto's
#               decisions) on the GPU, and the conformance kit for direct and auto beside them
#   pace        benchmarks/pace_probe.py: load bursts with new index tensors every cycle (PACE_ARGS), then with the same
#               ones (PACE_REUSE_ARGS; --reuse), PACE_SECONDS per cell (default 12), the modes PACE_MODES names (default
#               "fresh reuse"); "--profile /tmp/hicache-work/prof" in
#               either puts each candidate's cProfile into logs.tgz
#   trace       benchmarks/pace_trace.py: where auto's host-pace samples come from in bench rows (TRACE_SHAPES, TRACE_ARGS)
#   watchcost   benchmarks/watch_cost.py: what auto's forward watch adds to a lone load, piece by piece (WC_SHAPES)
#   ab          A/B of one host-pace setting: benchmarks/pace_probe.py with each value of AB_FLAG (default --stale-s) in
#               AB_VALUES (default "1.0 0.25") in turn, for each mode of AB_MODES (default "reuse fresh reuse"), AB_SECONDS
#               per cell (default 6), AB_SHAPES; one line per cell into $OUT/ab.txt
# Timing steps (tune, bench) run alone; correctness steps may overlap each other.
set -uo pipefail
# here, after a call: bash dev/gpu_session.sh --keep-cache FILES_AT (the archive the next call carries in .triton-cache/)
if [ "${1:-}" = --keep-cache ]; then
  a=$(ls "${2:?usage: --keep-cache FILES_AT}"/triton-cache.t?z 2>/dev/null | head -1)
  [ -n "$a" ] || { echo "no triton-cache.txz or .tgz in $2: the cache kept before stays"; exit 1; }
  rm -rf .triton-cache && mkdir -p .triton-cache && cp "$a" .triton-cache/ && ls -la .triton-cache
  exit
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hicache-out}; W=/tmp/hicache-work; mkdir -p "$OUT" "$W"
SUMMARY="$OUT/summary.txt"; : >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
# Triton's compiled kernels carry over between calls: a carried .triton-cache/ (git-ignored) holding the last call's
# $OUT/triton-cache.txz (or .tgz; put there by `bash dev/gpu_session.sh --keep-cache DIR`) seeds the cache, and the
# cache goes back when it fits the device tool's 16 MiB per file (the archive travels, not the cache: it is smaller).  Entries are keyed by kernel source, Triton
# version and target, so a stale one is never used; a fresh machine otherwise compiles every specialisation anew.
export TRITON_CACHE_DIR=/tmp/hicache-triton-cache; mkdir -p "$TRITON_CACHE_DIR"
for a in .triton-cache/triton-cache.t?z; do [ -f "$a" ] && tar xf "$a" -C "$TRITON_CACHE_DIR"; done
pack() {  # xz where the machine has it: Triton's IR text compresses several times better than with gzip
  tar czf "$OUT/logs.tgz" -C "$W" . 2>/dev/null
  local c="$W.cache.tgz" z=z
  command -v xz >/dev/null && c="$W.cache.txz" && z=J
  XZ_OPT=-T0 tar c${z}f "$c" -C "$TRITON_CACHE_DIR" . 2>/dev/null || return
  local size; size=$(stat -c %s "$c" 2>/dev/null || echo 0)
  if [ "$size" -gt 0 ] && [ "$size" -lt $((16 << 20)) ]; then mv "$c" "$OUT/triton-cache.${c##*.}"
  else echo "Triton cache not returned: $size bytes packed, over the 16 MiB a returned file may have" >>"$SUMMARY"; fi
}
trap pack EXIT
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_first -e plugins/page_first \
  -e plugins/kv_split -e tests/plugins/page_head -e tests/plugins/fake_vendor >"$W/install.log" 2>&1 \
  || { note "install FAILED"; tail -20 "$W/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} >"$W/env.txt" 2>&1; cat "$W/env.txt"
PYT="python3 -m pytest -q -p no:cacheprovider --hicache-device cuda"
result() { case $1 in 0) echo PASSED;; 124|137) echo TIMEOUT;; 5) echo "NO TESTS";; *) echo "FAILED rc=$1";; esac; }
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
san() {  # timeout, tool, then the command: the command under compute-sanitizer, as every sanitizer step runs it
  local t=$1 tool=$2; shift 2
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$t" "$SAN" --tool "$tool" --target-processes all --error-exitcode 99 "$@"
}
san_summary() { grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$@" | sort | uniq -c | tr -s ' ' | tr '\n' ';'; }
KERNEL_TESTS="plugins/layer_first/tests/test_layer_first_kernel.py plugins/page_first/tests/test_page_first_kernel.py plugins/kv_split/tests/test_kv_split_kernel.py tests/test_rowcopy.py tests/test_relayout.py"
sanitize_one() {  # tool: the kernel tests (-k SAN_K) then a slice of the kit, both under the sanitizer
  local tool=$1 log="$W/sanitizer_$1.log"
  [ -n "$SAN" ] || { note "$tool: SKIPPED (no compute-sanitizer)"; return; }
  san ${SAN_T:-200} "$tool" $PYT -x $KERNEL_TESTS -k "${SAN_K:-not slow}" >"$log" 2>&1; local r1=$?
  san ${SAN_T:-200} "$tool" $PYT -x --pyargs hicache_core.testing --hicache-io-backend kernel \
    --hicache-io-backend direct --hicache-case mha-fp16-ps1 --hicache-case mla576-bf16-ps16-strided >>"$log" 2>&1
  local r2=$?
  note "$tool: kernel tests $(result $r1), kit slice $(result $r2); $(san_summary "$log")"
}
run_tests() {  # the whole GPU suite in three concurrent pytest processes
  $PYT hicache_core/testing >"$W/tests_kit.log" 2>&1 & local a=$!
  $PYT tests >"$W/tests_tests.log" 2>&1 & local b=$!
  $PYT plugins >"$W/tests_plugins.log" 2>&1 & local c=$!
  ( sleep ${TESTS_T:-400}; kill $a $b $c 2>/dev/null ) & local k=$!
  wait $a; local ra=$?; wait $b; local rb=$?; wait $c; local rc=$?; kill $k 2>/dev/null
  for f in kit tests plugins; do note "tests $f: $(tail -1 "$W/tests_$f.log")"; done
  note "tests: kit $(result $ra), tests/ $(result $rb), plugins/ $(result $rc)"
}
# timing steps note test or sanitizer processes still running (a step or call past its time limit may leave some):
# their figures are then not a quiet machine's
TIMING=" tune hints stress bench hosttime launchcost launchfloor lone place pace watchcost trace ab "
busy() {
  local pat='compute-sanitizer|-m pytest' n; n=$(pgrep -fc "$pat")
  [ "${n:-0}" -eq 0 ] || note "$1: $n test or sanitizer processes still running (timings may be disturbed):" \
    "$(pgrep -fa "$pat" | cut -c1-80 | head -3 | tr '\n' ';')"
}
for step in "$@"; do
  t0=$(date +%s)
  case "$TIMING" in *" $step "*) busy "$step";; esac
  case $step in
    tune) timeout ${TUNE_T:-330} python3 benchmarks/tune_tiles.py --out "$OUT/tune.json" --gemm ${TUNE_ARGS:-} >"$W/tune.log" 2>&1
      note "tune: $(result $?) ($(grep -c '^{' "$W/tune.log") rows)" ;;
    tests) run_tests ;;
    hints) timeout ${HINTS_T:-300} python3 benchmarks/backup_hint_probe.py --out "$OUT/hints.json" \
        ${HINTS_SHAPES:+--shapes "$HINTS_SHAPES"} ${HINTS_VARIANTS:+--variants "$HINTS_VARIANTS"} >"$W/hints.log" 2>&1
      note "hints: $(result $?) ($(grep -c '^{' "$W/hints.log") rows)" ;;
    full) GPU_CORE="tests/test_rowcopy.py tests/test_relayout.py tests/test_direct.py tests/test_launch.py tests/gpu"
      SITE=""; if [ -d .whl ] && bash dev/gpu.sh sglang-site >"$W/sglang_site.log" 2>&1; then SITE=/tmp/sglang-site; fi
      note "full: SGLang site ${SITE:-absent (tests/sglang skip)}"
      T=${FULL_T:-480}
      # a test running past FULL_STALL_S prints every thread's stack; at T pytest gets SIGINT and still prints its
      # summary, slowest tests and a JUnit XML of every test's outcome and time; two CPU threads per process (up to
      # eleven processes share the host's cores)
      PYT="$PYT -o faulthandler_timeout=${FULL_STALL_S:-120} --durations=15"; export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
      PIDS=()
      part() {  # part NAME PYTEST-ARGS...: one process, run when FULL_PARTS (default: every part) names it
        local name=$1; shift
        case " ${FULL_PARTS:-all} " in *" all "*|*" $name "*) ;; *) return;; esac
        PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} timeout -s INT -k 30 $T $PYT --junitxml="$W/full_$name.xml" "$@" \
          >"$W/full_$name.log" 2>&1 &
        PIDS+=("$name $!")
      }
      GPU_HEAVY="tests/test_tma.py tests/test_replay.py"
      REST=$(ls tests/test_*.py | grep -vxF "$(echo $GPU_CORE $GPU_HEAVY | tr ' ' '\n')")
      part kit_kernel hicache_core/testing --hicache-io-backend kernel
      part kit_direct hicache_core/testing --hicache-io-backend direct
      part kit_auto hicache_core/testing --hicache-io-backend auto --hicache-io-backend fakedma
      # the core files apart from test_direct.py (one process with it stopped at 43% in 380 s)
      part tests_core $(for f in $GPU_CORE; do [ $f = tests/test_direct.py ] || echo $f; done)
      # tests/test_direct.py in two halves (one process stopped at 40% in 450 s on the H200): the round trips, the rest
      part tests_direct tests/test_direct.py -k test_round_trip_both_routes
      part tests_direct2 tests/test_direct.py -k "not test_round_trip_both_routes"
      part tests_tma tests/test_tma.py
      part tests_replay tests/test_replay.py
      # the rest of tests/ in two halves (one process stopped at 9% in 450 s): SGLang's bridge and test_[a-e]*, the others
      part tests_rest -rs tests/sglang $(echo "$REST" | grep '^tests/test_[a-e]')
      part tests_rest2 -rs tests/plugins $(echo "$REST" | grep -v '^tests/test_[a-e]')
      part plugins plugins
      for p in "${PIDS[@]}"; do set -- $p; wait $2; note "full $1: $(result $?) $(tail -1 "$W/full_$1.log")"; done ;;
    stress) timeout ${STRESS_T:-150} python3 benchmarks/stress.py --out "$OUT/stress.json" >"$W/stress.log" 2>&1
      r=$?; note "stress: $(result $r); $(tail -3 "$W/stress.log" | tr '\n' ' ')" ;;
    sanitize) sanitize_one memcheck & s1=$!; sanitize_one racecheck & s2=$!; wait $s1 $s2 ;;
    tmasan) for tool in memcheck racecheck; do  # both at once, over tests/test_tma.py -k TMA_SAN_K
        san ${SAN_T:-200} $tool $PYT tests/test_tma.py -k "${TMA_SAN_K:-not round_trip}" >"$W/tmasan_$tool.log" 2>&1 &
      done; wait
      for tool in memcheck racecheck; do
        note "tmasan $tool: $(tail -1 "$W/tmasan_$tool.log"); $(san_summary "$W/tmasan_$tool.log")"
      done ;;
    sanall) [ -n "$SAN" ] || { note "sanall: SKIPPED (no compute-sanitizer)"; continue; }
      SP=()  # NAME=FILES: every file whose tests launch a kernel, split so that no process runs long (racecheck takes
      # ~40 s per replayed GPU burst test: their eight run in two parts; tests/test_tma.py whole reached 71% in 330 s
      # under each tool beside the full suite: its round trips run apart)
      for p in "plugins=plugins/layer_first/tests/test_layer_first_kernel.py plugins/page_first/tests/test_page_first_kernel.py plugins/kv_split/tests/test_kv_split_kernel.py" \
               "rowcopy=tests/test_rowcopy.py" "split=tests/test_launch_split.py tests/test_position_replay.py" \
               "relayout=tests/test_relayout.py" "pages=tests/test_page_loads.py tests/test_page_group_kernel.py tests/test_launch.py" \
               "pagebackups=tests/test_page_backups.py" \
               "tma=tests/test_tma.py -k=not(round_trip)" "tma2=tests/test_tma.py -k=round_trip" \
               "replay=tests/test_replay.py -k=(gpu_replayed_bursts)and(cuda)" \
               "replay4=tests/test_replay.py -k=(gpu_replayed_bursts)and(not(cuda))" \
               "replay2=tests/test_replay.py -k=(replayed_launches_equal)or(resolution_takes)or(data_swap)" \
               "replay3=tests/test_replay.py -k=not(gpu_replayed_bursts)and(not(replayed_launches_equal))and(not(resolution_takes))and(not(data_swap))" \
               "kit=--pyargs hicache_core.testing --hicache-io-backend kernel --hicache-case mha-fp16-ps1 --hicache-case mla576-bf16-ps16-strided"; do
        case " ${SANALL_PARTS:-all} " in *" all "*|*" ${p%%=*} "*) ;; *) continue;; esac
        for tool in ${SANALL_TOOLS:-memcheck racecheck}; do
          san ${SANALL_T:-420} $tool $PYT ${p#*=} >"$W/sanall_${p%%=*}_$tool.log" 2>&1 & SP+=("${p%%=*}_$tool $!")
        done
      done
      for p in "${SP[@]}"; do set -- $p; wait $2; r=$?
        note "sanall $1: $(result $r) $(grep -E '[0-9]+ (passed|failed)' "$W/sanall_$1.log" | tail -1); $(san_summary "$W/sanall_$1.log")"
      done ;;
    checks) sanitize_one memcheck & s1=$!; sanitize_one racecheck & s2=$!
      run_tests; wait $s1 $s2 ;;
    focus) sanitize_one memcheck & s1=$!; sanitize_one racecheck & s2=$!
      timeout ${TESTS_T:-400} $PYT hicache_core/testing --hicache-io-backend kernel --hicache-io-backend direct \
        --hicache-io-backend auto >"$W/focus_kit.log" 2>&1 & a=$!
      timeout ${TESTS_T:-400} $PYT tests/test_relayout.py tests/test_rowcopy.py tests/test_direct.py \
        tests/test_launch.py tests/gpu plugins \
        >"$W/focus_tests.log" 2>&1 & b=$!
      wait $a; ra=$?; wait $b; rb=$?
      note "focus kit: $(result $ra) $(tail -1 "$W/focus_kit.log")"; note "focus tests: $(result $rb) $(tail -1 "$W/focus_tests.log")"
      wait $s1 $s2 ;;
    bench) timeout ${BENCH_T:-300} hicache bench --out "$OUT/bench" --reps ${REPS:-10} --gemm ${BENCH_ARGS:-} >"$W/bench.log" 2>&1
      note "bench: $(result $?)"; grep -v "^hicache bench" "$W/bench.log" | tail -60 ;;
    tma) timeout ${TESTS_T:-240} $PYT tests/test_tma.py $KERNEL_TESTS >"$W/tma_tests.log" 2>&1
      note "tma tests: $(result $?) $(tail -1 "$W/tma_tests.log")"
      for on in 1 0; do
        args=${TMA_BENCH_ARGS:-}; [ $on = 0 ] && args=${TMA_ROW_ARGS:-$args}
        HICACHE_KERNEL_TMA=$on timeout ${BENCH_T:-240} hicache bench --out "$OUT/bench-tma$on" --reps ${REPS:-10} --gemm \
          --io-backends kernel --ops load_layer,load_burst $args >"$W/bench_tma$on.log" 2>&1
        note "bench TMA=$on: $(result $?)"; grep -v "^hicache bench" "$W/bench_tma$on.log" | tail -40; done ;;
    hosttime) for on in 1 0; do
        HICACHE_KERNEL_TMA=$on timeout ${HT_T:-120} python3 benchmarks/host_time.py --out "$W/host-tma$on" --backends kernel ${HT_ARGS:-} \
          --reps ${HT_REPS:-150} >"$W/hosttime_tma$on.log" 2>&1; note "host time TMA=$on: $(result $?)"
        cat "$W/hosttime_tma$on.log"; done ;;
    launchcost) timeout ${LC_T:-150} python3 benchmarks/launch_cost.py --out "$OUT/launch_cost.json" >"$W/launch_cost.log" 2>&1
      note "launch cost: $(result $?)"; cat "$W/launch_cost.log" ;;
    launchfloor) timeout ${LF_T:-60} python3 benchmarks/launch_floor.py --out "$OUT/launch_floor.json" >"$W/launch_floor.log" 2>&1
      note "launch floor: $(result $?)"; tail -1 "$W/launch_floor.log" ;;
    ir) OUT=$W/ir timeout ${IR_T:-120} python3 dev/tma_ir.py ${IR_LAYOUTS:-} >"$W/tma_ir.log" 2>&1
      note "tma ir: $(result $?)"; grep -v "^ " "$W/tma_ir.log" ;;
    calibrate) HICACHE_CALIBRATION=$OUT/calibration.json timeout 120 hicache calibrate >"$W/calibrate.log" 2>&1
      r=$?; note "calibrate: $(result $r)"; tail -16 "$W/calibrate.log"
      # the later steps of this call run with it (auto reads it), as this GPU's users would after `hicache calibrate`
      if [ $r = 0 ] && [ -z "${KEEP_CALIBRATION:-}" ]; then export HICACHE_CALIBRATION=$OUT/calibration.json
        note "  later steps use this calibration (KEEP_CALIBRATION=1: the one they would have used)"; fi ;;
    kernelroom) # auto on a machine whose kernel loads are slow (HICACHE_KERNEL_PROGRAMS=KR_PROGRAMS, default 2, slows
      # them on purpose): hicache calibrate measures them (kernel_load_ratio), then pace probes of KR_SHAPES with that
      # calibration and with the same one less kernel_load_ratio, in turn, new and reused indices (KR_SECONDS per cell)
      export HICACHE_KERNEL_PROGRAMS=${KR_PROGRAMS:-2}
      HICACHE_CALIBRATION=$OUT/cal_kr.json timeout 150 hicache calibrate >"$W/kr_calibrate.log" 2>&1; r=$?
      note "kernelroom calibrate (programs $HICACHE_KERNEL_PROGRAMS): $(result $r) $(grep -h 'kernel load bursts' "$W/kr_calibrate.log" | tr '\n' ';')"
      if [ $r != 0 ] || ! grep -q kernel_load_ratio "$OUT/cal_kr.json" 2>/dev/null; then
        note "kernelroom: no kernel_load_ratio measured: no probes (see kr_calibrate.log)"; unset HICACHE_KERNEL_PROGRAMS; continue; fi
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [e.pop('kernel_load_ratio', None) for e in d.values()]; json.dump(d, open(sys.argv[2], 'w'))" \
        "$OUT/cal_kr.json" "$OUT/cal_kr_without.json"
      for mode in reuse fresh; do for cal in with without; do
        f=$OUT/cal_kr.json; [ $cal = without ] && f=$OUT/cal_kr_without.json
        extra=""; [ $mode = reuse ] && extra="--reuse"
        HICACHE_CALIBRATION=$f timeout 150 python3 benchmarks/pace_probe.py --out "$OUT/kr-$mode-$cal.json" \
          --shapes "${KR_SHAPES:-mla61x576-fp8,mla61x576-bf16}" --layouts "${KR_LAYOUTS:-layer_first}" \
          --seconds "${KR_SECONDS:-10}" $extra 2>&1 | grep '^{' | TAG="$mode kernel_load_ratio:$cal" python3 -c "
import json, os, sys
for line in sys.stdin:
    s = json.loads(line)
    m = s['median']
    print(os.environ['TAG'], s['shape'], s['layout'], 'k %.3f d %.3f a %.3f gap %+.4f within %.2f' % (
        m['kernel'], m['direct'], m['auto'], s['auto_gap_median'], s['auto_within_3pts_share']))
" | tee -a "$OUT/kernelroom.txt"; done; done
      unset HICACHE_KERNEL_PROGRAMS; note "kernelroom: $(wc -l <"$OUT/kernelroom.txt") cells" ;;
    lone) timeout ${LONE_T:-150} python3 benchmarks/lone_probe.py --out "$OUT/lone.json" --reps ${LONE_REPS:-30} ${LONE_ARGS:-} \
        ${LONE_CELLS:+--cells $LONE_CELLS} >"$W/lone.log" 2>&1
      note "lone probe: $(result $?)"; cat "$W/lone.log" ;;
    ncu) opts='{}'; [ -n "${NCU_OPTIONS:-}" ] && opts=$NCU_OPTIONS
      for lay in ${NCU_LAYOUTS:-layer_first page_first page_first_kv_split}; do
        timeout ${NCU_T:-60} ncu --target-processes all -k regex:KERNEL --launch-skip 4 --launch-count 2 \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
          python3 benchmarks/profile_kernel.py --layout $lay --options "$opts" >"$W/ncu_$lay.log" 2>&1
        note "ncu $lay: $(result $?)"; done ;;
    place) timeout ${PLACE_T:-300} python3 benchmarks/backup_place_probe.py --out "$OUT/place.json" --gemm \
        ${PLACE_ARGS:-} ${PLACE_VARIANTS:+--variants "$PLACE_VARIANTS"} >"$W/place.log" 2>&1
      note "backup place probe: $(result $?)"; cat "$W/place.log"
      IFS=';' read -ra labels <<<"${PLACE_NCU:-fp8-656 layer_first;fp8-656 page_first_direct;fp8-656 page_first_direct runtime page_size}"
      for lab in "${labels[@]}"; do f="$W/ncu_place_${lab// /_}.log"
        timeout ${NCU_T:-90} ncu --target-processes all --clock-control none -k regex:KERNEL$ --launch-skip 2 \
          --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
          --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
          --section InstructionStats --metrics lts__t_sectors_aperture_sysmem_op_write.sum,lts__t_requests_aperture_sysmem_op_write.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,smsp__sass_inst_executed_op_global_st.sum,smsp__sass_inst_executed_op_global_ld.sum \
          python3 benchmarks/backup_place_probe.py --profile "$lab" >"$f" 2>&1
        note "ncu $lab: $(result $?)"; grep -E "Duration|Registers Per|Memory Throughput|DRAM Throughput|lts__t_sectors_aperture_sysmem_op_write.sum|lts__t_requests_aperture|local_op|inst_executed_op_global|Executed Instructions  |Warp Cycles Per Issued|Stall|No Eligible|Issued Warp" "$f" | head -40
      done ;;
    pacetests) timeout ${TESTS_T:-300} $PYT hicache_core/testing --hicache-io-backend direct --hicache-io-backend auto \
        >"$W/pace_kit.log" 2>&1 & a=$!
      timeout ${TESTS_T:-300} $PYT tests/test_pace.py tests/test_pace_waits.py tests/test_reprobe.py tests/test_direct.py \
        >"$W/pace_tests.log" 2>&1; r=$?
      wait $a; ra=$?
      note "pace tests: $(result $r) $(tail -1 "$W/pace_tests.log")"; note "kit direct+auto: $(result $ra) $(tail -1 "$W/pace_kit.log")" ;;
    pace) for mode in ${PACE_MODES:-fresh reuse}; do
        if [ $mode = fresh ]; then args=${PACE_ARGS:-}; else args="--reuse ${PACE_REUSE_ARGS:-}"; fi
        timeout ${PACE_T:-300} python3 benchmarks/pace_probe.py --out "$OUT/pace-$mode.json" \
          --seconds ${PACE_SECONDS:-12} $args >"$W/pace_$mode.log" 2>&1
        note "pace probe ($mode): $(result $?)"; cat "$W/pace_$mode.log"; done ;;
    watchcost) for sh in ${WC_SHAPES:-mla61x576-bf16}; do
        timeout ${WC_T:-150} python3 benchmarks/watch_cost.py --shape $sh --out "$OUT/watch_cost-$sh.json" \
          >"$W/watch_cost_$sh.log" 2>&1
        note "watch cost ($sh): $(result $?)"; cat "$W/watch_cost_$sh.log"; done ;;
    trace) for sh in ${TRACE_SHAPES:-mla61x656-fp8}; do
        timeout ${TRACE_T:-240} python3 benchmarks/pace_trace.py --out "$OUT/trace-$sh.json" --shape $sh \
          ${TRACE_ARGS:-} >"$W/trace_$sh.log" 2>&1
        note "pace trace ($sh): $(result $?)"; cat "$W/trace_$sh.log"; done ;;
    ab) for mode in ${AB_MODES:-reuse fresh reuse}; do for v in ${AB_VALUES:-1.0 0.25}; do
        extra=""; [ "$mode" = reuse ] && extra="--reuse"
        timeout 100 python3 benchmarks/pace_probe.py --out "$OUT/ab-$mode-$v-$RANDOM.json" \
          --shapes "${AB_SHAPES:-mla61x576-bf16,mla61x656-fp8}" --seconds "${AB_SECONDS:-6}" "${AB_FLAG:---stale-s}" "$v" \
          $extra 2>&1 | grep '^{' | TAG="$mode ${AB_FLAG:---stale-s}=$v" python3 -c "
import json, os, sys
for line in sys.stdin:
    s = json.loads(line)
    m = s['median']
    print(os.environ['TAG'], s['shape'], s['layout'], 'k %.3f d %.3f a %.3f gap %+.4f within %.2f probes %d' % (
        m['kernel'], m['direct'], m['auto'], s['auto_gap_median'], s['auto_within_3pts_share'], s['auto_probes']))
" | tee -a "$OUT/ab.txt"; done; done
      note "pace A/B: $(wc -l <"$OUT/ab.txt") cells" ;;
    *) note "unknown step $step" ;;
  esac
  note "  ($step took $(( $(date +%s) - t0 )) s)"
done
echo "=== summary ==="; cat "$SUMMARY"

#!/usr/bin/env bash
# Reliability run on one CUDA GPU (< 6 minutes: install 60 s at most, stress 130 s, 4 sanitizer runs 170 s): the stress benchmark, then compute-sanitizer
# memcheck and racecheck over a small selection of kernel and conformance tests.
# Usage: bash dev/gpu_reliability.sh ; logs and stress.json under $OUT (default /tmp/hicache-out).
# Every step runs under `timeout`; the last lines printed are a summary (one line per step).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hicache-out}; mkdir -p "$OUT"
SUMMARY="$OUT/reliability_summary.txt"; : >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# install (editable, offline) and record the environment, as dev/gpu.sh does
timeout 60 bash dev/gpu.sh none || { note "install: FAILED (see $OUT/install.log)"; exit 1; }
cat "$OUT/env.txt"

# 1. stress: interleaved transfers on 4 streams, SGLang-shaped threads, 100 pool lifecycles
timeout ${STRESS_TIMEOUT:-130} python3 benchmarks/stress.py --out "$OUT/stress.json" >"$OUT/stress.log" 2>&1
rc=$?; tail -5 "$OUT/stress.log"
note "stress: rc=$rc ($( [ $rc = 0 ] && echo PASSED || { [ $rc = 124 ] && echo TIMEOUT || echo FAILED; } )) log stress.log, json stress.json"

# 2-3. compute-sanitizer over a small selection (Triton JIT under the sanitizer is slow: keep it small)
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
KERNEL_TESTS=(plugins/layer_first/tests/test_layer_first_kernel.py plugins/page_first/tests/test_page_first_kernel.py
              plugins/kv_split/tests/test_kv_split_kernel.py)
KIT=(--pyargs hicache_core.testing --hicache-device cuda --hicache-io-backend kernel
     --hicache-case mha-fp16-ps1 --hicache-case mla576-bf16-ps16-strided -k "load_all_layers or per_layer_backup")
# masking of out-of-range indices, odd alignments and strides, both index dtypes: where an access could stray
SAN_K=${SAN_K:-"out_of_range or odd_alignment or odd_device_stride or int32_and_int64 or index_dtypes"}
run_sanitizer() {  # tool, seconds for each of its two runs
  local tool=$1 limit=$2 log="$OUT/sanitizer_$1.log"
  if [ -z "$SAN" ]; then note "$tool: SKIPPED (compute-sanitizer not found)"; return; fi
  # exact allocations, so that an out-of-bounds access is not hidden inside a cached block
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" "$SAN" --tool "$tool" --target-processes all \
    --error-exitcode 99 python3 -m pytest -q -x -p no:cacheprovider "${KERNEL_TESTS[@]}" -k "$SAN_K" >"$log" 2>&1
  local rc1=$?
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" "$SAN" --tool "$tool" --target-processes all \
    --error-exitcode 99 python3 -m pytest -q -x -p no:cacheprovider "${KIT[@]}" >>"$log" 2>&1
  local rc2=$?
  local summary; summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" | sort | uniq -c | tr '\n' ';')
  note "$tool: kernel tests rc=$rc1, conformance rc=$rc2 (0 ok, 99 sanitizer errors, 124 timeout); summaries: ${summary:-none}; log sanitizer_$tool.log"
}
run_sanitizer memcheck ${MEMCHECK_TIMEOUT:-45}
run_sanitizer racecheck ${RACECHECK_TIMEOUT:-40}

echo "=== summary ==="; cat "$SUMMARY"

#!/usr/bin/env bash
# One GPU call: install offline, GPU tests, copy-engine calibration and benchmarks; logs under $OUT.
# Usage (on a CUDA machine): bash dev/gpu_run.sh STEP...   steps: tests conformance calibrate bench-ce bench-full
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hicache-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_first -e plugins/page_first \
  -e plugins/kv_split -e tests/plugins/page_head -e tests/plugins/fake_vendor >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "from hicache_core.backends.cudart import runtime; r = runtime(); print('cudart', r.path, r.version, 'batch', r.has_batch)"
} >"$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
for step in "$@"; do
  case $step in
    conformance) timeout ${T_CONF:-200} python3 -m pytest -q -p no:cacheprovider -x --hicache-device cuda \
        hicache_core/testing tests/test_direct.py --hicache-io-backend direct --hicache-io-backend auto >"$OUT/conformance.log" 2>&1
      echo "conformance rc=$?"; tail -4 "$OUT/conformance.log" ;;
    tests) timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider --hicache-device cuda >"$OUT/gpu_tests.log" 2>&1
      echo "tests rc=$?"; tail -6 "$OUT/gpu_tests.log" ;;
    calibrate) HICACHE_CALIBRATION=$OUT/calibration.json timeout 120 hicache calibrate >"$OUT/calibrate.log" 2>&1
      echo "calibrate rc=$?"; cat "$OUT/calibrate.log" | tail -16 ;;
    bench-ce) timeout ${T_BENCH:-300} hicache bench --out "$OUT/ce" --shapes ${SHAPES:-mla61x576-bf16,mha80x8x128-bf16} \
        --layouts ${LAYOUTS:-layer_first,page_first,page_first_direct,page_first_kv_split} --tokens ${TOKENS:-4096} --page-sizes ${PAGES:-64} --programs 0 --io-backends kernel,direct,auto \
        --direct-variants ${DVARIANTS:-auto} --reps ${REPS:-10} ${GEMM:---gemm} >"$OUT/bench_ce.log" 2>&1
      echo "bench-ce rc=$?"; grep -v "^hicache bench" "$OUT/bench_ce.log" | tail -80 ;;
  esac
done

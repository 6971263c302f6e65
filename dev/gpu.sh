#!/usr/bin/env bash
# One GPU session: install offline, run the GPU test suites, then the benchmark.
# Usage (device tool): bash dev/gpu.sh [tests|bench|sglang|sglang-site|all|none] ; logs under $OUT.
# 'sglang' runs tests/sglang against SGLang 0.5.23 on the GPU: fetch .whl/ first (dev/sglang_wheels.sh)
# and name .whl in the device call's carry.  'sglang-site' only installs them into /tmp/sglang-site
# (dev/gpu_peers.sh uses it).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hicache-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_first -e plugins/page_first \
  -e plugins/kv_split -e tests/plugins/page_head -e tests/plugins/fake_vendor >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv;
  python3 -c "import torch, triton, pluggy; print('torch', torch.__version__, 'triton', triton.__version__, 'pluggy', pluggy.__version__)"; } >"$OUT/env.txt" 2>&1
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 200 hicache verify >"$OUT/verify.log" 2>&1; echo "verify rc=$?"; tail -3 "$OUT/verify.log"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -x --hicache-device cuda "$@" >"$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?"; tail -5 "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-400} hicache bench --out "$OUT" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -v "^hicache bench" "$OUT/bench.log" | tail -40
fi
sglang_site() {  # .whl/ (dev/sglang_wheels.sh) installed offline into $SITE: SGLang trimmed and its light deps
  [ -d .whl ] || { echo "no .whl/: run dev/sglang_wheels.sh here and carry .whl"; exit 1; }
  mkdir -p "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >"$OUT/sglang_install.log" 2>&1 || { tail -20 "$OUT/sglang_install.log"; exit 1; }
  tar xzf .whl/sglang-*-trimmed.tar.gz -C "$SITE"
}
SITE=/tmp/sglang-site
if [ "$what" = sglang ] || [ "$what" = sglang-site ]; then sglang_site; fi
if [ "$what" = sglang ]; then
  PYTHONPATH="$SITE" timeout ${SGLANG_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs tests/sglang "$@" \
    >"$OUT/sglang_tests.log" 2>&1
  echo "sglang pytest rc=$?"; tail -15 "$OUT/sglang_tests.log"
fi

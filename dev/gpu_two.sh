#!/usr/bin/env bash
# Two-GPU session (a machine with >= 2 GPUs): install offline, record the topology, run tests/gpu, then the
# two-GPU benchmark.  Every step runs under `timeout`; the whole script stays under 5 minutes.
# Usage: bash dev/gpu_two.sh [tests|bench|all] ; logs and results under $OUT (6 files):
#   install.log  env.txt (GPUs, PCIe links, nvidia-smi topo -m, versions)  gpu_two_tests.log
#   two_gpu.log (benchmark progress + tables)  two_gpu.json  two_gpu.md (ready markdown tables + topology)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/hicache-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
t0=$SECONDS
timeout 60 python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_first -e plugins/page_first \
  -e plugins/kv_split -e tests/plugins/page_head -e tests/plugins/fake_vendor >"$OUT/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  echo; echo "nvidia-smi topo -m:"; timeout 30 nvidia-smi topo -m; echo
  timeout 40 python3 -c "import torch, triton, pluggy; print('torch', torch.__version__, 'triton', triton.__version__, \
'pluggy', pluggy.__version__, 'cuda devices', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  HICACHE_CP_TEST_TIMEOUT=${CP_TIMEOUT:-100} timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs \
    tests/gpu "$@" >"$OUT/gpu_two_tests.log" 2>&1
  echo "tests/gpu rc=$? ($((SECONDS - t0)) s so far)"; tail -25 "$OUT/gpu_two_tests.log"
  # the copy engine's staged route on every layout (the variable selects it where the backend knows it)
  { echo; echo "== HICACHE_DIRECT_STAGING=always: direct and auto off the current device =="
    HICACHE_DIRECT_STAGING=always timeout 60 python3 -m pytest -q -p no:cacheprovider -rs \
      tests/gpu/test_off_current_device.py -k "direct or auto"; echo "rc=$?"; } >>"$OUT/gpu_two_tests.log" 2>&1
  tail -4 "$OUT/gpu_two_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  left=$((275 - (SECONDS - t0))); [ $left -gt ${BENCH_TIMEOUT:-150} ] && left=${BENCH_TIMEOUT:-150}
  [ $left -lt 20 ] && left=20  # the benchmark keeps what it measured when its --timeout ends it
  timeout $((left + 15)) python3 benchmarks/two_gpu.py --out "$OUT" --timeout $left ${BENCH_ARGS:-} >"$OUT/two_gpu.log" 2>&1
  echo "two_gpu rc=$? ($((SECONDS - t0)) s in all)"; grep -v "^GPU[0-9]" "$OUT/two_gpu.log" | tail -100
fi

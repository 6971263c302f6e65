#!/usr/bin/env bash
# Peer benchmark on the GPU machine: hicache beside SGLang 0.5.23's JIT HiCache kernels (built here
# with nvcc through apache-tvm-ffi) and LMCache 0.5.3's multi-layer kernel, same buffers, same run.
# Fetch .whl/ first (bash dev/sglang_wheels.sh, where a package index is reachable) and carry it.
# Usage (device call, carry .whl): bash dev/gpu_peers.sh [extra benchmarks/peers.py options]
# Output under $OUT: peers.json (rewritten after every row), peers.log, peers.md (the table), env.
# The default grid (benchmarks/peers.py DEFAULT_CELLS, most important cells first) stops starting
# new targets after PEERS_BUDGET seconds (default 330, JIT builds included); PEERS_TIMEOUT kills it.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hicache-out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
bash dev/gpu.sh sglang-site || exit 1  # the project (editable) and /tmp/sglang-site, offline
# LMCache's ops apart from SGLang's site: SGLang's own lmcache storage backend must not see them.
mkdir -p /tmp/lmcache-ops && tar xzf .whl/lmcache-*-c_ops-*.tar.gz -C /tmp/lmcache-ops || echo "no LMCache ops in .whl/"
export PYTHONPATH=/tmp/sglang-site:/tmp/lmcache-ops${PYTHONPATH:+:$PYTHONPATH}
export SGLANG_JIT_CACHE_DIR=${SGLANG_JIT_CACHE_DIR:-/tmp/sglang-jit}
{ cat "$OUT/env.txt"; nvcc --version 2>&1 | tail -2; nproc; } >"$OUT/peers_env.txt" 2>&1
echo "peers: start $(date +%T), budget ${PEERS_BUDGET:-330} s"
n=$(pgrep -fc 'compute-sanitizer|-m pytest')  # leftovers of an earlier step past its time limit disturb the timings
[ "${n:-0}" -eq 0 ] || echo "peers: $n test or sanitizer processes still running (timings may be disturbed)"
timeout -k 10 ${PEERS_TIMEOUT:-440} python3 -m benchmarks.peers --out "$OUT" --time-budget ${PEERS_BUDGET:-330} "$@" \
  >"$OUT/peers.md" 2>"$OUT/peers.log"
rc=$?
echo "peers rc=$rc at $(date +%T) ($(grep -c . "$OUT/peers.log") log lines)"
grep -E "sglang|lmcache|not registered|Error|error" "$OUT/peers.log" | grep -v " ok " | head -20
cat "$OUT/peers.md"
[ -s "$OUT/peers.md" ] || { echo "no table (killed?); last log lines:"; tail -30 "$OUT/peers.log"; }
exit $rc

#!/usr/bin/env bash
# A/B of auto's host-pace settings on the GPU: benchmarks/pace_probe.py (indices reused, then new every batch) with
# each setting in turn, alternating, one line per cell into $OUT/ab.txt.
#   AB_FLAG    the probe option varied (default --stale-s)      AB_VALUES  its values (default "1.0 0.25")
#   AB_MODES   probe modes in order (default "reuse fresh reuse")  AB_SECONDS  seconds per cell (default 6)
#   AB_SHAPES  (default mla61x576-bf16,mla61x656-fp8)           AB_TESTS=1  first tests/test_pace.py and test_direct.py
set -u
OUT=${OUT:-/tmp/hicache-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_first -e plugins/page_first \
  -e plugins/kv_split -e tests/plugins/page_head -e tests/plugins/fake_vendor >/dev/null 2>&1 || echo "install failed"
if [ "${AB_TESTS:-0}" = 1 ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_pace.py tests/test_direct.py 2>&1 | tail -2 \
    | tee "$OUT/gpu-pace-tests.log"
fi
for mode in ${AB_MODES:-reuse fresh reuse}; do for v in ${AB_VALUES:-1.0 0.25}; do
  extra=""; [ "$mode" = reuse ] && extra="--reuse"
  timeout 100 python3 benchmarks/pace_probe.py --out "$OUT/ab-$mode-$v-$RANDOM.json" \
    --shapes "${AB_SHAPES:-mla61x576-bf16,mla61x656-fp8}" --seconds "${AB_SECONDS:-6}" "${AB_FLAG:---stale-s}" "$v" $extra \
    2>&1 | grep '^{' | TAG="$mode ${AB_FLAG:---stale-s}=$v" python3 -c "
import json, os, sys
for line in sys.stdin:
    s = json.loads(line)
    m = s['median']
    print(os.environ['TAG'], s['shape'], s['layout'], 'k %.3f d %.3f a %.3f gap %+.4f within %.2f probes %d' % (
        m['kernel'], m['direct'], m['auto'], s['auto_gap_median'], s['auto_within_3pts_share'], s['auto_probes']))
" | tee -a "$OUT/ab.txt"
done; done

set -u
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_first -e plugins/page_first -e plugins/kv_split -e tests/plugins/page_head -e tests/plugins/fake_vendor >/dev/null 2>&1 || echo install failed
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_pace.py tests/test_direct.py 2>&1 | tail -2 | tee $OUT/gpu-pace-tests.log
for mode in reuse fresh reuse; do for m in 3 7; do
  extra=""; [ $mode = reuse ] && extra="--reuse"
  timeout 100 python3 benchmarks/pace_probe.py --out $OUT/ab-$mode-m$m-$RANDOM.json --shapes mla61x576-bf16,mla61x656-fp8 --seconds 6 --min-samples $m $extra 2>&1 | grep '^{' | python3 -c "
import sys,json
for l in sys.stdin:
    s=json.loads(l); print('$mode m=$m', s['shape'], s['layout'], 'k %.3f d %.3f a %.3f gap %+.4f within %.2f probes %d' % (s['median']['kernel'], s['median']['direct'], s['median']['auto'], s['auto_gap_median'], s['auto_within_3pts_share'], s['auto_probes']))
" | tee -a $OUT/ab.txt
done; done

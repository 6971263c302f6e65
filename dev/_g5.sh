set -u
mkdir -p $OUT/t $OUT/peers
bash dev/gpu.sh sglang-site > $OUT/t/site.log 2>&1 || { tail $OUT/t/site.log; exit 1; }
PYT="python3 -m pytest -q -p no:cacheprovider --hicache-device cuda"
GPU_CORE="tests/test_rowcopy.py tests/test_relayout.py tests/test_direct.py tests/test_launch.py tests/gpu"
timeout 330 $PYT $GPU_CORE > $OUT/t/core.log 2>&1 & a=$!
PYTHONPATH=/tmp/sglang-site timeout 330 $PYT -rs tests $(for f in $GPU_CORE tests/test_tma.py tests/test_replay.py; do echo --ignore=$f; done) > $OUT/t/rest.log 2>&1 & b=$!
timeout 330 $PYT hicache_core/testing --hicache-io-backend direct --hicache-io-backend auto --hicache-io-backend fakedma > $OUT/t/kit_other.log 2>&1 & c=$!
wait $a; echo "core rc=$? $(tail -1 $OUT/t/core.log)"
wait $b; echo "rest rc=$? $(tail -1 $OUT/t/rest.log)"
wait $c; echo "kit_other rc=$? $(tail -1 $OUT/t/kit_other.log)"
grep -h "^FAILED\|^ERROR" $OUT/t/*.log | head -20
OUT=$OUT/peers PEERS_BUDGET=140 PEERS_TIMEOUT=190 bash dev/gpu_peers.sh --cells mla61x656-fp8@4096 --layouts layer_first,page_first_direct --programs 0 --io-backends kernel,auto > $OUT/peers/run.log 2>&1; echo "peers rc=$?"
grep "^|" $OUT/peers/peers.md | grep -E "load_layer|load_burst \|" | cut -c1-160

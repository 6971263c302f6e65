"""Per-call view of ``auto``'s lone one-layer loads on a GPU: which candidate served each call and its time.

Usage (GPU): ``python dev/auto_lone_probe.py`` (or ``... SHAPE LAYOUT``: the call sequence of ``hicache bench``'s
lone row for ``auto``, each call's route and times, and a profile; or ``... bench [SHAPE LAYOUT]``: the bench's own
rows of one cell, MLA ``layer_first`` by default, with how many of ``auto``'s loads took its lane; or ``... peers
SHAPE LAYOUT``: the peer benchmark's hicache load rows of one cell, with the same counts).  For MLA 61 x 576 bf16 and MHA 80 x 8 x 128 bf16 (4096 tokens,
page 64, GPU-resident indices), layouts ``layer_first`` and ``page_first_direct``: 12 lone ``load_layer`` calls
(each after a synchronise) through ``auto`` and through the kernel, event-timed, with the route ``auto`` took.
A diagnostic, not a benchmark: medians and ratios are in ``hicache bench``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache_core.bench import SHAPES, _device_buffers, _indices  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402


def _calls(pool: HostKVPool, layer: int, hi: torch.Tensor, di: torch.Tensor, pause: float) -> list[tuple]:
    """15 lone calls (synchronised before each, then ``pause`` seconds): (route, device us, host us) each."""
    calls = []
    for _ in range(15):
        torch.cuda.synchronize()
        if pause:
            time.sleep(pause)
        lone = getattr(pool.strategy, "lone_kernel_loads", None)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        pool.load_layer(layer, hi, di)
        host_us = (time.perf_counter() - t0) * 1e6
        b.record()
        b.synchronize()
        route = "kernel" if lone is None or pool.strategy.lone_kernel_loads > lone else "direct"  # type: ignore
        calls.append((route, round(a.elapsed_time(b) * 1e3, 1), round(host_us, 1)))
    return calls


def main() -> None:
    reg = create_registry()
    for shape in ("mla61x576-bf16", "mha80x8x128-bf16"):
        spec = SHAPES[shape](4096, 64, torch.device("cuda"))
        dev = _device_buffers(spec, 2 * 4096 + 64)
        hi, _, di = _indices(spec, torch.Generator().manual_seed(0))
        hi, di = hi.cuda(), di.cuda()
        layer = spec.layer_map.device_layers[len(spec.layer_map.device_layers) // 2]
        for layout in ("layer_first", "page_first_direct"):
            host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
            for backend in ("auto", "kernel"):
                pool = HostKVPool(spec, layout, backend, dev, host_buffers=host, registry=reg, validate="shapes")
                for pause in (0.001, 0.0):
                    calls = _calls(pool, layer, hi, di, pause)
                    print(json.dumps({"shape": shape, "layout": layout, "backend": backend, "pause": pause,
                                      "lanes": [x is not None for x in pool._lanes],
                                      "median_us": statistics.median(c[1] for c in calls[3:]), "calls": calls}),
                          flush=True)
                del pool


if __name__ == "__main__" and len(sys.argv) == 1:
    main()


def bench_sequence(shape: str, layout: str) -> None:
    """The calls ``hicache bench`` makes for ``auto``'s lone ``load_layer`` row (its data check first, the middle
    layer), each with its route, host and device time; then a profile of five more."""
    import cProfile
    import io
    import pstats

    from hicache_core.bench import _check

    reg = create_registry()
    spec = SHAPES[shape](4096, 64, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * 4096 + 64)
    h, s, d = _indices(spec, torch.Generator().manual_seed(0))
    host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
    pool = HostKVPool(spec, layout, "auto", dev, host_buffers=host, registry=reg, validate="shapes")
    _check(pool, dev, h, s, d)
    owned = spec.layer_map.device_layers
    calls = _calls(pool, owned[len(owned) // 2], h, d, 0.0)
    print(json.dumps({"bench_sequence": f"{shape} {layout}", "calls": calls}), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    _calls(pool, owned[len(owned) // 2], h, d, 0.0)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
    print(buf.getvalue()[-4000:], flush=True)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] not in ("bench", "peers"):
    bench_sequence(sys.argv[1], sys.argv[2])


def _count_auto() -> dict[str, int]:
    """Patch ``AutoStrategy`` to count its lane's answers, its checked-path loads and their lone verdicts."""
    from hicache_core.backends.auto import AutoStrategy

    stats = {"lane_true": 0, "lane_false": 0, "load": 0, "lone_true": 0, "lone_false": 0}
    make_lane, load, lone = AutoStrategy.lane, AutoStrategy.load, AutoStrategy._lone

    def lane(self, binding, to_host):  # type: ignore[no-untyped-def]
        inner = make_lane(self, binding, to_host)
        if inner is None or to_host:
            return inner

        def counted(layer, h, d):  # type: ignore[no-untyped-def]
            ok = inner(layer, h, d)
            stats["lane_true" if ok else "lane_false"] += 1
            return ok
        return counted

    def counted_load(self, *a):  # type: ignore[no-untyped-def]
        stats["load"] += 1
        return load(self, *a)

    def counted_lone(self, *a):  # type: ignore[no-untyped-def]
        verdict = lone(self, *a)
        stats["lone_true" if verdict else "lone_false"] += 1
        return verdict

    AutoStrategy.lane, AutoStrategy.load, AutoStrategy._lone = lane, counted_load, counted_lone  # type: ignore
    return stats


def bench_rows(gemm: bool, shape: str = "mla61x576-bf16", layout: str = "layer_first") -> None:
    """``hicache bench``'s own rows for one cell (``kernel`` and ``auto``; ``load_layer`` alone, then
    with the backup and burst rows and the GEMM before it when ``gemm``), with how many of ``auto``'s calls its lane
    took, declined, or never saw (the pool's checked path)."""
    from hicache_core.bench import run_bench

    stats = _count_auto()
    print(json.dumps({"cell": f"{shape} {layout}"}), flush=True)
    ops = ["backup_all_layers", "load_layer", "load_burst"] if gemm else ["load_layer"]
    for row in run_bench(shapes=[shape], tokens=[4096], page_sizes=[64], programs=[None], layouts=[layout], backends=["kernel", "auto"], ops=ops, reps=10, gemm=gemm):
        print(json.dumps({"gemm_rows": gemm, "backend": row.io_backend, "variant": row.variant, "op": row.op,
                          "ratio": round(row.ratio, 3), "host_us": round(row.host_us, 1), "served_by": row.served_by,
                          "auto_calls": dict(stats)}), flush=True)


def peers_rows(shape: str, layout: str) -> None:
    """The peer benchmark's hicache rows of one cell (``kernel`` then ``auto``, loads), with ``auto``'s counts
    after them (``python dev/auto_lone_probe.py peers SHAPE LAYOUT``)."""
    from benchmarks import peers

    stats = _count_auto()
    peers.main(["--out", "/tmp/auto-lone-peers", "--peers", "hicache", "--cells", f"{shape}@4096", "--layouts", layout,
                "--programs", "0", "--io-backends", "kernel,auto", "--ops", "load_layer,load_burst"])
    print(json.dumps({"peers_cell": f"{shape} {layout}", "auto_calls": stats}), flush=True)


if __name__ == "__main__" and len(sys.argv) > 3 and sys.argv[1] == "peers":
    peers_rows(sys.argv[2], sys.argv[3])
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "bench":
    cell = sys.argv[2:4] if len(sys.argv) > 3 else ["mla61x576-bf16", "layer_first"]
    bench_rows(False, *cell)
    bench_rows(True, *cell)

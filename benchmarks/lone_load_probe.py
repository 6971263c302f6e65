"""A lone ``load_layer`` on an idle stream: small runtime calls first, or one call?

Usage (GPU): ``python benchmarks/lone_load_probe.py [--out DIR]``.  ``direct`` submits a load on an
idle stream in small ``cudaMemcpyBatchAsync`` calls first (16 descriptors each, so the copy engine
starts early; :func:`hicache_core.backends.cudart.batch_schedule`), and in a burst in one call.  This
probe times lone loads (synchronised after each) with the small calls forced on and off, alternating
rounds in one process, through ``HostKVPool.load_layer`` (MLA 61 x 576 bf16 and MHA 80 x 8 x 128 bf16,
4096 tokens, page 64, random pages, separately allocated device layers, indices on the GPU).
Ratio to a pinned ``copy_`` of the same bytes; host time per call.  Results: ``<out>/lone_load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hicache_core.bench import _Memcpy, _workload
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    require_cuda(__file__)
    os.makedirs(args.out, exist_ok=True)
    reg = create_registry()
    memcpy = _Memcpy()
    rows = []
    for shape in ("mla61x576-bf16", "mha80x8x128-bf16"):
        spec, dev, h, _, d = _workload(shape)
        layer = spec.layer_map.device_layers[len(spec.layer_map.device_layers) // 2]
        nbytes = spec.bytes_per_token // len(spec.layer_map.device_layers) * 4096
        base = memcpy.gbps(nbytes, False, 20)
        for layout in ("layer_first", "page_first_direct"):
            host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
            pool = HostKVPool(spec, layout, "direct", dev, host_buffers=host, strategy="core.direct", registry=reg)
            clock = pool.binding.scratch["direct.copier"].clock
            real = clock.eager
            res: dict[str, dict[str, list[float]]] = {m: {"ms": [], "host": []} for m in ("small calls first", "one call")}
            for _ in range(3):
                pool.load_layer(layer, h, d)
            for _ in range(args.rounds):
                for mode in res:
                    clock.eager = (lambda *a, _m=mode, **k: _m == "small calls first")  # type: ignore[method-assign]
                    for _ in range(args.reps):
                        torch.cuda.synchronize()
                        time.sleep(0.001)  # an idle stream, well past any burst
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        t0 = time.perf_counter()
                        pool.load_layer(layer, h, d)
                        res[mode]["host"].append((time.perf_counter() - t0) * 1e6)
                        b.record()
                        b.synchronize()
                        res[mode]["ms"].append(a.elapsed_time(b))
            clock.eager = real  # type: ignore[method-assign]
            for mode, r in res.items():
                ms = statistics.median(r["ms"])
                row = {"shape": shape, "layout": layout, "mode": mode, "bytes": nbytes,
                       "ratio": nbytes / ms / 1e6 / base, "host_us": statistics.median(r["host"])}
                rows.append(row)
                print(f"{shape:18s} {layout:18s} {mode:18s} ratio {row['ratio']:.3f} host {row['host_us']:6.1f} us",
                      flush=True)
            del pool, host
    with open(os.path.join(args.out, "lone_load.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

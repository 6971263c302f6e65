"""Token-major ``page_first`` loads through TMA vs the row kernel: does the pool's capacity or the tokens per
call decide which is faster? (H200 probe.)

Usage (GPU): ``python benchmarks/tma_span_probe.py [--out FILE]``.  MLA 61 x 576 bf16, 64-token pages,
``page_first`` host pools of CAPACITY tokens, ``load_layer`` of N tokens (random host pages, random device
pages), TMA loads on (``tma=True``) and off (the row kernel), both at their default launch shapes.  Ratio to
a pinned ``copy_`` of the same bytes: a lone call (CUDA events around one call after a synchronise) and a
burst (every layer back to back, per layer).  Every call pattern is checked bit-exact first.  Timings only;
nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import json
import torch

from hicache_core.bench import SHAPES, _device_buffers, _median_ms
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def _events_ms(fn, reps: int) -> float:
    return _median_ms(fn, reps, warmup=1, idle=True)  # each call after a synchronise: a lone call


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tma_span.json")
    ap.add_argument("--grid", default="4096:4096,32768:4096,32768:32768,131072:4096")
    args = ap.parse_args()
    require_cuda(__file__)
    reg = create_registry()
    rows = []
    for cell in args.grid.split(","):
        cap, n = (int(x) for x in cell.split(":"))
        spec = SHAPES["mla61x576-bf16"](cap, 64, torch.device("cuda"))
        host = allocate_host_buffers(reg.layout("page_first").plan(spec), pin_memory=True)
        dev = _device_buffers(spec, 2 * n)
        g = torch.Generator().manual_seed(cap + n)
        hp, dp = torch.randperm(cap // 64, generator=g)[: n // 64], torch.randperm(2 * n // 64, generator=g)[: n // 64]
        ex = lambda p: (p.unsqueeze(1) * 64 + torch.arange(64)).reshape(-1).cuda()  # noqa: E731
        h, d = ex(hp), ex(dp)
        layers = list(spec.layer_map.device_layers)
        nbytes = n * spec.components[0].row_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        memcpy = _events_ms(lambda: dst.copy_(src, non_blocking=True), 10)
        for tma in (True, False):
            pool = HostKVPool(spec, "page_first", "kernel", dev, host_buffers=host, registry=reg,
                              strategy_options={"tma": tma})
            name = next(iter(dev))
            want = [t.view(torch.uint8)[d].clone() for t in dev[name]]
            pool.backup_all_layers(h, d)
            for t in dev[name]:
                t.view(torch.uint8)[d] = 0
            for layer in layers:
                pool.load_layer(layer, h, d)
            torch.cuda.synchronize()
            exact = all(torch.equal(t.view(torch.uint8)[d], w) for t, w in zip(dev[name], want))
            lone = _events_ms(lambda: pool.load_layer(layers[0], h, d), 10)

            def burst():
                for layer in layers:
                    pool.load_layer(layer, h, d)
            per = _events_ms(burst, 5) / len(layers)
            row = dict(capacity=cap, n=n, tma=tma, host_span_gb=round(cap * 61 * 1152 / 1e9, 2),
                       lone=round(memcpy / lone, 3), burst=round(memcpy / per, 3), bit_exact=exact)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del pool
        del host, dev
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

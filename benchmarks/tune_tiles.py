"""Sweep the launch shape of each plugin's Triton kernel, with a GEMM beside it (GPU).

Usage: ``python benchmarks/tune_tiles.py [--out tune.json] [--layouts ...] [--programs 2,4,8]
[--warps 1,4] [--tiles 8192,32768] [--stages 1,3] [--maxnreg 0,32] [--gemm]``.

Every variant is a set of strategy options (``programs``, ``num_warps``,
``tile_bytes``, ``num_stages``, ``maxnreg``: :class:`hicache_core.rowcopy.RowKernelStrategy`)
on a fresh pool of the chosen shape (default MLA 61 x 576 bf16, 4096 tokens in
64-token pages: 4.7 MB per layer).  Per direction it reports the ratio to a
pinned memcpy of the same bytes (``backup_all_layers``; ``load_layer`` of one
layer; ``load_burst``: one ``load_layer`` per layer back to back) and, with
``--gemm``, the slowdown of a bf16 8192^3 GEMM on another stream while the
transfer runs (a backup of all layers; a burst of
``load_layer`` over every layer).  The plugins' ``TUNING`` constants cite the
run that chose them (docs/performance.md).  Every variant is checked
bit-exact first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from hicache_core.bench import SHAPES, _check, _device_buffers, _gemm_slowdown, _indices, _median_ms, _Memcpy
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_tiles.json")
    ap.add_argument("--shape", default="mla61x576-bf16", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--directions", default="backup,load")
    ap.add_argument("--programs", default="2,4,8")
    ap.add_argument("--warps", default="1,4")
    ap.add_argument("--tiles", default="8192,32768")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--maxnreg", default="0", help="comma list; 0 = no cap")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gemm", action="store_true")
    args = ap.parse_args()
    require_cuda(__file__)
    reg = create_registry()
    spec = SHAPES[args.shape](args.tokens, args.page_size, torch.device("cuda"))
    layers = spec.layer_map.num_device_layers
    dev = _device_buffers(spec, 2 * args.tokens + args.page_size)
    h, s, d = _indices(spec, torch.Generator().manual_seed(0))
    memcpy = _Memcpy()
    total = spec.bytes_per_token * args.tokens
    per_layer = total // layers
    results = []
    corrupt = 0
    for layout in args.layouts.split(","):
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        for p, w, t, st, r in itertools.product(_ints(args.programs), _ints(args.warps), _ints(args.tiles),
                                                _ints(args.stages), _ints(args.maxnreg)):
            opts = {"programs": p, "num_warps": w, "tile_bytes": t, "num_stages": st, **({"maxnreg": r} if r else {})}
            try:
                pool = HostKVPool(spec, layout, "kernel", dev, host_buffers=host, strategy_options=opts,
                                  registry=reg, validate="shapes")
                _check(pool, dev, h, s, d)
            except AssertionError as exc:  # wrong bytes: loud, and the run fails
                corrupt += 1
                print(json.dumps({"layout": layout, **opts, "CORRUPT": str(exc)}), flush=True)
                continue
            except Exception as exc:  # a shape that does not compile here is a result, not the end of the sweep
                print(json.dumps({"layout": layout, **opts, "error": repr(exc)[:300]}), flush=True)
                continue
            row = {"shape": args.shape, "layout": layout, "page_size": args.page_size, **opts}
            if "backup" in args.directions:
                backup = lambda: pool.backup_all_layers(h, s)  # noqa: E731
                ms = _median_ms(backup, args.reps)
                row["backup_all_layers"] = total / ms / 1e6 / memcpy.gbps(total, True, args.reps)
                if args.gemm:
                    row["gemm_backup"] = _gemm_slowdown(backup)
            if "load" in args.directions:
                ms = _median_ms(lambda: pool.load_layer(layers // 2, h, d), args.reps)
                row["load_layer"] = per_layer / ms / 1e6 / memcpy.gbps(per_layer, False, args.reps)
                burst = lambda: [pool.load_layer(i, h, d) for i in range(layers)]  # noqa: E731
                ms = _median_ms(burst, args.reps)
                row["load_burst"] = total / ms / 1e6 / memcpy.gbps(total, False, args.reps)
                if args.gemm:
                    row["gemm_load_burst"] = _gemm_slowdown(burst)
            results.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            with open(args.out, "w") as f:  # rewritten after every row: a killed run keeps its results
                json.dump(results, f, indent=1)
        del host
    return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main())

"""Sweep the tile constants of each plugin's Triton kernel under small SM budgets (H200).

Usage (GPU): ``python benchmarks/tune_tiles.py [--out results.json]``.  For every
variant it patches the plugin's module-level tuning constants, builds a fresh
pool (MLA 61 x 576 bf16, 4096 tokens in 64-token pages: 4.7 MB per layer) and
reports ``load_layer`` and ``backup_all_layers`` as ratios to pinned memcpy of
the same bytes, at 8, 16 and 32 programs.  The defaults in each plugin cite
the run of this script that chose them (docs/performance.md).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys

import torch

from hicache_core.bench import SHAPES, _device_buffers, _gemm_slowdown, _indices, _median_ms, _Memcpy
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

#: sweep name -> (layout, module holding the constants, {constant: candidate values})
SWEEPS = {
    "layer_first": ("layer_first", "hicache_layer_first.kernels",
                    {"LOAD_TILE_BYTES": [16384, 32768, 65536], "LOAD_NUM_WARPS": [8, 16]}),
    "layer_first-backup": ("layer_first", "hicache_layer_first.kernels",
                           {"BACKUP_TILE_BYTES": [8192, 32768, 65536], "BACKUP_NUM_WARPS": [4, 8, 16]}),
    "page_first": ("page_first", "hicache_page_first.kernels",
                   {"TILE_BYTES": [8192, 32768, 65536], "NUM_WARPS": [4, 8, 16]}),
    "page_first_direct": ("page_first_direct", "hicache_page_first.kernels",
                          {"TILE_BYTES": [8192, 32768, 65536], "NUM_WARPS": [4, 8, 16]}),
    "page_first_kv_split": ("page_first_kv_split", "hicache_kv_split.strategy",
                            {"STEP_WORDS": [2048, 4096, 8192], "NUM_WARPS": [4, 8, 16]}),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_tiles.json")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--programs", default="8,16,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemm", action="store_true", help="also measure the GEMM slowdown during backup_all_layers")
    ap.add_argument("--sweeps", default=",".join(n for n in SWEEPS if n != "layer_first-backup"),
                    help=f"comma list of {sorted(SWEEPS)}")
    args = ap.parse_args()
    reg = create_registry()
    spec = SHAPES["mla61x576-bf16"](args.tokens, 64, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * args.tokens + 64)
    h, s, d = _indices(spec, torch.Generator().manual_seed(0))
    memcpy = _Memcpy()
    per_layer = spec.bytes_per_token // 61 * args.tokens
    total = spec.bytes_per_token * args.tokens
    results = []
    for name in args.sweeps.split(","):
        layout, modname, grid = SWEEPS[name]
        mod = importlib.import_module(modname)
        saved = {k: getattr(mod, k) for k in grid}
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values))
            for k, v in setting.items():
                setattr(mod, k, v)
            for p in [int(x) for x in args.programs.split(",")]:
                pool = HostKVPool(spec, layout, "kernel", dev, host_buffers=host, strategy_options={"programs": p},
                                  registry=reg, validate="shapes")
                load = _median_ms(lambda: pool.load_layer(30, h, d), args.reps)
                back = _median_ms(lambda: pool.backup_all_layers(h, s), args.reps)
                row = {"sweep": name, "layout": layout, **setting, "programs": p,
                       "load_layer": per_layer / load / 1e6 / memcpy.gbps(per_layer, False, args.reps),
                       "backup_all_layers": total / back / 1e6 / memcpy.gbps(total, True, args.reps)}
                if args.gemm:
                    row["gemm_slowdown_backup"] = _gemm_slowdown(lambda: pool.backup_all_layers(h, s))
                results.append(row)
                print(json.dumps(row), flush=True)
        for k, v in saved.items():
            setattr(mod, k, v)
        del host
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

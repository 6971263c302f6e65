"""In one process: serving-style load bursts through ``direct`` with and without its fast path for a batch's later layers.

Usage (GPU): ``python benchmarks/later_layers_ab.py --out FILE.json [--shapes mla61x576-bf16,mla61x656-fp8]
[--layouts layer_first,page_first_direct] [--seconds 30]``.

Per cell, three pools on the same device layers: the layout's kernel, ``direct``, and ``direct`` whose load lane
declines a layer its plan has not built yet (so a batch's later layers go through the pool's checks and
``transfer``, as before that fast path existed; both pools build one-layer submissions the same way).  Every cycle
makes new index tensors (a new batch), then runs one burst of every layer's ``load_layer`` through each pool in
rotating order, each after a synchronise, against a pinned copy of the burst's bytes timed in the same cycle.
The pools alternate within each cycle, so the host's drift over seconds falls on both.  Prints one JSON summary
per cell: medians of the ratio and of the host time per call, and the share of cycles the fast path won.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pace_probe import _burst_ms, _copy_ms  # noqa: E402
from hicache_core.bench import _check, _workload  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402


def _without_later_layers(pool: HostKVPool) -> None:
    """Make ``pool``'s load lane decline layers its plan has not built (the path before the later-layer lane)."""
    lane = pool._lanes[0]
    plans, copier = pool.binding.scratch["direct.plans"], pool.binding.scratch["direct.copier"]

    def only_built(layer: Any, h: torch.Tensor, d: torch.Tensor) -> bool:
        plan = plans.peek(h, d, copier.stream())
        if plan is None or plan.peek(layer) is None:
            return False
        return bool(lane(layer, h, d))
    pool._lanes = (only_built, pool._lanes[1])


def run_cell(shape: str, layout: str, seconds: float) -> dict:
    reg = create_registry()
    spec, dev, h, s, d = _workload(shape)
    layers = list(spec.layer_map.device_layers)
    nbytes = spec.bytes_per_token * h.numel()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    names = ["kernel", "direct", "direct no-later-lane"]
    pools = {}
    for name in names:
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pools[name] = HostKVPool(spec, layout, name.split()[0], dev, host_buffers=host, registry=reg,
                                 validate="shapes")
        _check(pools[name], dev, h, s, d)
    _without_later_layers(pools["direct no-later-lane"])
    cycles = []
    t_end = time.perf_counter() + seconds
    k = 0
    while time.perf_counter() < t_end:
        hk, sk, dk = h.clone(), s.clone(), d.clone()  # a new batch
        for pool in pools.values():
            pool.backup_all_layers(hk, sk)
        base = _copy_ms(target, pinned)
        row: dict = {}
        for name in names[k % 3:] + names[:k % 3]:
            ms, host_us = _burst_ms(pools[name], layers, hk, dk)
            row[name], row[name + "_host_us"] = round(base / ms, 4), round(host_us, 1)
        cycles.append(row)
        k += 1
        time.sleep(0.02)
    med = {n: round(statistics.median(c[n] for c in cycles), 4) for n in names}
    host = {n: round(statistics.median(c[n + "_host_us"] for c in cycles), 1) for n in names}
    summary = {"shape": shape, "layout": layout, "cycles": len(cycles), "median": med, "host_us": host,
               "fast_path_won_share": round(sum(c["direct"] > c["direct no-later-lane"] for c in cycles) / len(cycles), 3),
               "median_paired_gain": round(statistics.median(c["direct"] - c["direct no-later-lane"] for c in cycles), 4)}
    return {"summary": summary, "cycles": cycles}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="mla61x576-bf16,mla61x656-fp8")
    p.add_argument("--layouts", default="layer_first,page_first_direct")
    p.add_argument("--seconds", type=float, default=30.0, help="per cell")
    args = p.parse_args()
    out = []
    for shape in args.shapes.split(","):
        for layout in args.layouts.split(","):
            cell = run_cell(shape, layout, args.seconds)
            print(json.dumps(cell["summary"]), flush=True)
            out.append(cell)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Single loads (``load_layer`` on an idle GPU) through the kernel and ``auto``, call by call.

Usage (GPU): ``python benchmarks/lone_probe.py --out FILE.json [--cells mla61x656-fp8:page_first,...] [--reps 30]``.

The peers harness times ``load_layer`` as lone calls (each after the last one's end event): on an H100 ``auto`` was
6-10 points below the layout's kernel there although its lone-load rule sends such loads to that kernel.  Per cell
(4096 tokens, page 64, one pair of index tensors reused, as the harness does) this times each lone call of both pools
from the GPU's idle start (the event before the call) and on the host up to the call's return, and for ``auto`` counts
per call what served it: its lane (``lane``: served, ``declined``: the pool's normal path), the lone-load rule
(``lone``), a decision (``decided``), and the clock's view (``idle``, the gap since its last booking).  Three calls back
to back come first, as the harness's warm-up.

``--tight`` times the calls as the harness does instead (each call issued as soon as the last one's end event is
reached, nothing read between them) and counts for ``auto`` over the whole loop only: loads the lone-load rule sent to
the kernel, the lane's served and declined calls, and the copy engine's submissions; ``direct`` is timed beside them.
The probe's own reads between calls leave ~60 us more between them, so its loads are lone by ``auto``'s clock
(``TIGHT_GAP_US``), while the harness's may be a loop of calls to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from benchmarks.pace_probe import _count_lane  # noqa: E402
from hicache_core.bench import _check, _workload  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402


def _pools(shape: str, layout: str, backends: tuple[str, ...]) -> tuple[dict, int, torch.Tensor, torch.Tensor]:
    """One checked pool per backend over one workload (4096 tokens, page 64), the middle layer, and the load's host
    and device indices (one pair, reused, as the harness does)."""
    reg = create_registry()
    spec, dev, h, s, d = _workload(shape)
    mid = list(spec.layer_map.device_layers)[len(spec.layer_map.device_layers) // 2]
    pools = {}
    for backend in backends:
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pools[backend] = HostKVPool(spec, layout, backend, dev, host_buffers=host, registry=reg, validate="shapes")
        _check(pools[backend], dev, h, s, d)
    return pools, mid, h, d


def run_tight(shape: str, layout: str, reps: int) -> dict:
    """The harness's timing of ``load_layer`` (see the module docstring): per pool the median GPU time, and for
    ``auto`` what served the loop's calls, counted around the loop."""
    pools, mid, h, d = _pools(shape, layout, ("kernel", "auto", "direct"))
    out: dict = {"shape": shape, "layout": layout, "mode": "tight"}
    for backend, pool in pools.items():
        served = _count_lane(pool) if backend == "auto" else None
        strategy = pool.strategy
        for _ in range(3):  # the harness's warm-up: back to back
            pool.load_layer(mid, h, d)
        torch.cuda.synchronize()
        before = (dict(served), strategy.lone_kernel_loads) if served is not None else None  # type: ignore[attr-defined]
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            pool.load_layer(mid, h, d)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        row: dict = {"gpu_us_median": round(statistics.median(times), 1), "gpu_us": [round(t, 1) for t in times]}
        if served is not None and before is not None:
            row.update({k: served[k] - before[0][k] for k in ("served", "declined", "submits", "eager")},
                       lone=strategy.lone_kernel_loads - before[1])  # type: ignore[attr-defined]
        out[backend] = row
    return out


def run_cell(shape: str, layout: str, reps: int) -> dict:
    pools, mid, h, d = _pools(shape, layout, ("kernel", "auto"))
    auto = pools["auto"].strategy
    served = _count_lane(pools["auto"])  # the calls its load lane served or left to the normal path
    out: dict = {"shape": shape, "layout": layout}
    for name, pool in pools.items():
        for _ in range(3):  # the harness's warm-up: back to back
            pool.load_layer(mid, h, d)
        torch.cuda.synchronize()
        calls = []
        for _ in range(reps):
            row: dict = {}
            if name == "auto":
                clock, stream = auto.clock, torch.cuda.current_stream().cuda_stream  # type: ignore[attr-defined]
                now = clock.now()
                row["idle"] = clock.idle(stream, now)
                last = clock._last_end.get(stream)
                row["gap_us"] = None if last is None else round((now - last) * 1e6, 1)
                before = (dict(served), auto.lone_kernel_loads, auto.decisions)  # type: ignore[attr-defined]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            pool.load_layer(mid, h, d)
            row["host_us"] = round((time.perf_counter() - t0) * 1e6, 1)
            b.record()
            b.synchronize()
            row["gpu_us"] = round(a.elapsed_time(b) * 1e3, 1)
            if name == "auto":
                row["lane"] = "served" if served["served"] > before[0]["served"] else \
                    "declined" if served["declined"] > before[0]["declined"] else "none"
                row["lone"] = auto.lone_kernel_loads - before[1]  # type: ignore[attr-defined]
                row["decided"] = auto.decisions - before[2]  # type: ignore[attr-defined]
            calls.append(row)
        out[name] = {"gpu_us_median": statistics.median(c["gpu_us"] for c in calls),
                     "host_us_median": statistics.median(c["host_us"] for c in calls), "calls": calls}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cells", default="mla61x656-fp8:page_first,mla61x576-bf16:layer_first,mla61x576-bf16:page_first")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--tight", action="store_true", help="time the calls as the harness does (module docstring)")
    args = p.parse_args()
    require_cuda(__file__)
    results = []
    for cell in args.cells.split(","):
        shape, layout = cell.split(":")
        if args.tight:
            r = run_tight(shape, layout, args.reps)
            results.append(r)
            print(json.dumps({"cell": cell, **{k: {x: y for x, y in v.items() if x != "gpu_us"}
                                               for k, v in r.items() if isinstance(v, dict)}}), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
            continue
        r = run_cell(shape, layout, args.reps)
        results.append(r)
        a = r["auto"]["calls"]
        print(json.dumps({"cell": cell, "kernel_gpu_us": r["kernel"]["gpu_us_median"],
                          "kernel_host_us": r["kernel"]["host_us_median"], "auto_gpu_us": r["auto"]["gpu_us_median"],
                          "auto_host_us": r["auto"]["host_us_median"],
                          "auto_lone": sum(c["lone"] for c in a), "auto_served": sum(c["lane"] == "served" for c in a),
                          "auto_declined": sum(c["lane"] == "declined" for c in a),
                          "auto_decided": sum(c["decided"] for c in a),
                          "auto_idle": sum(bool(c["idle"]) for c in a),
                          "auto_gap_us_min": min((c["gap_us"] for c in a if c["gap_us"] is not None), default=None)}),
              flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

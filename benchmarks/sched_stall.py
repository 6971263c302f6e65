"""Scheduler stall: host time of a backup or a batch's first load issued while the forward stream is busy.

Usage (GPU): ``python benchmarks/sched_stall.py [--out DIR]``.  SGLang issues a
backup from its scheduler thread on a dedicated stream that first waits for an
event recorded on the forward stream; loads likewise.  A strategy that must read
index *values* on the host (the copy engine builds descriptor addresses) and gets
GPU-resident indices (SGLang's ``kernel`` io_backend puts them there) copies
them to the CPU on that stream, so the call returns only when the queued forward
work has finished: the scheduler thread stalls.  This probe queues about
``--forward-ms`` of GEMMs on the forward stream, records the event, and times the
call on the host, for each strategy of MLA 61 x 576 bf16 layer_first (4096
tokens, 64-token pages), with index tensors new to the pool (as every SGLang batch
has) on the GPU, on the CPU, and mixed (host slots on the CPU, device rows on the GPU:
a staged ``direct`` route never reads the device rows back).  Results: ``<out>/sched_stall.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch

from hicache_core.bench import SHAPES, _device_buffers, _indices, _targets
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def _gemm_chain(ms: float) -> tuple[Callable[[], object], float]:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):  # cuBLAS warm-up
        a @ b
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(4):
        a @ b
    e1.record()
    e1.synchronize()
    per = e0.elapsed_time(e1) / 4
    n = max(1, round(ms / per))
    return (lambda: [a @ b for _ in range(n)]), n * per


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--forward-ms", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layouts", default="layer_first,page_first_direct")
    ap.add_argument("--backends", default="kernel,direct,auto")
    args = ap.parse_args()
    require_cuda(__file__)
    os.makedirs(args.out, exist_ok=True)
    reg = create_registry()
    spec = SHAPES["mla61x576-bf16"](4096, 64, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * 4096 + 64)
    h, s, d = _indices(spec, torch.Generator().manual_seed(0))
    forward, fwd_ms = _gemm_chain(args.forward_ms)
    side = torch.cuda.Stream()
    rows = []
    for layout, backend, name in _targets(reg, spec, args.layouts.split(","), args.backends.split(",")):
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pool = HostKVPool(spec, layout, backend, dev, host_buffers=host, strategy=name, registry=reg, validate="shapes")
        layer0 = spec.layer_map.device_layers[0]
        for where in ("cuda", "cpu", "mixed"):
            for op in ("backup_all_layers", "load_layer"):
                host_ms, idle_ms = [], []
                for busy in (True, False):
                    for _ in range(args.reps):
                        # new tensors, as every batch has; "mixed": host slots on the CPU, device rows on the GPU
                        hi, si, di = (t.to("cpu" if where == "cpu" or (where == "mixed" and t is h) else "cuda").clone()
                                      for t in (h, s, d))
                        torch.cuda.synchronize()
                        if busy:
                            forward()
                        start = torch.cuda.current_stream().record_event()
                        with torch.cuda.stream(side):
                            side.wait_event(start)
                            t0 = time.perf_counter()
                            if op == "backup_all_layers":
                                pool.backup_all_layers(hi, si)
                            else:
                                pool.load_layer(layer0, hi, di)
                            dt = (time.perf_counter() - t0) * 1e3
                        (host_ms if busy else idle_ms).append(dt)
                        torch.cuda.synchronize()
                row = {"strategy": name, "layout": layout, "backend": backend, "indices_on": where, "op": op,
                       "forward_ms_queued": fwd_ms, "host_ms_busy": statistics.median(host_ms),
                       "host_ms_idle": statistics.median(idle_ms)}
                rows.append(row)
                print(f"{name:24s} {layout:18s} idx={where:5s} {op:18s} host {row['host_ms_busy']:7.2f} ms with "
                      f"{fwd_ms:.1f} ms of forward queued, {row['host_ms_idle']:6.2f} ms idle", flush=True)
        del pool, host
    with open(os.path.join(args.out, "sched_stall.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Copy-engine submission probe: how the host side of ``cudaMemcpyBatchAsync`` shapes one layer's load.

Usage (GPU): ``python benchmarks/ce_probe.py [--out DIR]``.  One MLA layer (4096
tokens x 1152 bytes, 64-token pages: 64 random page blocks of 73.7 KB) is moved
H2D and D2H from pinned memory, as ``direct`` moves it.  For each submission
*schedule* (the sizes of the successive runtime calls) and memcpy attribute
variant it reports the event-timed time of one transfer issued on an idle stream
(the event is recorded before the host starts submitting, as ``hicache bench``
times ``load_layer``), its ratio to one pinned ``copy_`` of the same bytes, and
the host time of the submission.  A last block times the runtime call alone per
descriptor count.  Results go to ``<out>/ce_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hicache_core.backends import cudart

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda

SCHEDULES = {
    "one call": [64],
    "16 then rest": [16, 48],
    "4 then rest": [4, 60],
    "2,6,rest": [2, 6, 56],
    "1,3,rest": [1, 3, 60],
    "4 x 16": [16, 16, 16, 16],
    "8 x 8": [8] * 8,
    "per descriptor": [1] * 64,
}
# cudaMemcpySrcAccessOrder: 1 stream, 3 any; flags: 1 cudaMemcpyFlagPreferOverlapWithCompute
ATTRS = {"order=stream": (1, 0), "order=any": (3, 0), "order=stream,prefer-overlap": (1, 1)}


def _submit(rt: cudart.CudaRuntime, d: torch.Tensor, s: torch.Tensor, z: torch.Tensor, schedule: list[int],
            attrs: cudart._MemcpyAttributes, stream: int) -> None:
    start = 0
    for count in schedule:
        off = start * 8
        err = rt.submit_batch(d.data_ptr() + off, s.data_ptr() + off, z.data_ptr() + off, count, stream, attrs)
        if err:
            raise RuntimeError(rt.error_string(err))
        start += count


def _event_ms(fn, reps: int) -> tuple[float, float]:
    times, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), statistics.median(host)


def probe_setup(reps: int) -> tuple[argparse.Namespace, cudart.CudaRuntime, int]:
    """The copy-engine probes' common start: ``--out`` (created) and ``--reps`` (default ``reps``),
    the process's CUDA runtime, and the current stream's handle."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=reps)
    args = ap.parse_args()
    require_cuda(ap.prog)  # the probe that called (argparse's prog: its file name)
    os.makedirs(args.out, exist_ok=True)
    return args, cudart.runtime(), torch.cuda.current_stream().cuda_stream or cudart.STREAM_PER_THREAD


def main() -> int:
    args, rt, stream = probe_setup(60)
    tokens, row, ps = 4096, 1152, 64
    pages = tokens // ps
    block = ps * row
    dev = torch.empty(2 * tokens * row, dtype=torch.uint8, device="cuda")
    host = torch.empty(tokens * row, dtype=torch.uint8, pin_memory=True)
    host_c = torch.empty(tokens * row, dtype=torch.uint8, pin_memory=True)
    gen = torch.Generator().manual_seed(0)
    hp = torch.randperm(pages, generator=gen).to(torch.int64) * block + host.data_ptr()
    dp = torch.randperm(2 * pages, generator=gen)[:pages].to(torch.int64) * block + dev.data_ptr()
    lens = torch.full((pages,), block, dtype=torch.int64)
    base = {}
    for name, (dst, src) in {"h2d": (dev[: tokens * row], host_c), "d2h": (host_c, dev[: tokens * row])}.items():
        ms, _ = _event_ms(lambda: dst.copy_(src, non_blocking=True), args.reps)
        base[name] = ms
    rows = []
    for attr_name, (order, flags) in ATTRS.items():
        attrs = cudart._MemcpyAttributes(order, cudart._MemLocation(0, 0), cudart._MemLocation(0, 0), flags)
        for sched_name, sched in SCHEDULES.items():
            for direction, (d, s) in {"h2d": (dp, hp), "d2h": (hp, dp)}.items():
                try:
                    ms, host_us = _event_ms(lambda: _submit(rt, d, s, lens, sched, attrs, stream), args.reps)
                except RuntimeError as exc:
                    rows.append({"attrs": attr_name, "schedule": sched_name, "dir": direction, "error": str(exc)})
                    print(attr_name, sched_name, direction, "ERROR", exc, flush=True)
                    continue
                r = {"attrs": attr_name, "schedule": sched_name, "dir": direction, "ms": ms,
                     "ratio": base[direction] / ms, "host_us": host_us}
                rows.append(r)
                print(f"{attr_name:30s} {sched_name:16s} {direction} ratio {r['ratio']:.3f} host {host_us:6.1f} us",
                      flush=True)
    attrs = cudart._MemcpyAttributes(1, cudart._MemLocation(0, 0), cudart._MemLocation(0, 0), 0)
    per_call = []
    for n in (1, 4, 16, 64):
        _, host_us = _event_ms(lambda: _submit(rt, dp, hp, lens, [n], attrs, stream), args.reps)
        per_call.append({"descriptors": n, "host_us": host_us})
        print(f"one call of {n:3d} descriptors: host {host_us:6.1f} us", flush=True)
    with open(os.path.join(args.out, "ce_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "runtime": rt.version, "driver": rt.driver_version,
                   "memcpy_ms": base, "block_bytes": block, "rows": rows, "per_call": per_call}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

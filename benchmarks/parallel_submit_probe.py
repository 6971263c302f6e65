"""Does submitting one transfer's descriptors from several host threads cut its host time?

Usage (GPU): ``python benchmarks/parallel_submit_probe.py [--out DIR]``.  A 61-layer MLA backup
(576 bf16 rows, 4096 tokens, page 64, random pages, separately allocated device layers, as SGLang's
pools hold them) is 3904 copy-engine descriptors; one thread spends ~0.5 us per descriptor inside
``cudaMemcpyBatchAsync``.  This probe takes the descriptors ``direct`` builds for it
(``HostKVPool`` with ``core.direct``) and submits them

* ``1 thread``: on the caller's stream, as ``direct`` does (:func:`~hicache_core.backends.cudart.batch_schedule`);
* ``k threads``: split in ``k`` slices; the caller records an event, ``k - 1`` persistent helper threads
  each make their own stream wait for it and submit a slice while the caller submits the first, then the
  caller's stream waits for each helper's end event.  Nothing on the GPU waits for the host (no gate), so
  no module load can deadlock it.

Per variant: host time of the call on the caller's thread, event-timed ratio to one pinned ``copy_``
of the same bytes, every byte checked after each variant.  A second block repeats the 1-thread host time
with the process bound to one CPU and unbound (the host time per call was seen bimodal between runs).
Results: ``<out>/parallel_submit.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

from hicache_core.backends.cudart import batch_schedule, runtime
from hicache_core.bench import _Memcpy, _workload
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


class _Helper(threading.Thread):
    """A persistent thread that submits one slice on its own stream when handed one."""

    def __init__(self, device: int) -> None:
        super().__init__(daemon=True)
        self.device = device
        self.go = threading.Event()
        self.done = threading.Event()
        self.job: tuple | None = None
        self.host_us = 0.0
        self.stream: torch.cuda.Stream | None = None
        self.end: torch.cuda.Event | None = None
        self.ready = threading.Event()
        self.start()
        self.ready.wait()

    def run(self) -> None:
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream()
        self.end = torch.cuda.Event()
        self.ready.set()
        rt = runtime()
        while True:
            self.go.wait()
            self.go.clear()
            start_ev, d, s, z, lo, hi = self.job  # type: ignore[misc]
            t0 = time.perf_counter()
            self.stream.wait_event(start_ev)
            _submit(rt, d, s, z, lo, hi, self.stream.cuda_stream)
            self.end.record(self.stream)
            self.host_us = (time.perf_counter() - t0) * 1e6
            self.done.set()


def _submit(rt, d: torch.Tensor, s: torch.Tensor, z: torch.Tensor, lo: int, hi: int, stream: int) -> None:
    start = lo
    for count in batch_schedule(hi - lo):
        err = rt.submit_batch(d.data_ptr() + 8 * start, s.data_ptr() + 8 * start, z.data_ptr() + 8 * start, count, stream)
        if err:
            raise RuntimeError(rt.error_string(err))
        start += count


def _parallel(rt, helpers: list[_Helper], d: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """The caller's call: slices to the helpers, the first slice itself, then its stream waits for theirs."""
    n, k = d.numel(), len(helpers) + 1
    cuts = [n * i // k for i in range(k + 1)]
    caller = torch.cuda.current_stream()
    start_ev = torch.cuda.Event()
    start_ev.record(caller)
    for i, hp in enumerate(helpers, start=1):
        hp.job = (start_ev, d, s, z, cuts[i], cuts[i + 1])
        hp.done.clear()
        hp.go.set()
    _submit(rt, d, s, z, cuts[0], cuts[1], caller.cuda_stream)
    for hp in helpers:
        hp.done.wait()
        caller.wait_event(hp.end)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    require_cuda(__file__)
    with torch.cuda.stream(torch.cuda.Stream()):  # a non-default caller stream, as an engine's transfer stream
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    reg = create_registry()
    memcpy = _Memcpy()
    rt = runtime()
    spec, dev, h, s, _ = _workload("mla61x576-bf16")
    host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=True)
    pool = HostKVPool(spec, "layer_first", "direct", dev, host_buffers=host, strategy="core.direct", registry=reg)
    ref = HostKVPool(spec, "layer_first", "reference", dev, strategy="core.reference", registry=reg,
                     host_buffers=allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=True))
    for buf in ref.binding.host_buffers.values():
        buf.fill_(0x5A)
    ref.backup_all_layers(h, s)
    torch.cuda.synchronize()
    want = [b.clone() for b in ref.binding.host_buffers.values()]
    sub = pool.strategy.submission(pool.binding, h, s, None)
    if sub.staged is not None or sub.pitched is not None:
        raise SystemExit("expected plain descriptors for separately allocated layers (got a staged or pitched route)")
    hd, dd, lens = sub.host.contiguous(), sub.dev.contiguous(), sub.lens.contiguous()
    nbytes = int(lens.sum())
    base = memcpy.gbps(nbytes, True, 5)
    print(f"{hd.numel()} descriptors, {nbytes / 1e6:.1f} MB, memcpy {base:.1f} GB/s", flush=True)
    helpers = [_Helper(torch.cuda.current_device()) for _ in range(3)]
    variants = {"1 thread": lambda: _submit(rt, hd, dd, lens, 0, hd.numel(), torch.cuda.current_stream().cuda_stream)}
    for k in (2, 3, 4):
        variants[f"{k} threads"] = (lambda _k=k: _parallel(rt, helpers[:_k - 1], hd, dd, lens))
    res: dict[str, dict[str, list[float]]] = {v: {"ms": [], "host": [], "helper": []} for v in variants}
    checks: dict[str, bool] = {}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            for buf in pool.binding.host_buffers.values():
                buf.fill_(0x5A)
            for _ in range(args.reps):
                torch.cuda.synchronize()
                time.sleep(0.002)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                fn()
                res[name]["host"].append((time.perf_counter() - t0) * 1e6)
                b.record()
                b.synchronize()
                res[name]["ms"].append(a.elapsed_time(b))
                if name != "1 thread":
                    res[name]["helper"].append(max(hp.host_us for hp in helpers[:int(name[0]) - 1]))
            torch.cuda.synchronize()
            ok = all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))  # bytes: random bf16 has NaNs
                     for x, y in zip(pool.binding.host_buffers.values(), want))
            checks[name] = checks.get(name, True) and ok
    rows = []
    for name, r in res.items():
        ms = statistics.median(r["ms"])
        row = {"variant": name, "descriptors": int(hd.numel()), "bytes": nbytes, "ratio": nbytes / ms / 1e6 / base,
               "host_us": statistics.median(r["host"]), "host_us_min": min(r["host"]), "host_us_max": max(r["host"]),
               "helper_us": statistics.median(r["helper"]) if r["helper"] else None, "bit_exact": checks.get(name)}
        rows.append(row)
        print(f"{name:10s} ratio {row['ratio']:.3f} host {row['host_us']:7.1f} us (min {row['host_us_min']:.0f}, "
              f"max {row['host_us_max']:.0f}) helper {row['helper_us']} bit-exact {row['bit_exact']}", flush=True)
    # the same single-thread call, process bound to one CPU or not
    allowed = sorted(os.sched_getaffinity(0))
    pins: dict[str, set[int]] = {"unbound": set(allowed), f"cpu {allowed[0]}": {allowed[0]},
                                 f"cpu {allowed[len(allowed) // 2]}": {allowed[len(allowed) // 2]}}
    affinity = []
    for _ in range(args.rounds):
        for label, cpus in pins.items():
            os.sched_setaffinity(0, cpus)
            host_us = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                time.sleep(0.002)
                t0 = time.perf_counter()
                variants["1 thread"]()
                host_us.append((time.perf_counter() - t0) * 1e6)
            affinity.append({"binding": label, "host_us": statistics.median(host_us), "min": min(host_us),
                             "max": max(host_us)})
            print(f"affinity {label:10s} host {affinity[-1]['host_us']:7.1f} us (min {min(host_us):.0f}, "
                  f"max {max(host_us):.0f})", flush=True)
    os.sched_setaffinity(0, set(allowed))
    torch.cuda.synchronize()
    with open(os.path.join(args.out, "parallel_submit.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "cpus": len(allowed), "rows": rows, "affinity": affinity},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host cost of one batched copy-engine submission, by entry point and memcpy attributes.

Usage (GPU): ``python benchmarks/ce_host_probe.py [--out DIR] [--reps N]``.  Blocks of 73.7 KB (one MLA
page of 64 tokens x 1152 bytes) in random order between pinned host memory and the GPU, submitted as one call
of ``n`` descriptors (n = 1, 16, 64, 256) through:

* ``runtime``: ``cudaMemcpyBatchAsync`` of the process's libcudart (what ``direct`` calls today);
* ``driver``: ``cuMemcpyBatchAsync`` of libcuda (``_v2`` on CUDA 13, the 12.8 signature otherwise);

each with the location hints unset (today) and set (host source / device destination, or the reverse).  For
each: the host time of one call on an idle stream (synchronised before each) and per call inside a burst of 61
calls back to back, and a byte check of the copied blocks (``torch.equal``).  The per-descriptor slope and the
per-call intercept come from the n = 16 and n = 256 rows.  Results in ``<out>/ce_host_probe.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import time
from typing import Callable

import torch

from hicache_core.backends import cudart

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda

BLOCK = 64 * 1152
COUNTS = (1, 16, 64, 256)
_LOC_DEVICE, _LOC_HOST = 1, 2  # CUmemLocationType / cudaMemLocationType


def _driver_batch() -> Callable[..., int] | None:
    """libcuda's cuMemcpyBatchAsync (the CUDA 13 ``_v2`` signature, else 12.8's with ``failIdx``), or ``None``."""
    lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    if fn is not None:
        fn.argtypes = [vp, vp, vp, sz, ctypes.POINTER(cudart._MemcpyAttributes), vp, sz, vp]
        fn.restype = ctypes.c_int
        return fn
    fn = getattr(lib, "cuMemcpyBatchAsync", None)
    if fn is None:
        return None
    fn.argtypes = [vp, vp, vp, sz, ctypes.POINTER(cudart._MemcpyAttributes), vp, sz, vp, vp]
    fn.restype = ctypes.c_int
    fail = ctypes.c_size_t(0)
    return lambda d, s, z, n, a, ai, na, st: fn(d, s, z, n, a, ai, na, ctypes.byref(fail), st)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    require_cuda(__file__)
    os.makedirs(args.out, exist_ok=True)
    rt = cudart.runtime()
    stream = torch.cuda.current_stream().cuda_stream or cudart.STREAM_PER_THREAD
    dev_id = torch.cuda.current_device()
    nmax = max(COUNTS)
    host = torch.randint(0, 256, (nmax * BLOCK,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(2 * nmax * BLOCK, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    hp = torch.randperm(nmax, generator=gen).to(torch.int64)
    dp = torch.randperm(2 * nmax, generator=gen)[:nmax].to(torch.int64)
    haddr, daddr = hp * BLOCK + host.data_ptr(), dp * BLOCK + dev.data_ptr()
    lens = torch.full((nmax,), BLOCK, dtype=torch.int64)
    attr_idx = (ctypes.c_size_t * 1)(0)
    drv = _driver_batch()
    loc = cudart._MemLocation

    def attrs(hints: bool, to_host: bool) -> cudart._MemcpyAttributes:
        h, d = loc(_LOC_HOST, 0), loc(_LOC_DEVICE, dev_id)
        src, dst = ((d, h) if to_host else (h, d)) if hints else (loc(0, 0), loc(0, 0))
        return cudart._MemcpyAttributes(1, src, dst, 0)

    def submitter(entry: str, hints: bool, to_host: bool, n: int) -> Callable[[], None]:
        d, s = (haddr, daddr) if to_host else (daddr, haddr)
        a = attrs(hints, to_host)
        ref = ctypes.byref(a)
        dptr, sptr, zptr = d.data_ptr(), s.data_ptr(), lens.data_ptr()
        if entry == "runtime":
            def call() -> None:
                err = rt.submit_batch(dptr, sptr, zptr, n, stream, a)
                if err:
                    raise RuntimeError(f"cudaMemcpyBatchAsync: {rt.error_string(err)}")
        else:
            assert drv is not None

            def call() -> None:
                err = drv(dptr, sptr, zptr, n, ref, attr_idx, 1, stream)
                if err:
                    raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {err}")
        return call

    def loaded(n: int) -> bool:
        """Whether the first ``n`` descriptors' device blocks hold their host blocks."""
        return all(torch.equal(dev[int(d) * BLOCK:(int(d) + 1) * BLOCK].cpu(), host[int(h) * BLOCK:(int(h) + 1) * BLOCK])
                   for h, d in zip(hp[:n], dp[:n]))

    rows = []
    entries = ["runtime"] + (["driver"] if drv is not None else [])
    for to_host in (False, True):
        for entry in entries:
            for hints in (False, True):
                for n in COUNTS:
                    try:
                        call = submitter(entry, hints, to_host, n)
                        if to_host:  # device blocks hold the host bytes (a load first), then go back to scrambled host
                            submitter(entry, hints, False, n)()
                            torch.cuda.synchronize()
                            saved = host.clone()
                            for p in hp[:n]:
                                host[int(p) * BLOCK:(int(p) + 1) * BLOCK].fill_(0xA5)
                            call()
                            torch.cuda.synchronize()
                            ok = torch.equal(host, saved)
                        else:
                            dev.fill_(0x5A)
                            call()
                            torch.cuda.synchronize()
                            ok = loaded(n)
                        idle = []
                        for _ in range(args.reps):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            call()
                            idle.append((time.perf_counter() - t0) * 1e6)
                        burst = []
                        for _ in range(max(3, args.reps // 20)):
                            torch.cuda.synchronize()
                            for _ in range(61):
                                t0 = time.perf_counter()
                                call()
                                burst.append((time.perf_counter() - t0) * 1e6)
                        torch.cuda.synchronize()
                    except RuntimeError as exc:
                        rows.append({"dir": "d2h" if to_host else "h2d", "entry": entry, "hints": hints, "n": n,
                                     "error": str(exc)})
                        print(rows[-1], flush=True)
                        torch.cuda.synchronize()
                        continue
                    r = {"dir": "d2h" if to_host else "h2d", "entry": entry, "hints": hints, "n": n, "bytes_ok": ok,
                         "idle_us": statistics.median(idle), "burst_us": statistics.median(burst)}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    fits = []
    for to_host in ("h2d", "d2h"):
        for entry in entries:
            for hints in (False, True):
                sel = {r["n"]: r for r in rows if r["dir"] == to_host and r["entry"] == entry and r["hints"] == hints
                       and "error" not in r}
                if 16 in sel and 256 in sel:
                    for kind in ("idle_us", "burst_us"):
                        slope = (sel[256][kind] - sel[16][kind]) / 240
                        fits.append({"dir": to_host, "entry": entry, "hints": hints, "kind": kind,
                                     "per_descriptor_us": round(slope, 3),
                                     "per_call_us": round(sel[16][kind] - 16 * slope, 2)})
                        print(json.dumps(fits[-1]), flush=True)
    with open(os.path.join(args.out, "ce_host_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "runtime": rt.version, "driver": rt.driver_version,
                   "block_bytes": BLOCK, "rows": rows, "fits": fits}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

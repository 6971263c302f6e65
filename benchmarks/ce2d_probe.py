"""Pitched-copy probe: one all-layer backup as 2D ``cudaMemcpy3DBatchAsync`` operations vs row descriptors.

Usage (GPU): ``python benchmarks/ce2d_probe.py [--out DIR]``.  An MLA pool
(61 layers, 4096 tokens x 1152 bytes, 64-token pages: 64 random pages) is
moved D2H and H2D between a device buffer whose layers are evenly spaced and a
pinned layer-major host buffer, two ways:

* ``1d``: 3904 descriptors (one per page and layer) through ``copy_batch``;
* ``2d``: 64 pitched operations (one per page, 61 rows with the layer pitch of
  each side) through ``copy_3d_batch``.

Both are checked byte for byte; each reports its ratio to one pinned ``copy_``
of the same bytes and the host time of the submission.  Further blocks: host
time per call by operation count, a pitch above 2 GiB (whether the runtime
accepts it and copies the right bytes), and whether per-layer device
tensors allocated one after another (as SGLang's pools do) are evenly spaced.
Results go to ``<out>/ce2d_probe.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ce_probe import _event_ms, probe_setup  # noqa: E402
from hicache_core.backends import cudart  # noqa: E402
from hicache_core.backends.pitched import Pitched, expand, ops_tensor  # noqa: E402


def _max_pitch(rt: cudart.CudaRuntime) -> int:
    v = ctypes.c_int(0)
    fn = rt._lib.cudaDeviceGetAttribute
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    fn(ctypes.byref(v), 11, torch.cuda.current_device())  # cudaDevAttrMaxPitch
    return int(v.value)


def main() -> int:
    args, rt, stream = probe_setup(20)
    res: dict = {"gpu": torch.cuda.get_device_name(), "runtime": rt.version, "driver": rt.driver_version,
                 "has_batch3d": rt.has_batch3d, "max_pitch_attr": _max_pitch(rt)}
    print(res, flush=True)
    L, tokens, row, ps = 61, 4096, 1152, 64
    pages, block = tokens // ps, ps * row
    dev_layer, host_layer = 2 * tokens * row, tokens * row
    dev = torch.randint(0, 255, (L * dev_layer,), dtype=torch.uint8, device="cuda")
    host = torch.empty(L * host_layer, dtype=torch.uint8, pin_memory=True)
    host_c = torch.empty(L * host_layer, dtype=torch.uint8, pin_memory=True)
    gen = torch.Generator().manual_seed(0)
    hpage = torch.randperm(pages, generator=gen).to(torch.int64)
    dpage = torch.randperm(2 * pages, generator=gen)[:pages].to(torch.int64)
    p2 = Pitched(hpage * block + host.data_ptr(), dpage * block + dev.data_ptr(), torch.full((pages,), block),
                 torch.full((pages,), L), torch.full((pages,), host_layer), torch.full((pages,), dev_layer))
    h1, d1, z1 = expand(p2)
    res["ops_2d"], res["descriptors_1d"] = p2.count, int(h1.numel())
    ops = {True: ops_tensor(p2, to_host=True), False: ops_tensor(p2, to_host=False)}
    base = {}
    spare = torch.empty(L * host_layer, dtype=torch.uint8, device="cuda")
    for name, (dst, src) in {"h2d": (spare, host_c), "d2h": (host_c, spare)}.items():
        base[name] = _event_ms(lambda: dst.copy_(src, non_blocking=True), args.reps)[0]
    res["memcpy_ms"] = base
    del spare
    # the reference: host page k of layer l = device page dpage[k] of layer l
    want = dev.view(L, 2 * pages, block)[:, dpage].cpu()
    rows = []
    for way in ("1d", "2d"):
        for direction in ("d2h", "h2d"):
            to_host = direction == "d2h"
            if way == "1d":
                fn = (lambda: rt.copy_batch(h1, d1, z1, stream)) if to_host else (lambda: rt.copy_batch(d1, h1, z1, stream))
            else:
                fn = lambda o=ops[to_host]: rt.copy_3d_batch(o, stream)  # noqa: E731
            r = {"way": way, "dir": direction}
            try:
                if to_host:
                    host.zero_()
                    fn(); torch.cuda.synchronize()
                    got = host.view(L, pages, block)[:, hpage]
                    r["bit_exact"] = bool(torch.equal(got, want))
                else:
                    host.view(L, pages, block)[:, hpage] = want
                    scratch = dev.clone()
                    dev.view(L, 2 * pages, block)[:, dpage] = 0
                    fn(); torch.cuda.synchronize()
                    r["bit_exact"] = bool(torch.equal(dev, scratch))
                    dev.copy_(scratch); del scratch
                ms, host_us = _event_ms(fn, args.reps)
                r.update(ms=ms, ratio=base[direction] / ms, host_us=host_us)
            except RuntimeError as exc:
                r["error"] = str(exc)
            rows.append(r)
            print(r, flush=True)
    res["backup"] = rows
    per_call = []
    for n in (1, 4, 16, 64):
        sub = Pitched(*(getattr(p2, f)[:n] for f in ("host", "dev", "width", "height", "host_pitch", "dev_pitch")))
        o = ops_tensor(sub, to_host=True)
        host_us = _event_ms(lambda: rt.submit_3d(o.data_ptr(), n, stream), args.reps)[1]
        h, d, z = expand(sub)
        host_1d = _event_ms(lambda: rt.submit_batch(h.data_ptr(), d.data_ptr(), z.data_ptr(), int(h.numel()), stream),
                            args.reps)[1]
        per_call.append({"ops": n, "rows": int(h.numel()), "host_us_3d": host_us, "host_us_1d_rows": host_1d})
        print(per_call[-1], flush=True)
    res["per_call"] = per_call
    del dev, host, host_c
    torch.cuda.empty_cache()
    # pitches above 2 GiB and 4 GiB on both sides (realistic host pools: millions of tokens per layer), and
    # a negative device pitch (per-layer device tensors allocated in descending addresses), two rows each
    res["big_pitch"] = []
    for pitch, dev_sign in ((3 * 2**30 + 4096, 1), (5 * 2**30 + 4096, 1), (64 * 2**20, -1)):
        try:
            hb = torch.empty(pitch + block, dtype=torch.uint8, pin_memory=True)
            db = torch.randint(0, 255, (pitch + block,), dtype=torch.uint8, device="cuda")
            d0 = db.data_ptr() if dev_sign > 0 else db.data_ptr() + pitch
            big = Pitched(torch.tensor([hb.data_ptr()]), torch.tensor([d0]), torch.tensor([block]),
                          torch.tensor([2]), torch.tensor([pitch]), torch.tensor([dev_sign * pitch]))
            o = ops_tensor(big, to_host=True)
            err = rt.submit_3d(o.data_ptr(), 1, stream)
            torch.cuda.synchronize()
            if dev_sign > 0:
                ok = torch.equal(hb[:block], db[:block].cpu()) and torch.equal(hb[pitch:], db[pitch:].cpu())
            else:
                ok = torch.equal(hb[:block], db[pitch:].cpu()) and torch.equal(hb[pitch:], db[:block].cpu())
            r = {"pitch": pitch, "dev_sign": dev_sign, "err": err, "err_str": rt.error_string(err) if err else "",
                 "bit_exact": bool(err == 0 and ok)}
            del hb, db
        except Exception as exc:  # noqa: BLE001 - a probe records what happened
            r = {"pitch": pitch, "dev_sign": dev_sign, "exception": repr(exc)}
        res["big_pitch"].append(r)
        print("big pitch", r, flush=True)
        torch.cuda.empty_cache()
    # per-layer tensors allocated one after another (SGLang's MLA pool: one torch.zeros per layer)
    spacing = {}
    for label, numel in (("mla-200k-tokens", 200_064 * 576), ("mla-1m-tokens", 1_000_064 * 576)):
        try:
            bufs = [torch.zeros(numel, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
            diffs = sorted({b.data_ptr() - a.data_ptr() for a, b in zip(bufs, bufs[1:])})
            spacing[label] = {"layer_bytes": numel * 2, "distinct_diffs": diffs[:8], "n_distinct": len(diffs)}
            del bufs
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            spacing[label] = {"exception": repr(exc)}
        print(label, spacing[label], flush=True)
    res["per_layer_alloc_spacing"] = spacing
    with open(os.path.join(args.out, "ce2d_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

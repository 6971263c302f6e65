"""Staged backup probe: does splitting a packed route's pitched copies into chunks cost the copy engine,
and do copy streams that alternate between chunks win it back?

Usage (GPU): ``python benchmarks/chunk_streams_probe.py [--out DIR] [--reps N]``.  An MLA all-layer
backup (61 layers, 4096 tokens x 1152 bytes, 64-token pages, random host pages) is copied D2H from a
device staging buffer (page-major: ``[page, layer, block]``, as the staged route packs it) to a pinned
layer-major host buffer as 64 pitched operations (one per page, 61 rows), submitted

* in chunks (:data:`SCHEDULES`: one call; the staged route's chunks at its default budget; eight
  of 8 pages; a ramp that starts small),
* on ``S`` copy streams, chunk ``k`` on stream ``k % S`` (1: all on the caller's stream),
* with each chunk's copies waiting for an event recorded on a side stream, either right away
  (``wait``) or after the side stream copied that chunk's bytes into the staging buffer (what the
  route's gather does) by a torch device copy or by a Triton copy of a given number of programs
  (:data:`WAITS`), or with no wait (``none``),

next to one pinned ``copy_`` of the same bytes, and each device copy's own speed alone.  Last, a hybrid:
the first pages as plain descriptors straight from the source while the rest is written into the image,
then sent as pitched copies (``PROBE_SCHEDULES=0`` runs this part alone).  Every variant is checked byte for byte first; ratio,
device time and host time of the submission go to ``<out>/chunk_streams_probe.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ce_probe import _event_ms, probe_setup  # noqa: E402
from hicache_core.backends.pitched import Pitched, ops_tensor  # noqa: E402

#: chunk schedules (pages per chunk, in order)
SCHEDULES = {"one": [64], "29": [29, 29, 6], "8": [8] * 8, "ramp": [2, 6, 8, 16, 16, 16]}
STREAMS = (1, 2)
#: how each chunk's bytes reach the staging buffer before its copies: not at all (``none``), an event only
#: (``wait``), a torch device copy (``ce``) or a persistent Triton copy of P programs (``smP``; ``sm0``: one
#: program per 8 KiB, no loop)
WAITS = ("none", "wait", "ce", "sm0", "sm32", "sm8", "sm2")


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(src, dst, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        offs = tl.arange(0, BLOCK)
        for start in range(pid * BLOCK, n, step):
            idx = start + offs
            m = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)

    def run(dst: torch.Tensor, src: torch.Tensor, programs: int) -> None:
        d, s = dst.view(torch.int64), src.view(torch.int64)
        n = d.numel()
        grid = programs if programs else -(-n // 1024)
        copy_words[(grid,)](s, d, n, BLOCK=1024, num_warps=4)
    return run


def main() -> int:
    args, rt, _ = probe_setup(15)
    with torch.cuda.stream(torch.cuda.Stream()):  # a real stream as the caller's (not the legacy default)
        return _run(args, rt)


def _run(args, rt) -> int:
    res: dict = {"gpu": torch.cuda.get_device_name(), "runtime": rt.version, "rows": []}
    L, row, tokens, ps = 61, 1152, 4096, 64
    pages, block = tokens // ps, ps * row
    host_layer = tokens * row
    host = torch.empty(L * host_layer, dtype=torch.uint8, pin_memory=True)
    source = torch.randint(0, 255, (L * pages * block,), dtype=torch.uint8, device="cuda")
    stage = source.clone()
    hpage = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).to(torch.int64)
    k = torch.arange(pages, dtype=torch.int64)
    full = lambda t: torch.full((pages,), t, dtype=torch.int64)  # noqa: E731
    p = Pitched(hpage * block + host.data_ptr(), k * L * block + stage.data_ptr(), full(block), full(L),
                full(host_layer), full(block))
    ops = ops_tensor(p, to_host=True)
    want = stage.view(pages, L, block).transpose(0, 1).cpu()
    main_s = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    copy_streams = [torch.cuda.Stream() for _ in range(max(STREAMS) - 1)]
    page_bytes = L * block
    base = _event_ms(lambda: host.copy_(stage, non_blocking=True), args.reps)[0]
    res["memcpy_ms"] = base

    sm_copy = _copy_kernel()

    def write(dst: torch.Tensor, src: torch.Tensor, how: str) -> None:
        """Write the staging image the way ``how`` names: ``ce`` (a torch device copy) or ``smP`` (Triton)."""
        if how == "ce":
            dst.copy_(src)
        else:
            sm_copy(dst, src, int(how[2:]))
    for wait in WAITS[2:]:  # each device copy alone, all bytes
        fn = lambda w=wait: write(stage, source, w)  # noqa: E731
        ms = _event_ms(fn, args.reps)[0]
        res.setdefault("device_copy_gbps", {})[wait] = 2 * stage.numel() / ms / 1e6
        print(f"device copy {wait}: {stage.numel() / ms / 1e6:.0f} GB/s copied", flush=True)

    def variant(schedule: list[int], nstreams: int, wait: str):
        streams = [main_s] + copy_streams[: nstreams - 1]

        def fn() -> None:
            for s in streams[1:]:
                s.wait_stream(main_s)
            side.wait_stream(main_s)
            p0 = 0
            for j, c in enumerate(schedule):
                p1 = p0 + c
                s = streams[j % nstreams]
                if wait != "none":
                    with torch.cuda.stream(side):
                        if wait != "wait":
                            write(stage[p0 * page_bytes : p1 * page_bytes], source[p0 * page_bytes : p1 * page_bytes],
                                  wait)
                        ev = side.record_event()
                    s.wait_event(ev)
                rt.copy_3d_batch(ops[p0:p1], s.cuda_stream)
                p0 = p1
            for s in streams[1:]:
                main_s.wait_stream(s)
            main_s.wait_stream(side)
        return fn

    for name, schedule in SCHEDULES.items() if os.environ.get("PROBE_SCHEDULES", "1") == "1" else ():
        assert sum(schedule) == pages
        for nstreams in STREAMS:
            if len(schedule) == 1 and nstreams > 1:
                continue
            for wait in WAITS:
                fn = variant(schedule, nstreams, wait)
                host.zero_()
                fn()
                torch.cuda.synchronize()
                ok = bool(torch.equal(host.view(L, pages, block)[:, hpage], want))
                ms, host_us = _event_ms(fn, args.reps)
                r = {"schedule": name, "streams": nstreams, "wait": wait, "bit_exact": ok, "ratio": base / ms,
                     "ms": ms, "host_us": host_us}
                res["rows"].append(r)
                print(f"chunks {name:4s} streams {nstreams} wait {wait:8s} ratio {r['ratio']:.3f} "
                      f"ms {ms:.2f} host {host_us:.0f} us bit_exact {ok}", flush=True)
    # hybrid: the first pages as plain descriptors straight from the source (no staging, no wait), the rest
    # relaid into the staging buffer meanwhile and copied as pitched operations after them
    from hicache_core.backends.pitched import expand
    hs, ds, zs = expand(Pitched(hpage * block + host.data_ptr(), k * L * block + source.data_ptr(), full(block),
                                full(L), full(host_layer), full(block)))  # page-major: page k's rows are k*L..k*L+L-1
    for plain in (0, 16, 24, 32, 40, 48, 64):
        for wait in ("ce", "sm0", "sm32"):
            def fn(plain=plain, wait=wait) -> None:
                side.wait_stream(main_s)
                if plain < pages:
                    with torch.cuda.stream(side):
                        write(stage[plain * page_bytes :], source[plain * page_bytes :], wait)
                        ev = side.record_event()
                n = plain * L
                if n:
                    rt.copy_batch(hs[:n], ds[:n], zs[:n], main_s.cuda_stream)
                if plain < pages:
                    main_s.wait_event(ev)
                    rt.copy_3d_batch(ops[plain:], main_s.cuda_stream)
                main_s.wait_stream(side)
            host.zero_()
            fn()
            torch.cuda.synchronize()
            ok = bool(torch.equal(host.view(L, pages, block)[:, hpage], want))
            ms, host_us = _event_ms(fn, args.reps)
            r = {"hybrid_plain_pages": plain, "wait": wait, "bit_exact": ok, "ratio": base / ms, "ms": ms,
                 "host_us": host_us}
            res["rows"].append(r)
            print(f"hybrid plain {plain:2d} pages wait {wait:4s} ratio {r['ratio']:.3f} ms {ms:.2f} host {host_us:.0f} us "
                  f"bit_exact {ok}", flush=True)
            if plain == pages:
                break
    with open(os.path.join(args.out, "chunk_streams_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

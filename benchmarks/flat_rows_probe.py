"""Would loading whole pages as flat contiguous words (register kernel, no TMA) reach the link for any row size?

Usage (GPU): ``python benchmarks/flat_rows_probe.py [--out DIR] [--reps N] [--variants ...] [--cases ...]``; on a CPU,
``TRITON_INTERPRET=1 python benchmarks/flat_rows_probe.py --check`` runs the byte check alone, small.

hicache's row kernel moves a tile of rows as a ``[tokens, block]`` block whose column step is the next
power of two of the row: a 656-byte row uses 41 of 64 16-byte lanes, a 1152-byte row 72 of 128.  Where a
page of one layer is contiguous on both sides (``layer_first`` and ``page_first_direct`` hosts; the
device rows of a page allocator), the page is one run of ``page_size * row`` bytes and can be copied as
flat words, every lane busy but the last chunk's tail.  Here a work item is one chunk of ``CHUNK`` bytes
of one page; each item checks (on the device) that its page's host slots and device rows are
consecutive runs inside their bounds, and moves nothing otherwise (a real kernel would gather those rows).

Per shape (MLA fp8 656- and 576-byte rows, MLA bf16 1152-byte rows, MHA 2048-byte rows; 4096 tokens,
page 64; fp8 576 at page 16 too): byte check, then lone loads of the middle layer (synchronised before
each; ``lone``), the same right after a 5 ms GEMM (``lone_hot``: a GPU that has just computed, as in a
forward pass), a burst over every layer, and a bf16 GEMM's slowdown beside bursts; beside them hicache's
``layer_first`` kernel through the pool on the same bytes (``--kernels``: programs, page loads on or off).  Ratios are to a
pinned ``copy_`` of the same bytes timed the same way (lone, hot, and as many copies back to back as
the burst has launches).  Results in ``<out>/flat_rows_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

import torch
import triton
import triton.language as tl

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


@triton.jit(do_not_specialize=["n_pages", "capacity", "dev_rows"])
def _flat_load(host, dev, hidx, didx, n_pages, capacity, dev_rows, RW: tl.constexpr, PS: tl.constexpr,
               CHUNK: tl.constexpr, CHUNKS: tl.constexpr, STAGES: tl.constexpr, EARLY: tl.constexpr):
    """Chunk ``it % CHUNKS`` of page ``it // CHUNKS``: host words from slot ``hidx[page * PS]`` on, to device
    rows from ``didx[page * PS]`` on, when both are ``PS`` consecutive in-range slots / rows.

    ``EARLY``: the host read starts from the page's first slot as soon as that slot and row are in range
    (the span it reads is then in bounds), while the check that the page is a run of slots and rows on both
    sides (a reduction) completes; only the store waits for it.  Else the read waits for the whole check."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    n_items = n_pages.to(tl.int64) * CHUNKS
    i = tl.arange(0, PS)
    for it in tl.range(pid, n_items, nprog, num_stages=STAGES):
        pg = it // CHUNKS
        ch = it - pg * CHUNKS
        c = ch * CHUNK + tl.arange(0, CHUNK)
        if EARLY:
            h0 = tl.load(hidx + pg * PS).to(tl.int64)
            d0 = tl.load(didx + pg * PS).to(tl.int64)
            inb = (h0 >= 0) * (h0 + PS <= capacity) * (d0 >= 0) * (d0 + PS <= dev_rows)
            x = tl.load(host + h0 * RW + c, mask=c < PS * RW * inb)
            hh = tl.load(hidx + pg * PS + i).to(tl.int64)
            dd = tl.load(didx + pg * PS + i).to(tl.int64)
            run = tl.min(((hh == h0 + i) & (dd == d0 + i)).to(tl.int32), 0)
            tl.store(dev + d0 * RW + c, x, mask=c < PS * RW * inb * run)
        else:
            hh = tl.load(hidx + pg * PS + i).to(tl.int64)
            dd = tl.load(didx + pg * PS + i).to(tl.int64)
            h0 = tl.min(hh, 0)
            d0 = tl.min(dd, 0)
            run = (hh == h0 + i) & (dd == d0 + i)
            ok = tl.min(run.to(tl.int32), 0) * (h0 >= 0) * (h0 + PS <= capacity) * (d0 >= 0) * (d0 + PS <= dev_rows)
            m = c < PS * RW * ok
            x = tl.load(host + h0 * RW + c, mask=m)
            tl.store(dev + d0 * RW + c, x, mask=m)


DEFAULT_VARIANTS = ("16:16:16384:1:0,32:8:8192:1:0,16:16:16384:1:1,32:8:8192:1:1,32:16:16384:1:1,64:8:8192:1:1,"
                    "32:16:32768:1:1,64:4:4096:1:1,16:16:32768:2:1,32:8:8192:2:1")
DEFAULT_CASES = "mla61x656-fp8:64,mla61x576-fp8:16,mla61x576-fp8:64,mla61x576-bf16:64"


def _word(row_bytes: int) -> torch.dtype:
    return torch.int32 if row_bytes % 4 == 0 else torch.uint8


def make_layer_load(host_layer: torch.Tensor, dev_layer: torch.Tensor, row_bytes: int, ps: int, hidx: torch.Tensor,
                    didx: torch.Tensor, *, programs: int, warps: int, chunk_bytes: int, stages: int,
                    early: bool = True) -> Callable[[], None]:
    """A no-argument load of host slots ``hidx`` of ``host_layer`` (``[slots, row_bytes]`` bytes, contiguous)
    into device rows ``didx`` of ``dev_layer`` (``[rows, row_bytes]`` bytes, contiguous); launched through the
    driver (:mod:`hicache_core.drvlaunch`) after a first Triton launch where it can be, as the pool launches."""
    word = _word(row_bytes)
    wb = torch.tensor([], dtype=word).element_size()
    h, d = host_layer.view(torch.uint8).view(word), dev_layer.view(torch.uint8).view(word)
    rw, chunk = row_bytes // wb, chunk_bytes // wb
    chunks = -(-ps * rw // chunk)
    n_pages = hidx.numel() // ps
    grid = min(programs, n_pages * chunks)
    args = (h, d, hidx, didx, n_pages, host_layer.shape[0], dev_layer.shape[0])
    meta = dict(RW=rw, PS=ps, CHUNK=chunk, CHUNKS=chunks, STAGES=stages, EARLY=early, num_warps=warps)
    return driver_launch(_flat_load, grid, args, meta)


def driver_launch(kernel: Any, grid: int, args: tuple, meta: dict) -> Callable[[], None]:
    """A no-argument launch of ``kernel[(grid,)](*args, **meta)``: a first Triton launch (compiles), then the
    compiled kernel through the CUDA driver (:mod:`hicache_core.drvlaunch`) where it can be, as the pool
    launches.  ``fn.info``: PTX wide-access counts, registers, spills, whether the driver launch is used."""
    compiled = kernel[(grid,)](*args, **meta)
    fast: Any = None
    if args[0].is_cuda:
        from hicache_core.drvlaunch import DriverKernel
        drv = DriverKernel.build(compiled)
        if drv is not None:
            fast = (drv, drv.pack(args, ()))

    def fn() -> None:
        if fast is not None:
            fast[0].relaunch(grid, torch.cuda.current_stream().cuda_stream, fast[1], ())
        else:
            kernel[(grid,)](*args, **meta)
    ptx = compiled.asm.get("ptx", "") if isinstance(getattr(compiled, "asm", None), dict) else ""
    fn.info = {"v4_loads": ptx.count("ld.global.v4"), "v4_stores": ptx.count("st.global.v4"),  # type: ignore[attr-defined]
               "v2_loads": ptx.count("ld.global.v2"), "regs": getattr(compiled, "n_regs", None),
               "spills": getattr(compiled, "n_spills", None), "driver_launch": fast is not None}
    return fn


def check(row_bytes: int, ps: int, device: str, pin: bool, **shape: int) -> bool:
    """Random pages (and one page whose slots are not a run: it must stay untouched) through the kernel;
    canary rows must stay as they were."""
    g = torch.Generator().manual_seed(row_bytes + ps)
    pages = 6
    host = torch.randint(0, 256, (2 * pages * ps, row_bytes), dtype=torch.uint8, generator=g)
    host = host.pin_memory() if pin else host
    dev = torch.randint(0, 256, (3 * pages * ps, row_bytes), dtype=torch.uint8, generator=g).to(device)
    hp, dp = torch.randperm(2 * pages, generator=g)[:pages], torch.randperm(3 * pages, generator=g)[:pages]
    ar = torch.arange(ps)
    hidx = (hp.unsqueeze(1) * ps + ar).reshape(-1)
    didx = (dp.unsqueeze(1) * ps + ar).reshape(-1)
    if ps > 1:
        hidx[-ps:] = hidx[-ps:].flip(0)  # the last page is not a run: nothing of it may move
    want = dev.cpu().clone()
    good = slice(0, (pages - 1) * ps) if ps > 1 else slice(0, pages * ps)
    want[didx[good]] = host.cpu()[hidx[good]]
    make_layer_load(host, dev, row_bytes, ps, hidx.to(device), didx.to(device), **shape)()
    return torch.equal(dev.cpu(), want)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="flat kernel launches, PROGRAMS:WARPS:CHUNK_BYTES:STAGES:EARLY,...")
    ap.add_argument("--kernels", default="0:off,0:on,8:on",
                    help="hicache layer_first.kernel pools: PROGRAMS(0: default):PAGES(on|off),... ('none': skip)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="SHAPE:PAGE_SIZE,... (hicache.bench SHAPES)")
    ap.add_argument("--check", action="store_true", help="byte checks only (small; TRITON_INTERPRET=1 on a CPU)")
    args = ap.parse_args()
    if args.check:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        ok = all(check(rb, ps, dev, dev == "cuda", programs=3, warps=4, chunk_bytes=cb, stages=2, early=early)
                 for rb in (656, 1152, 576) for ps in (1, 16) for cb in (1024, 4096) for early in (False, True))
        print(json.dumps({"bit_exact": ok}))
        return 0 if ok else 1
    require_cuda(__file__)  # (--check runs on a CPU too)

    from hicache_core.bench import _gemm_slowdown, _median_ms, _workload
    from hicache_core.pool import HostKVPool, allocate_host_buffers
    from hicache_core.registry import create_registry

    os.makedirs(args.out, exist_ok=True)
    reg = create_registry()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    hot = lambda: a @ a  # noqa: E731  ~2-3 ms of bf16 GEMM: the GPU has just computed
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",") if v and v != "none"]
    kernels = [tuple(v.split(":")) for v in args.kernels.split(",") if v and v != "none"]
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    rows: list[dict] = []
    for shape, ps in cases:
        spec, dev, h, _, d = _workload(shape, page_size=ps)
        host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=True)
        for name, t in host.items():
            t.view(torch.uint8).random_(0, 256)
        layers = list(spec.layer_map.device_layers)
        mid = layers[len(layers) // 2]
        comps = list(host)
        row_bytes = {c.name: c.row_bytes for c in spec.components}
        nbytes = sum(row_bytes[c] for c in comps) * h.numel()
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        cp = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
        base = {"lone": _median_ms(cp, args.reps, 1, idle=True), "lone_hot": _median_ms(cp, args.reps, 1, before=hot),
                "burst": _median_ms(lambda: [cp() for _ in layers], 5, 1, idle=True) / len(layers)}

        def host_layer(c: str, l: int) -> torch.Tensor:
            return host[c][l].view(torch.uint8).view(-1, row_bytes[c])

        def dev_layer(c: str, l: int) -> torch.Tensor:
            t = dev[c][l]
            assert t is not None and t.is_contiguous()
            return t.view(torch.uint8).view(-1, row_bytes[c])

        def record(variant: str, extra: dict, load: Callable[[int], None]) -> None:
            for l in (mid, layers[0]):
                before = {c: dev_layer(c, l).clone() for c in comps}
                load(l)
                torch.cuda.synchronize()
                for c in comps:
                    want = before[c]
                    want[d] = host_layer(c, l).to("cuda")[h]
                    if not torch.equal(dev_layer(c, l), want):
                        rows.append({"shape": shape, "page_size": ps, "variant": variant, **extra, "bit_exact": False})
                        print(json.dumps(rows[-1]), flush=True)
                        return
            burst = lambda: [load(l) for l in layers]  # noqa: E731
            t0 = time.perf_counter()
            for _ in range(5):
                load(mid)
                torch.cuda.synchronize()
            host_us = (time.perf_counter() - t0) / 5 * 1e6
            row = {"shape": shape, "page_size": ps, "variant": variant, **extra, "bit_exact": True,
                   "lone": round(base["lone"] / _median_ms(lambda: load(mid), args.reps, 1, idle=True), 3),
                   "lone_hot": round(base["lone_hot"] / _median_ms(lambda: load(mid), args.reps, 1, before=hot), 3),
                   "burst": round(base["burst"] / (_median_ms(burst, 5, 1, idle=True) / len(layers)), 3),
                   "gemm_pct": round(100 * _gemm_slowdown(burst), 1), "lone_wall_us": round(host_us, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)

        for programs, warps, chunk_bytes, stages, early in variants:
            shp = dict(programs=programs, warps=warps, chunk_bytes=chunk_bytes, stages=stages, early=bool(early))
            try:
                fns = {(c, l): make_layer_load(host_layer(c, l), dev_layer(c, l), row_bytes[c], ps, h, d, **shp)
                       for c in comps for l in layers}
            except Exception as exc:  # noqa: BLE001 - a probe: record why a configuration does not run
                rows.append({"shape": shape, "page_size": ps, "variant": "flat", **shp,
                             "error": f"{type(exc).__name__}: {str(exc)[-400:]}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            record("flat", {**shp, **next(iter(fns.values())).info},  # type: ignore[attr-defined]
                   lambda l, fns=fns: [fns[(c, l)]() for c in comps])
            del fns
        for programs_s, pages in kernels:
            programs = int(programs_s)
            opts = {"pages": pages == "on", **({"programs": programs} if programs else {})}
            pool = HostKVPool(spec, "layer_first", "kernel", dev, host_buffers=host, registry=reg,
                              strategy_options=opts)
            record("hicache-kernel", {"programs": programs or "default", "pages": pages},
                   lambda l, pool=pool: pool.load_layer(l, h, d))
            del pool
        del host, dev, src, dst
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "flat_rows_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

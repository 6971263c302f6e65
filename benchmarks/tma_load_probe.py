"""Can a Triton kernel with <= 4 programs load a layer from pinned host memory near link speed? (TMA)

Usage (GPU, Hopper): ``python benchmarks/tma_load_probe.py [--out DIR]``.  Loads read host memory
over PCIe; register-staged loads keep one tile per program in flight, so hicache's kernels need 16
programs for 0.76-0.85 of memcpy (docs/performance.md).  SGLang's TMA kernel keeps a ring of bulk
copies in flight per CTA and reaches 0.88-0.92 with 4.  This probe asks whether Triton's tensor
descriptors (TMA, pipelined by ``tl.range(..., num_stages=...)``) get there too, on one MLA layer
(4096 tokens x 1152-byte rows, 64-token pages, random host pages into random device page runs, both
sides page-contiguous, as ``layer_first`` holds them): each page is 9 boxes of 64 x 128 bytes.

Per configuration (programs, stages, box rows): ratio of one lone load to a pinned ``copy_`` of the
same bytes, the ratio of a burst (the layer loaded 61 times back to back; divided by one lone
``copy_`` in this case, so it can exceed 1), the slowdown of a bf16 8192^3 GEMM on another stream
during bursts, bit-exact check first; beside it hicache's ``layer_first`` kernel strategy at 4 and
16 programs on the same bytes.

``--cases`` adds two more: ``backup`` (all-layer backups of 61 such layers in one device allocation,
TMA both ways, host canaries checked; ratio and GEMM slowdown, beside hicache's kernel at 4 and 8
programs) and ``page_first`` (one-layer loads of a token-major ``[S, L, row]`` host buffer: rows 61
rows apart, two descriptors per box for the 1024 + 128 bytes of a row, ordinary device stores; burst
ratio against 61 copies back to back).  Results: ``<out>/tma_load_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hicache_core.bench import _gemm_slowdown, _median_ms

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def _record_load(op: str, name: str, fn, extra: dict, dev: torch.Tensor, want: torch.Tensor, reps: int, layers: int,
                 base_ms: float, burst_base_ms: float, rows: list) -> None:
    """Check ``fn`` (a one-layer load into ``dev``) against ``want``, then time it lone and in bursts of
    ``layers`` back to back (per layer), and a GEMM beside the bursts; append the row."""
    dev.zero_()
    fn()
    torch.cuda.synchronize()
    exact = torch.equal(dev, want)
    row = {"op": op, "variant": name, **extra, "bit_exact": exact}
    if exact:
        lone = _median_ms(fn, reps, idle=True)
        burst = _median_ms(lambda: [fn() for _ in range(layers)], max(3, reps // 4)) / layers
        row.update(lone_ratio=base_ms / lone, burst_ratio=burst_base_ms / burst,
                   gemm_slowdown_pct=100 * _gemm_slowdown(lambda: [fn() for _ in range(layers)]))
    rows.append(row)
    print(json.dumps(row), flush=True)


@triton.jit
def _tma_load_pages(h_desc, d_desc, hpages, dstarts, n_items,
                    CHUNKS: tl.constexpr, BOX: tl.constexpr, STAGES: tl.constexpr):
    """Work item = (page, box); a page is CHUNKS * (PAGE_ROWS // BOX) boxes of BOX 128-byte rows."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for it in tl.range(pid, n_items, nprog, num_stages=STAGES):
        page = it // CHUNKS
        c = it % CHUNKS
        hp = tl.load(hpages + page).to(tl.int32)  # TMA coordinates are 32-bit
        dp = tl.load(dstarts + page).to(tl.int32)
        x = h_desc.load([hp * (CHUNKS * BOX) + c * BOX, 0])
        d_desc.store([dp + c * BOX, 0], x)


@triton.jit
def _tma_backup_pages(d_desc, h_desc, dstarts, hstarts, n_items, PAGES, LAYER_ROWS,
                      CHUNKS: tl.constexpr, BOX: tl.constexpr, STAGES: tl.constexpr):
    """All-layer backup: work item = (layer, page, box), device rows -> host rows by TMA both ways."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for it in tl.range(pid, n_items, nprog, num_stages=STAGES):
        layer = it // (PAGES * CHUNKS)
        rem = it % (PAGES * CHUNKS)
        page = rem // CHUNKS
        c = rem % CHUNKS
        dp = tl.load(dstarts + page).to(tl.int32)
        hp = tl.load(hstarts + page).to(tl.int32)
        x = d_desc.load([layer * LAYER_ROWS + dp + c * BOX, 0])
        h_desc.store([layer * LAYER_ROWS + hp + c * BOX, 0], x)


def _backups(args, ps: int, row: int, tokens: int, layers: int, rows: list) -> None:
    """All-layer MLA backups (one device allocation for the 61 layers): TMA kernel vs hicache's kernel."""
    from hicache_core import HostKVPool, LayerMap, PoolSpec

    pages = tokens // ps
    pb = ps * row
    layer_bytes = 2 * pages * pb
    host = torch.empty(layers * layer_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (layers * layer_bytes,), dtype=torch.uint8, device="cuda")
    hp, dp = torch.randperm(2 * pages)[:pages], torch.randperm(2 * pages)[:pages]
    nbytes = layers * pages * pb
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    base_ms = _median_ms(lambda: dst.copy_(src, non_blocking=True), args.reps)
    hv, dv = host.view(layers, 2 * pages, pb), dev.view(layers, 2 * pages, pb)
    untouched = torch.ones(2 * pages, dtype=torch.bool)
    untouched[hp] = False

    def record(name: str, fn, extra: dict) -> None:
        host.fill_(0x5A)
        fn()
        torch.cuda.synchronize()
        exact = torch.equal(hv[:, hp].cpu(), dv[:, dp].cpu()) and bool((hv[:, untouched] == 0x5A).all())
        row_ = {"op": "backup_all_layers", "variant": name, **extra, "bit_exact": exact}
        if exact:
            ms = _median_ms(fn, max(5, args.reps // 2))
            row_.update(ratio=base_ms / ms, gemm_slowdown_pct=100 * _gemm_slowdown(fn))
        rows.append(row_)
        print(json.dumps(row_), flush=True)

    h64, d64 = host.view(torch.int64).view(-1, 16), dev.view(torch.int64).view(-1, 16)
    box, chunks, layer_rows = 64, pb // 128 // 64, layer_bytes // 128
    h_desc = TensorDescriptor(h64, list(h64.shape), list(h64.stride()), [box, 16])
    d_desc = TensorDescriptor(d64, list(d64.shape), list(d64.stride()), [box, 16])
    ds = (dp * (pb // 128)).to(torch.int32).cuda()
    hs = (hp * (pb // 128)).to(torch.int32).cuda()
    for programs in (2, 4, 8):
        for stages in (3, 6):
            def fn(p=programs, s=stages):
                _tma_backup_pages[(p,)](d_desc, h_desc, ds, hs, layers * pages * chunks, pages, layer_rows,
                                        CHUNKS=chunks, BOX=box, STAGES=s, num_warps=4)
            try:
                record("triton-tma", fn, {"programs": programs, "stages": stages, "box_bytes": box * 128})
            except Exception as exc:  # noqa: BLE001 - a probe: record why a configuration does not run
                rows.append({"op": "backup_all_layers", "variant": "triton-tma", "programs": programs,
                             "stages": stages, "error": f"{type(exc).__name__}: {str(exc)[-1200:]}"})
                print(rows[-1], flush=True)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=2 * tokens, device=torch.device("cuda"))
    dev_layers = [dv[i].view(torch.bfloat16).view(2 * tokens, 576) for i in range(layers)]
    hbuf = host.view(torch.bfloat16).view(layers, 2 * tokens, 576)
    hidx = ((hp.unsqueeze(1) * ps) + torch.arange(ps)).reshape(-1).cuda()
    didx = ((dp.unsqueeze(1) * ps) + torch.arange(ps)).reshape(-1).cuda()
    for programs in (4, 8):
        pool = HostKVPool(spec, "layer_first", "kernel", {"kv": dev_layers}, host_buffers={"kv": hbuf},
                          strategy_options={"programs": programs})
        record("hicache-kernel", lambda pool=pool: pool.backup_all_layers(hidx, didx), {"programs": programs})


@triton.jit
def _tma_strided_load(ha_desc, hb_desc, dev, hstarts, dstarts, n_items,
                      TOK: tl.constexpr, PER_PAGE: tl.constexpr, STAGES: tl.constexpr):
    """One layer of a token-major host buffer ([S, L, row]: one row per token, strided by L rows): TMA boxes
    of TOK rows (1024 + 128 bytes each, two descriptors), stored to device rows by ordinary stores."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols_a = tl.arange(0, 128)[None, :]
    cols_b = tl.arange(0, 16)[None, :]
    for it in tl.range(pid, n_items, nprog, num_stages=STAGES):
        page = it // PER_PAGE
        t = it % PER_PAGE
        h0 = tl.load(hstarts + page).to(tl.int32) + t * TOK
        d0 = tl.load(dstarts + page) + t * TOK
        a = ha_desc.load([h0, 0])
        b = hb_desc.load([h0, 0])
        rows = (d0 + tl.arange(0, TOK))[:, None].to(tl.int64) * 144
        tl.store(dev + rows + cols_a, a)
        tl.store(dev + rows + 128 + cols_b, b)


def _page_first_loads(args, ps: int, tokens: int, layers: int, rows: list) -> None:
    """One-layer loads of a token-major (page_first) MLA host buffer: 1152-byte rows, L x 1152 apart."""
    from hicache_core import HostKVPool, LayerMap, PoolSpec

    pages, slots, lay = tokens // ps, 2 * tokens, layers // 2
    host = torch.randint(-2**62, 2**62, (slots, layers, 144), dtype=torch.int64).pin_memory()
    dev = torch.zeros(slots, 144, dtype=torch.int64, device="cuda")
    hp, dp = torch.randperm(2 * pages)[:pages], torch.randperm(2 * pages)[:pages]
    hidx = ((hp.unsqueeze(1) * ps) + torch.arange(ps)).reshape(-1)
    didx = ((dp.unsqueeze(1) * ps) + torch.arange(ps)).reshape(-1)
    want = torch.zeros_like(dev)
    want[didx.cuda()] = host[hidx, lay].cuda()
    nbytes = tokens * 1152
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(20):
        dst.copy_(src, non_blocking=True)
    base_ms = _median_ms(lambda: dst.copy_(src, non_blocking=True), args.reps)
    burst_base = _median_ms(lambda: [dst.copy_(src, non_blocking=True) for _ in range(layers)], 5) / layers

    def record(name: str, fn, extra: dict) -> None:
        _record_load("load_layer page_first", name, fn, extra, dev, want, args.reps, layers, base_ms, burst_base, rows)

    part_a, part_b = host[:, lay, :128], host[:, lay, 128:]
    hs, ds = (hp * ps).to(torch.int32).cuda(), (dp * ps).cuda()
    for tok in (32, 64):
        ha = TensorDescriptor(part_a, [slots, 128], [layers * 144, 1], [tok, 128])
        hb = TensorDescriptor(part_b, [slots, 16], [layers * 144, 1], [tok, 16])
        for programs in (4, 8):
            for stages in (4, 6):
                def fn(p=programs, s=stages, tk=tok, ha=ha, hb=hb):
                    _tma_strided_load[(p,)](ha, hb, dev, hs, ds, pages * (ps // tk), TOK=tk, PER_PAGE=ps // tk,
                                            STAGES=s, num_warps=4)
                try:
                    record("triton-tma", fn, {"programs": programs, "stages": stages, "box_rows": tok})
                except Exception as exc:  # noqa: BLE001 - a probe: record why a configuration does not run
                    rows.append({"op": "load_layer page_first", "variant": "triton-tma", "programs": programs,
                                 "stages": stages, "box_rows": tok, "error": f"{type(exc).__name__}: {str(exc)[-1200:]}"})
                    print(rows[-1], flush=True)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=slots, device=torch.device("cuda"))
    dev_layers = [torch.zeros(slots, 576, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    dev_layers[lay] = dev.view(torch.bfloat16).view(slots, 576)
    hbuf = host.view(torch.bfloat16).view(slots, layers, 576)
    hg, dg = hidx.cuda(), didx.cuda()
    for programs in (4, 16):
        pool = HostKVPool(spec, "page_first", "kernel", {"kv": dev_layers}, host_buffers={"kv": hbuf},
                          strategy_options={"programs": programs})
        record("hicache-kernel", lambda pool=pool: pool.load_layer(lay, hg, dg), {"programs": programs})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", default="layer_first,backup,page_first",
                    help="comma-separated: layer_first (loads), backup (all-layer backups), page_first (loads)")
    args = ap.parse_args()
    require_cuda(__file__)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    ps, row, tokens, layers = 64, 1152, 4096, 61
    cases = set(args.cases.split(","))
    if "layer_first" not in cases:
        rows: list = []
        if "backup" in cases:
            _backups(args, ps, row, tokens, layers, rows)
        if "page_first" in cases:
            _page_first_loads(args, ps, tokens, layers, rows)
        with open(os.path.join(args.out, "tma_load_probe.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
        return 0
    pages = tokens // ps
    page_bytes = ps * row
    host = torch.randint(0, 256, (2 * pages * page_bytes,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(2 * pages * page_bytes + 4096, dtype=torch.uint8, device="cuda")
    hp = torch.randperm(2 * pages)[:pages]
    dp = torch.randperm(2 * pages)[:pages]
    want = torch.zeros_like(dev)
    for h, d in zip(hp.tolist(), dp.tolist()):
        want[d * page_bytes:(d + 1) * page_bytes] = host[h * page_bytes:(h + 1) * page_bytes].cuda()
    nbytes = pages * page_bytes
    base_ms = _median_ms(lambda: dev[:nbytes].copy_(host[:nbytes], non_blocking=True), args.reps)
    rows: list = []

    def record(name: str, fn, extra: dict) -> None:  # bursts against one lone copy here (see the docstring)
        _record_load("load_layer", name, fn, extra, dev, want, args.reps, layers, base_ms, base_ms, rows)

    # TMA: 128-byte rows (16 int64); a page is 576 of them
    h64, d64 = host.view(torch.int64).view(-1, 16), dev.view(torch.int64).view(-1, 16)
    hpg = hp.to(torch.int32).cuda()
    for box in (32, 64):  # Triton blocks are powers of two; a page is 576 rows of 128 B
        chunks = (page_bytes // 128) // box
        if chunks * box * 128 != page_bytes:
            continue
        h_desc = TensorDescriptor(h64, list(h64.shape), list(h64.stride()), [box, 16])
        d_desc = TensorDescriptor(d64, list(d64.shape), list(d64.stride()), [box, 16])
        dst = (dp * (page_bytes // 128)).to(torch.int32).cuda()
        for programs in (2, 4, 8):
            for stages in (2, 4, 6):
                def fn(p=programs, s=stages, c=chunks, b=box, hd=h_desc, dd=d_desc, ds=dst):
                    _tma_load_pages[(p,)](hd, dd, hpg, ds, pages * c, CHUNKS=c, BOX=b, STAGES=s, num_warps=4)
                try:
                    record("triton-tma", fn, {"programs": programs, "stages": stages, "box_rows": box,
                                              "box_bytes": box * 128})
                except Exception as exc:  # noqa: BLE001 - a probe: record why a configuration does not run
                    rows.append({"variant": "triton-tma", "programs": programs, "stages": stages, "box_rows": box,
                                 "error": f"{type(exc).__name__}: {str(exc)[-1200:]}"})
                    print(rows[-1], flush=True)
    # hicache's layer_first kernel on the same bytes, for comparison
    from hicache_core import HostKVPool, LayerMap, PoolSpec

    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=2 * tokens, device=torch.device("cuda"))
    dev_rows = dev[:2 * pages * page_bytes].view(torch.bfloat16).view(2 * tokens, 576)
    hbuf = host.view(torch.bfloat16).view(1, 2 * tokens, 576)
    hidx = ((hp.unsqueeze(1) * ps) + torch.arange(ps)).reshape(-1).cuda()
    didx = ((dp.unsqueeze(1) * ps) + torch.arange(ps)).reshape(-1).cuda()
    for programs in (4, 16):
        pool = HostKVPool(spec, "layer_first", "kernel", {"kv": [dev_rows]}, host_buffers={"kv": hbuf},
                          strategy_options={"programs": programs})
        record("hicache-kernel", lambda pool=pool: pool.load_layer(0, hidx, didx), {"programs": programs})
    del dev, host, want
    if "backup" in cases:
        _backups(args, ps, row, tokens, layers, rows)
    if "page_first" in cases:
        _page_first_loads(args, ps, tokens, layers, rows)
    with open(os.path.join(args.out, "tma_load_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "bytes": nbytes,
                   "memcpy_ms": base_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

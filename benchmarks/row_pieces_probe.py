"""Rows of one token (page size 1): the row kernel's padded column block against power-of-two pieces, and the
pools against a bare gather kernel.

Usage (GPU): ``python benchmarks/row_pieces_probe.py [--out DIR] [--reps N] [--variants ...] [--cases ...]
[--pools ...]``; on a CPU, ``TRITON_INTERPRET=1 python benchmarks/row_pieces_probe.py --check`` runs the byte check
alone, small.

The row kernel (:func:`hicache_core.kernel_lib.move_rows`) moves a tile of rows as one ``[tokens, block]`` block
whose column step is the next power of two of the row: a 576-byte row of 72 int64 words in a 128-word block
keeps 56% of the lanes busy.  Pages of one token are gathered row by row whatever the layout (TMA and page
loads need pages of several tokens), so this is what moves them.  Here one bare kernel gathers a layer's rows
either with that padded block (``PIECES`` 0) or with the row in power-of-two pieces (``PIECES`` 1: 64 + 8
words, no padding lane), at the row kernel's tunings, ``TOKENS`` from the padded step (as
:func:`~hicache_core.rowcopy.tile`) or from the real row (``REAL``); beside it the pools' own transfers
(``--pools``: layouts through their ``kernel`` strategy) on the same buffers' shapes and baselines.

Per shape (MLA fp8 656- and 576-byte rows, MLA bf16 1152-byte rows; 4096 random tokens): byte check, then
lone loads of the middle layer, the same right after a GEMM (``lone_hot``), a burst of per-layer loads, and
a backup of every layer (per-layer launches back to back; the pools' ``backup_all_layers``), each burst with
a bf16 GEMM's slowdown beside it.  Ratios are to pinned ``copy_`` s of the same bytes timed the same way (one
copy per layer).  Results in ``<out>/row_pieces_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flat_rows_probe import driver_launch  # noqa: E402
from needs_cuda import require_cuda  # noqa: E402

from hicache_core import kernel_lib as kl  # noqa: E402


@triton.jit
def _piece_rows(anchor, dev_row, host_row, ok, WIDTH: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                TO_HOST: tl.constexpr):
    """Whole ``BLOCK``-word steps, then the rest of the row in power-of-two pieces, largest first (the piece of
    ``b`` words starts at ``WIDTH - WIDTH % 2b``); ``VEC`` divides ``WIDTH``.  Each piece is one
    :func:`~hicache_core.kernel_lib.move_rows` of exactly its width."""
    kl.move_rows(anchor, dev_row, host_row, ok, WIDTH - WIDTH % BLOCK, BLOCK, VEC, TO_HOST)
    for k in tl.static_range(1, 13):
        if (WIDTH & (BLOCK >> k)) != 0:
            off = WIDTH - WIDTH % (2 * (BLOCK >> k))
            kl.move_rows(anchor, dev_row + off, host_row + off, ok, BLOCK >> k, BLOCK >> k, VEC, TO_HOST)


@triton.jit(do_not_specialize=["n"])
def _rows(anchor, dev_base, hidx, didx, n, capacity, dev_rows, RW: tl.constexpr, TOKENS: tl.constexpr,
          BLOCK: tl.constexpr, VEC: tl.constexpr, TO_HOST: tl.constexpr, PIECES: tl.constexpr, STAGES: tl.constexpr):
    """Host slot ``hidx[i]`` (``anchor + slot * RW`` words) <-> device row ``didx[i]`` (``anchor + dev_base + row *
    RW``), tiles of ``TOKENS`` positions over a persistent grid."""
    pid, nprog = kl.programs()
    n_tiles = tl.cdiv(n.to(tl.int64), TOKENS)
    for tile in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
        h, d, ok = kl.index_tile(hidx, didx, tile, n, capacity, dev_rows, TOKENS)
        if PIECES:
            _piece_rows(anchor, dev_base + d * RW, h * RW, ok, RW, BLOCK, VEC, TO_HOST)
        else:
            kl.move_rows(anchor, dev_base + d * RW, h * RW, ok, RW, BLOCK, VEC, TO_HOST)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def make_rows(host_layer: torch.Tensor, dev_layer: torch.Tensor, hidx: torch.Tensor, didx: torch.Tensor, *,
              to_host: bool, programs: int, warps: int, tile_bytes: int, pieces: bool, real: bool,
              stages: int = 1) -> Callable[[], None]:
    """A no-argument gather between ``host_layer`` (``[slots, row]`` bytes) and ``dev_layer`` (``[rows, row]``)."""
    row = host_layer.shape[1]
    word = next(w for w in (8, 4, 2, 1) if row % w == 0)
    dt = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    anchor = host_layer.view(dt)
    dev_base = (dev_layer.data_ptr() - host_layer.data_ptr()) // word
    assert (dev_layer.data_ptr() - host_layer.data_ptr()) % word == 0
    rw = row // word
    vec = next(v for v in (16, 8, 4, 2, 1) if v >= word and row % v == 0 and host_layer.data_ptr() % v == 0
               and dev_layer.data_ptr() % v == 0) // word
    block = min(1 << (rw - 1).bit_length(), _pow2_floor(4096 // word))
    tokens = min(256, _pow2_floor(tile_bytes // ((rw if real else block) * word)))
    n = hidx.numel()
    grid = max(1, min(programs, -(-n // tokens)))
    args = (anchor, dev_base, hidx, didx, n, host_layer.shape[0], dev_layer.shape[0])
    meta = dict(RW=rw, TOKENS=tokens, BLOCK=block, VEC=vec, TO_HOST=to_host, PIECES=pieces, STAGES=stages,
                num_warps=warps)
    fn = driver_launch(_rows, grid, args, meta)
    fn.info.update(tokens=tokens, block=block, vec=vec, word=word)  # type: ignore[attr-defined]
    return fn


def check(device: str) -> bool:
    """Loads and backups of random rows (a masked out-of-range slot among them) both ways; canaries intact."""
    ok = True
    for row in (656, 576, 1152, 40):
        g = torch.Generator().manual_seed(row)
        host = torch.randint(0, 256, (24, row), dtype=torch.uint8, generator=g)
        host = host.pin_memory() if device == "cuda" else host
        dev = torch.randint(0, 256, (32, row), dtype=torch.uint8, generator=g).to(device)
        hidx, didx = torch.randperm(24, generator=g)[:10], torch.randperm(32, generator=g)[:10]
        hidx[3] = 24  # out of range: that position moves nothing
        for to_host in (False, True):
            for pieces in (False, True):
                h0, d0 = host.clone(), dev.clone()
                if device == "cuda":
                    h0 = h0.pin_memory()
                fn = make_rows(h0, d0, hidx.to(device), didx.to(device), to_host=to_host, programs=3, warps=4,
                               tile_bytes=4 * row, pieces=pieces, real=pieces)
                fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                want_h, want_d = host.clone(), dev.cpu().clone()
                good = torch.arange(10) != 3
                if to_host:
                    want_h[hidx[good]] = dev.cpu()[didx[good]]
                else:
                    want_d[didx[good]] = host[hidx[good]]
                ok &= torch.equal(h0.cpu(), want_h) and torch.equal(d0.cpu(), want_d)
    return ok


DEFAULT_VARIANTS = ("load:16:16:65536:0:0,load:16:16:65536:1:0,load:16:16:65536:1:1,load:16:8:32768:0:0,"
                    "load:16:8:32768:1:1,backup:8:4:32768:0:0,backup:8:4:32768:1:0,backup:8:4:32768:1:1,"
                    "backup:8:8:32768:1:1")
DEFAULT_CASES = "mla61x656-fp8,mla61x576-fp8,mla61x576-bf16"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="OP:PROGRAMS:WARPS:TILE_BYTES:PIECES:REAL,...")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="SHAPE,... (hicache.bench SHAPES), page size 1")
    ap.add_argument("--pools", default="layer_first,page_first,page_first_kv_split",
                    help="layouts whose kernel strategy is measured beside the bare kernel ('none': skip)")
    ap.add_argument("--check", action="store_true", help="byte checks only (small; TRITON_INTERPRET=1 on a CPU)")
    args = ap.parse_args()
    if args.check:
        ok = check("cuda" if torch.cuda.is_available() else "cpu")
        print(json.dumps({"bit_exact": ok}))
        return 0 if ok else 1
    require_cuda(__file__)  # (--check runs on a CPU too)

    from hicache_core.bench import _check, _gemm_slowdown, _median_ms, _workload
    from hicache_core.pool import HostKVPool, allocate_host_buffers
    from hicache_core.registry import create_registry

    os.makedirs(args.out, exist_ok=True)
    reg = create_registry()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    hot = lambda: a @ a  # noqa: E731
    rows: list[dict] = []
    for shape in args.cases.split(","):
        spec, dev, h, s, d = _workload(shape, page_size=1)
        layers = list(spec.layer_map.device_layers)
        mid = layers[len(layers) // 2]
        comps = list(spec.components)
        nbytes = sum(c.row_bytes for c in comps) * h.numel()
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        h2d = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
        d2h = lambda: src.copy_(dst, non_blocking=True)  # noqa: E731
        base = {"lone": _median_ms(h2d, args.reps, 1, idle=True), "lone_hot": _median_ms(h2d, args.reps, 1, before=hot),
                "burst": _median_ms(lambda: [h2d() for _ in layers], 5, 1, idle=True),
                "backup": _median_ms(lambda: [d2h() for _ in layers], 5, 1, idle=True)}

        def measure(row: dict, load: Callable[[int], object] | None, backup: Callable[[], object] | None) -> None:
            if backup is not None:
                row["backup"] = round(base["backup"] / _median_ms(backup, 5, 1, idle=True), 3)
                row["backup_gemm_pct"] = round(100 * _gemm_slowdown(backup), 1)
            if load is not None:
                burst = lambda: [load(l) for l in layers]  # noqa: E731
                row["lone"] = round(base["lone"] / _median_ms(lambda: load(mid), args.reps, 1, idle=True), 3)
                row["lone_hot"] = round(base["lone_hot"] / _median_ms(lambda: load(mid), args.reps, 1, before=hot), 3)
                row["burst"] = round(base["burst"] / _median_ms(burst, 5, 1, idle=True), 3)
                row["burst_gemm_pct"] = round(100 * _gemm_slowdown(burst), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)

        host = {c.name: torch.empty(len(layers), spec.capacity, c.row_bytes, dtype=torch.uint8).pin_memory()
                for c in comps}
        for t in host.values():
            t.random_(0, 256)

        def dev_layer(c: Any, l: int) -> torch.Tensor:
            t = dev[c.name][l]
            assert t is not None and t.is_contiguous()
            return t.view(torch.uint8).view(-1, c.row_bytes)

        for v in [v for v in args.variants.split(",") if v and v != "none"]:
            op, programs, warps, tile_bytes, pieces, real = v.split(":")
            to_host = op == "backup"
            shp = dict(to_host=to_host, programs=int(programs), warps=int(warps), tile_bytes=int(tile_bytes),
                       pieces=bool(int(pieces)), real=bool(int(real)))
            fns = {(c.name, l): make_rows(host[c.name][l], dev_layer(c, l), h, s if to_host else d, **shp)
                   for c in comps for l in layers}
            one = lambda l: [fns[(c.name, l)]() for c in comps]  # noqa: E731
            exact = True
            for l in (mid, layers[0]):
                before_h = {c.name: host[c.name][l].clone() for c in comps}
                before_d = {c.name: dev_layer(c, l).clone() for c in comps}
                one(l)
                torch.cuda.synchronize()
                for c in comps:
                    wh, wd = before_h[c.name].clone(), before_d[c.name].clone()
                    if to_host:
                        wh[h.cpu()] = before_d[c.name][s].cpu()
                    else:
                        wd[d] = before_h[c.name][h.cpu()].to("cuda")
                    exact &= torch.equal(host[c.name][l], wh) and torch.equal(dev_layer(c, l), wd)
            row = {"shape": shape, "variant": v, **shp, **next(iter(fns.values())).info,  # type: ignore[attr-defined]
                   "bit_exact": exact}
            measure(row, None if to_host else one, (lambda: [one(l) for l in layers]) if to_host else None)
            del fns
        del host
        for layout in [p for p in args.pools.split(",") if p and p != "none"]:
            pool_host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
            pool = HostKVPool(spec, layout, "kernel", dev, host_buffers=pool_host, registry=reg)
            _check(pool, dev, h, s, d)  # raises unless bit-exact
            row = {"shape": shape, "variant": f"pool:{layout}", "strategy": pool.strategy_name, "bit_exact": True}
            measure(row, lambda l, pool=pool: pool.load_layer(l, h, d), lambda pool=pool: pool.backup_all_layers(h, s))
            del pool, pool_host
        del dev, src, dst
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "row_pieces_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

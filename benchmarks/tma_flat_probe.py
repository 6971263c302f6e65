"""Would TMA loads of whole pages viewed as flat 1024-byte rows reach the link for any row size? (GPU probe)

Usage (GPU, Hopper): ``python benchmarks/tma_flat_probe.py [--out DIR] [--reps N]``; on a CPU,
``TRITON_INTERPRET=1 python benchmarks/tma_flat_probe.py --check`` runs the byte check alone, small.

hicache's TMA loads read each host row as a power-of-two box plus one power-of-two tail box, so
656-byte fp8 MLA rows (512 + 144 bytes) keep the register kernel (0.73-0.84 of memcpy, where SGLang's TMA
kernel, copying whole pages, reaches 0.84-0.87; docs/performance.md).  Here a host page of one layer
(``page_size`` rows, contiguous, as ``layer_first`` holds it) is read as flat rows of 1024 bytes (a 64 x
656-byte page is 41 of them, 64 x 1152 is 72) in boxes of ``BIG`` flat rows plus at most four boxes
of 8, 4, 2, 1 rows (one descriptor per box size; nothing is read twice), and each word is stored to
its device row, found per token through the device index (device rows may be anywhere).

Per row size (656, 1152 and 576 bytes), programs, stages, ``BIG`` and warps: bit-exact check first,
then the ratio of a lone load to a pinned ``copy_`` of the same bytes, the ratio of a burst of 61 loads
back to back to 61 such copies back to back, and a bf16 GEMM's slowdown beside the bursts; beside
them hicache's ``layer_first`` kernel on the same bytes.  Results in ``<out>/tma_flat_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda

FW = 256  # int32 words per flat row (1024 bytes)


@triton.jit
def _box(desc, dev, didx, pos0, r0, Q: tl.constexpr, R: tl.constexpr, FW: tl.constexpr, RW: tl.constexpr):
    """Flat rows ``Q .. Q+R-1`` of the page at descriptor row ``r0``: one bulk read, then each word to its device
    row (``didx[pos0 + token]``)."""
    x = desc.load([r0 + Q, 0])
    f = (Q + tl.arange(0, R))[:, None] * FW + tl.arange(0, FW)[None, :]
    t = f // RW
    drow = tl.load(didx + pos0 + t)
    tl.store(dev + drow * RW + (f - t * RW), x)


@triton.jit
def _flat_page_load(d_big, d8, d4, d2, d1, dev, didx, hpages, n_pages, PR: tl.constexpr, BIG: tl.constexpr,
                    NBIG: tl.constexpr, H8: tl.constexpr, H4: tl.constexpr, H2: tl.constexpr, H1: tl.constexpr,
                    FW: tl.constexpr, RW: tl.constexpr, PS: tl.constexpr, STAGES: tl.constexpr):
    """Page ``pg`` of the call: host page ``hpages[pg]`` (``PR`` flat rows) to the device rows of positions
    ``pg * PS ..``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for pg in tl.range(pid, n_pages, nprog, num_stages=STAGES):
        r0 = tl.load(hpages + pg).to(tl.int32) * PR
        pos0 = pg * PS
        for k in tl.static_range(NBIG):
            _box(d_big, dev, didx, pos0, r0, k * BIG, BIG, FW, RW)
        q = NBIG * BIG
        if H8:
            _box(d8, dev, didx, pos0, r0, q, 8, FW, RW)
        if H4:
            _box(d4, dev, didx, pos0, r0, q + 8 * H8, 4, FW, RW)
        if H2:
            _box(d2, dev, didx, pos0, r0, q + 8 * H8 + 4 * H4, 2, FW, RW)
        if H1:
            _box(d1, dev, didx, pos0, r0, q + 8 * H8 + 4 * H4 + 2 * H2, 1, FW, RW)


def make_load(host: torch.Tensor, dev: torch.Tensor, row_bytes: int, ps: int, hpages: torch.Tensor,
              didx: torch.Tensor, *, big: int, programs: int, stages: int, warps: int):
    """A no-argument function loading the host pages ``hpages`` (of ``host``, ``[pages, ps * row_bytes]`` bytes)
    into the device rows ``didx`` (int64, one per position) of ``dev`` (``[rows, row_bytes]`` bytes)."""
    page_bytes = ps * row_bytes
    assert page_bytes % (4 * FW) == 0 and row_bytes % 4 == 0
    pr = page_bytes // (4 * FW)
    nbig, rem = divmod(pr, big)
    bits = [(rem >> s) & 1 for s in (3, 2, 1, 0)]
    assert rem < 16 and (big == 16 or rem < big)
    flat = host.view(torch.int32).view(-1, FW)
    descs = {b: TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [b, FW]) for b in (big, 8, 4, 2, 1)}
    d32 = dev.view(torch.int32)
    n_pages = int(hpages.numel())

    def fn() -> None:
        _flat_page_load[(min(programs, n_pages),)](
            descs[big], descs[8], descs[4], descs[2], descs[1], d32, didx, hpages, n_pages, PR=pr, BIG=big,
            NBIG=nbig, H8=bits[0], H4=bits[1], H2=bits[2], H1=bits[3], FW=FW, RW=row_bytes // 4, PS=ps,
            STAGES=stages, num_warps=warps)
    return fn


def _case(row_bytes: int, ps: int, tokens: int, device: str, pin: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pages = tokens // ps
    host = torch.randint(0, 256, (2 * pages, ps * row_bytes), dtype=torch.uint8, generator=g)
    host = host.pin_memory() if pin else host
    dev = torch.zeros(2 * tokens + ps, row_bytes, dtype=torch.uint8, device=device)
    hp = torch.randperm(2 * pages, generator=g)[:pages]
    dp = torch.randperm(2 * pages, generator=g)[:pages]
    didx = (dp.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    want = dev.clone()
    want[didx.to(device)] = host[hp].view(-1, row_bytes).to(device)
    return host, dev, hp.to(torch.int32).to(device), didx.to(device), want, hp, dp


def check(row_bytes: int, ps: int, tokens: int, device: str, pin: bool, **shape) -> bool:
    host, dev, hpg, didx, want, _, _ = _case(row_bytes, ps, tokens, device, pin)
    dev.fill_(0xA5)
    want[want.new_ones(want.shape[0], dtype=torch.bool).index_fill_(0, didx, False)] = 0xA5  # canaries stay
    make_load(host, dev, row_bytes, ps, hpg, didx, **shape)()
    return torch.equal(dev.cpu(), want.cpu())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true", help="byte checks only (small; TRITON_INTERPRET=1 on a CPU)")
    args = ap.parse_args()
    if args.check:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        ok = all(check(rb, ps, 4 * ps, dev, dev == "cuda", big=big, programs=2, stages=2, warps=4)
                 for rb in (656, 1152, 576) for ps in (16, 64) for big in (8, 16) if (ps * rb) % 1024 == 0)
        print(json.dumps({"bit_exact": ok}))
        return 0 if ok else 1
    require_cuda(__file__)  # (--check runs on a CPU too)
    from hicache_core import HostKVPool, LayerMap, PoolSpec
    from hicache_core.bench import _gemm_slowdown, _median_ms

    os.makedirs(args.out, exist_ok=True)
    ps, tokens, layers = 64, 4096, 61
    rows: list[dict] = []
    for row_bytes in (656, 1152, 576):
        host, dev, hpg, didx, want, hp, dp = _case(row_bytes, ps, tokens, "cuda", True)
        nbytes = tokens * row_bytes
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        lone_base = _median_ms(lambda: dst.copy_(src, non_blocking=True), args.reps, idle=True)
        burst_base = _median_ms(lambda: [dst.copy_(src, non_blocking=True) for _ in range(layers)], 5) / layers

        def record(name: str, fn, extra: dict) -> None:
            dev.zero_()
            fn()
            torch.cuda.synchronize()
            exact = torch.equal(dev, want)  # rows outside didx stay zero
            row = {"row_bytes": row_bytes, "variant": name, **extra, "bit_exact": exact}
            if exact:
                lone = _median_ms(fn, args.reps, idle=True)
                burst = _median_ms(lambda: [fn() for _ in range(layers)], max(3, args.reps // 4)) / layers
                row.update(lone_ratio=round(lone_base / lone, 3), burst_ratio=round(burst_base / burst, 3),
                           gemm_slowdown_pct=round(100 * _gemm_slowdown(lambda: [fn() for _ in range(layers)]), 1))
            rows.append(row)
            print(json.dumps(row), flush=True)

        for programs, stages, big, warps in ((4, 2, 16, 4), (4, 3, 16, 4), (4, 3, 8, 4), (4, 3, 16, 8), (8, 2, 16, 4),
                                             (8, 3, 8, 4)):
            shape = dict(programs=programs, stages=stages, big=big, warps=warps)
            try:
                record("flat-tma", make_load(host, dev, row_bytes, ps, hpg, didx, **shape), shape)
            except Exception as exc:  # noqa: BLE001 - a probe: record why a configuration does not run
                rows.append({"row_bytes": row_bytes, "variant": "flat-tma", **shape,
                             "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})
                print(json.dumps(rows[-1]), flush=True)
        spec = PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                            page_size=ps, capacity=2 * tokens, row_bytes=row_bytes, device=torch.device("cuda"))
        hbuf = host.view(1, 2 * tokens, row_bytes)
        hidx = (hp.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1).cuda()
        for programs in (0, 4):
            pool = HostKVPool(spec, "layer_first", "kernel", {"kv": [dev[:2 * tokens].view(2 * tokens, 1, row_bytes)]},
                              host_buffers={"kv": hbuf},
                              strategy_options={"programs": programs} if programs else None)
            record("hicache-kernel", lambda pool=pool: pool.load_layer(0, hidx, didx), {"programs": programs or "default"})
            del pool
        del host, dev, want
    with open(os.path.join(args.out, "tma_flat_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Can an SM-driven backup reach the link while costing a GEMM less? Cache hints and a store throttle (GPU).

Usage: ``python benchmarks/backup_hint_probe.py --out hints.json [--shapes mla,mha] [--variants LABEL,...]``.

hicache's kernel backups (8 programs x 4 warps, 32 KiB tiles) move an all-layer backup at 0.92-0.95 of memcpy and
slow a bf16 8192^3 GEMM on another stream by +35% (MLA 1152-byte rows) to +82% (MHA 2048-byte rows) on the H200;
SGLang's 2-CTA kernel costs it +21% at the same speed, and loads of the same bytes cost it nothing.  Every SM
store to host memory is posted: nothing in the kernel bounds the writes in flight but the hardware's queues, and
the working theory (docs/performance.md, "What limits them") is that those queues, full, delay the GEMM's own
memory traffic.  Each variant here changes one thing against the plugins' row kernel as shipped:

* the **cache hints** of the device reads and host writes (Triton's ``cache_modifier`` and ``eviction_policy``:
  PTX ``.cs`` / ``.cg`` / ``.wt`` stores, ``evict_first`` reads and writes), in case the host writes or the
  streamed reads hold L2 lines the GEMM needs;
* a **throttle**: ``fence`` makes every thread wait after each tile until its writes have reached the system
  (``fence.sc.sys``), so at most one tile per program is in flight; ``fence gpu`` only until the GPU's memory
  system has taken them (``fence.sc.gpu``);
* the **launch shape** (programs, warps, tile bytes), for the trade-off curve the other variants are read against;
* two floors: ``hold N programs`` keeps N programs of 4 warps busy for as long as ``base`` takes, moving nothing (what
  holding N SMs costs the GEMM, apart from any memory traffic; ``... 100us``: in launches of 100 us), and ``copy
  engine`` moves the same bytes by one pinned ``copy_`` (what the link traffic alone costs it);
* **launches of a few entries** (``N entries per launch``): the backup split into launches of N layers each, between
  which the GEMM's blocks can take the SMs back; ``... pdl``: every launch after a backup's first is a programmatic
  dependent launch (Hopper's PDL, Triton's ``launch_pdl``): in every launch but the backup's last, each program
  signals the next launch when it starts its last work item (``griddepcontrol.launch_dependents``), so the next
  launch's programs may start while this one's last tiles drain instead of after it ends, and waits for the launch
  before it at its end (``griddepcontrol.wait``: a launch's end still implies its predecessor's, as in a plain stream;
  a short launch between two lets the third begin before the first ends).  The first launch of each backup is a
  plain one, ordered after whatever ran before it on the stream; a backup in one launch is a plain call.  Hopper and
  later only (``griddepcontrol`` is sm_90 PTX).  Whether the link's idle time between launches is what a split costs
  the ratio (1-2 points in the plugins' backups, record calls 57-62).

The kernel is the plugins' ``layer_first`` row copy written out (work items layer-major, a tile of index positions
by a power-of-two column step, the same :func:`hicache_core.rowcopy_tuning.tile` shape), over one device tensor
``[entries, 2 * tokens, row]`` and one pinned host tensor ``[entries, tokens, row]``, random pages of 64 tokens.
Every variant is checked bit-exact first (the host tensor against a gather of the device rows, canary rows of the
host untouched); each row gives the ratio to a pinned memcpy of the same bytes in this run, the GEMM's slowdown
while back-to-back backups run beside it, and the time per backup.  ``base`` runs first and last: their spread is
the run's drift.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core import kernel_lib as kl  # noqa: E402
from hicache_core.bench import _gemm_slowdown, _median_ms, _Memcpy  # noqa: E402
from hicache_core.rowcopy_tuning import tile  # noqa: E402

#: Bytes per access word (int32) and words per 16-byte vector.
WORD, VEC = 4, 4


@triton.jit(do_not_specialize=["n", "n_ents"])
def HINT_BACKUP(anchor, host_idx, dev_idx, n, n_ents, dev_base, dev_ent, host_base, host_ent,
                WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr, VEC: tl.constexpr,
                LD_CM: tl.constexpr, LD_EV: tl.constexpr, ST_CM: tl.constexpr, ST_EV: tl.constexpr,
                FENCE: tl.constexpr, PDL: tl.constexpr = 0):
    """Rows ``dev_idx`` of each entry to host slots ``host_idx`` (words from ``anchor``), hints as named; ``PDL`` as
    the plugins' kernels take it (``kernel_lib.let_next_begin``, ``kernel_lib.await_previous``): 2 in a backup's
    launches but its last (signal dependents at this program's last work item), 1 in its last (wait only), 0 off."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n, TOKENS)
    for item in range(pid, n_tiles * n_ents, nprog):
        kl.let_next_begin(item, n_tiles * n_ents, nprog, PDL)
        e = item // n_tiles
        t = (item - e * n_tiles) * TOKENS + tl.arange(0, TOKENS)
        live = t < n
        h = tl.load(host_idx + t, mask=live, other=0).to(tl.int64)
        d = tl.load(dev_idx + t, mask=live, other=0).to(tl.int64)
        drow = tl.multiple_of(dev_base + e * dev_ent + d * WIDTH, VEC)
        hrow = tl.multiple_of(host_base + e * host_ent + h * WIDTH, VEC)
        for c0 in tl.static_range(0, WIDTH, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            m = live[:, None] & (c < WIDTH)[None, :]
            x = tl.load(anchor + drow[:, None] + c[None, :], mask=m, cache_modifier=LD_CM, eviction_policy=LD_EV)
            tl.store(anchor + hrow[:, None] + c[None, :], x, mask=m, cache_modifier=ST_CM, eviction_policy=ST_EV)
        if FENCE == "sys":  # once per thread (a scalar): every thread waits until its tile's writes reached the host
            tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, $1;", "=r,r", [tl.program_id(0)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:  # "gpu": the plugins' fence, until the GPU's memory system took them; "": none
            kl.tile_done(FENCE == "gpu")
    kl.await_previous(PDL)  # this launch ends only after the one before it


@triton.jit
def HOLD(out, ns):
    """Keep this program busy for ``ns`` nanoseconds of the GPU's global timer, moving no data (one word per program
    to ``out`` at the end): the GEMM cost of holding as many SMs as a backup does, without its memory traffic."""
    pid = tl.program_id(0)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                   pack=1)
    now = t0
    while now - t0 < ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                        pack=1)
    tl.store(out + pid, (now - t0).to(tl.int32))


#: Hint and launch fields of a variant, and their values in ``base`` (the plugins' backup as shipped).
BASE: dict[str, Any] = {"programs": 8, "warps": 4, "tile_bytes": 32768, "ld_cm": "", "ld_ev": "", "st_cm": "",
                        "st_ev": "", "fence": "", "kind": "rows", "launch_entries": 0, "hold_us": 0,
                        "pdl": False}
#: label -> the fields that differ from :data:`BASE`.
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "st .cs": {"st_cm": ".cs"},
    "st .cg": {"st_cm": ".cg"},
    "st .wt": {"st_cm": ".wt"},
    "st evict_first": {"st_ev": "evict_first"},
    "ld evict_first": {"ld_ev": "evict_first"},
    "ld + st evict_first": {"ld_ev": "evict_first", "st_ev": "evict_first"},
    "ld .cg + st .cs": {"ld_cm": ".cg", "st_cm": ".cs"},
    "fence": {"fence": "sys"},
    "fence 16 programs": {"fence": "sys", "programs": 16},
    "fence 32 programs 16K": {"fence": "sys", "programs": 32, "tile_bytes": 16384},
    "fence gpu": {"fence": "gpu"},
    "fence gpu 16 programs": {"fence": "gpu", "programs": 16},
    # the fence with fewer programs and larger tiles: toward the kernels' target of <= 4 programs at <= 5% GEMM
    "fence gpu 4 programs": {"fence": "gpu", "programs": 4},
    "fence gpu 4 programs 64K": {"fence": "gpu", "programs": 4, "tile_bytes": 65536},
    "fence gpu 2 programs 16 warps 64K": {"fence": "gpu", "programs": 2, "warps": 16, "tile_bytes": 65536},
    "fence gpu 8 programs 64K": {"fence": "gpu", "tile_bytes": 65536},
    "fence gpu 4 programs 8 warps 64K": {"fence": "gpu", "programs": 4, "warps": 8, "tile_bytes": 65536},
    "fence gpu 4 programs 16 warps 128K": {"fence": "gpu", "programs": 4, "warps": 16, "tile_bytes": 131072},
    "fence gpu 2 programs 32 warps 128K": {"fence": "gpu", "programs": 2, "warps": 32, "tile_bytes": 131072},
    "16K tiles": {"tile_bytes": 16384},
    "4 programs": {"programs": 4},
    "2 programs": {"programs": 2},
    "2 programs 16 warps 64K": {"programs": 2, "warps": 16, "tile_bytes": 65536},
    # floors: N programs busy for base's time with no memory traffic; the same bytes by the copy engine
    "hold 8 programs": {"kind": "hold"},
    "hold 4 programs": {"kind": "hold", "programs": 4},
    "hold 2 programs": {"kind": "hold", "programs": 2},
    "hold 1 program": {"kind": "hold", "programs": 1},
    "copy engine": {"kind": "memcpy"},
    # held in launches of 100 us (a GEMM's blocks get the SMs back between them), and backups split into launches
    # of a few entries each (8: ~0.7 ms per MLA launch; 1: one layer per launch, ~90 us)
    "hold 8 programs 100us": {"kind": "hold", "hold_us": 100},
    "hold 2 programs 100us": {"kind": "hold", "programs": 2, "hold_us": 100},
    "hold 8 programs 1000us": {"kind": "hold", "hold_us": 1000},
    "fence gpu 1 program 32 warps 128K": {"fence": "gpu", "programs": 1, "warps": 32, "tile_bytes": 131072},
    "8 entries per launch": {"launch_entries": 8},
    "1 entry per launch": {"launch_entries": 1},
    "fence gpu 8 entries per launch": {"fence": "gpu", "launch_entries": 8},
    "fence gpu 1 entry per launch": {"fence": "gpu", "launch_entries": 1},
    "fence gpu 2 programs 32 warps 128K 8 entries per launch": {"fence": "gpu", "programs": 2, "warps": 32,
                                                                "tile_bytes": 131072, "launch_entries": 8},
    # the same launches overlapping at their ends (programmatic dependent launch), and launches of 4 entries so
    "fence gpu 8 entries per launch pdl": {"fence": "gpu", "launch_entries": 8, "pdl": True},
    "fence gpu 4 entries per launch": {"fence": "gpu", "launch_entries": 4},
    "fence gpu 4 entries per launch pdl": {"fence": "gpu", "launch_entries": 4, "pdl": True},
    "base again": {},
}
#: shape -> (entries, row bytes): MLA 61 x 576 bf16 (one entry per layer), MHA 80 x 8 x 128 bf16 (K and V entries).
SHAPES: dict[str, tuple[int, int]] = {"mla": (61, 1152), "mha": (160, 2048)}


def variant(label: str) -> dict[str, Any]:
    """:data:`BASE` with ``label``'s fields (a ``KeyError`` naming the label when it is unknown)."""
    return {**BASE, **VARIANTS[label]}


class Workload:
    """One shape's buffers: device rows ``[entries, 2 * tokens, row]``, a pinned host ``[entries, tokens + pad,
    row]`` whose last ``pad`` slots are canaries, random source rows and host slots by pages of ``page_size``
    (``entries``: fewer than the shape's, for a small check)."""

    def __init__(self, shape: str, tokens: int, page_size: int, device: str = "cuda", seed: int = 0,
                 entries: int | None = None) -> None:
        row = SHAPES[shape][1]
        entries = SHAPES[shape][0] if entries is None else entries
        self.words, self.entries, self.tokens = row // WORD, entries, tokens
        gen = torch.Generator().manual_seed(seed)
        pad = page_size
        self.dev = torch.randint(-2**31, 2**31 - 1, (entries, 2 * tokens, self.words), generator=gen,
                                 dtype=torch.int32).to(device)
        self.host = torch.empty((entries, tokens + pad, self.words), dtype=torch.int32,
                                pin_memory=device != "cpu")
        pages = torch.arange(page_size)
        hp = torch.randperm(tokens // page_size, generator=gen)
        dp = torch.randperm(2 * tokens // page_size, generator=gen)[: tokens // page_size]
        self.h = (hp[:, None] * page_size + pages).reshape(-1).to(device)
        self.s = (dp[:, None] * page_size + pages).reshape(-1).to(device)
        self.nbytes = entries * tokens * row

    def launch(self, v: dict[str, Any], hold_ns: int = 0) -> None:
        """One all-entry backup by :func:`HINT_BACKUP` with variant ``v``'s fields; for a floor, ``v["programs"]``
        programs of :func:`HOLD` busy for ``hold_ns`` (kind ``hold``) or one pinned ``copy_`` of the same bytes
        (kind ``memcpy``; flat buffers made on first use)."""
        if v["kind"] == "hold":
            if not hasattr(self, "held"):
                self.held = torch.zeros(64, dtype=torch.int32, device=self.dev.device)
            chunk = v["hold_us"] * 1000 or hold_ns
            for _ in range(max(1, round(hold_ns / chunk)) if chunk else 1):
                HOLD[(v["programs"],)](self.held, chunk, num_warps=v["warps"])
            return
        if v["kind"] == "memcpy":
            if not hasattr(self, "flat"):
                self.flat = (torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.dev.is_cuda),
                             torch.empty(self.nbytes, dtype=torch.uint8, device=self.dev.device))
            self.flat[0].copy_(self.flat[1], non_blocking=True)
            return
        block, _, tokens = tile(self.words, self.words, WORD, v["tile_bytes"])
        anchor = self.dev
        host_base = (self.host.data_ptr() - anchor.data_ptr()) // WORD
        step = v["launch_entries"] or self.entries
        for e0 in range(0, self.entries, step):  # one launch per `step` entries (all of them by default)
            last = e0 + step >= self.entries  # a backup's last launch waits but never signals; its first is plain
            pdl = dict(PDL=1 if last else 2, launch_pdl=e0 > 0) if v["pdl"] and step < self.entries else {}
            HINT_BACKUP[(v["programs"],)](
                anchor, self.h, self.s, self.h.numel(), min(step, self.entries - e0), e0 * self.dev.stride(0),
                self.dev.stride(0), host_base + e0 * self.host.stride(0), self.host.stride(0), WIDTH=self.words,
                BLOCK=block, TOKENS=tokens, VEC=VEC, LD_CM=v["ld_cm"], LD_EV=v["ld_ev"], ST_CM=v["st_cm"],
                ST_EV=v["st_ev"], FENCE=v["fence"], num_warps=v["warps"], **pdl)

    def check(self, v: dict[str, Any]) -> None:
        """Backup from a zeroed host with canary slots: an ``AssertionError`` unless every slot holds its source row
        and every canary is untouched."""
        self.host.fill_(0)
        self.host[:, self.tokens:] = 0x5A5A5A5A
        self.launch(v)
        if self.dev.is_cuda:
            torch.cuda.synchronize()
        want = self.dev[:, self.s].cpu()
        got = self.host[:, self.h.cpu()]
        assert torch.equal(got, want), f"host slots differ from their source rows ({int((got != want).sum())} words)"
        assert bool((self.host[:, self.tokens:] == 0x5A5A5A5A).all()), "a canary slot was written"


def measure(shape: str, label: str, wl: Workload, memcpy: _Memcpy, reps: int, gemm: bool,
            base_ms: float = 0.0) -> dict[str, Any]:
    """One variant's row, after its bit-exact check (a floor moves no rows to check: ``hold`` keeps its programs
    busy for ``base_ms``, and its row has no ratio)."""
    v = variant(label)
    hold_ns = int(base_ms * 1e6)
    if v["kind"] == "rows":
        wl.check(v)
    ms = _median_ms(lambda: wl.launch(v, hold_ns), reps)
    ratio = None if v["kind"] == "hold" else wl.nbytes / ms / 1e6 / memcpy.gbps(wl.nbytes, True, reps)
    row: dict[str, Any] = {"shape": shape, "variant": label, **v, "ms": ms, "ratio": ratio}
    if gemm:
        row["gemm"] = _gemm_slowdown(lambda: wl.launch(v, hold_ns))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="backup_hints.json")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-gemm", dest="gemm", action="store_false", help="skip the GEMM beside the backups")
    args = ap.parse_args()
    labels = [v for v in args.variants.split(",") if v]
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [x for x in labels if x not in VARIANTS] + [x for x in shapes if x not in SHAPES]
    if bad:
        ap.error(f"unknown variant(s) or shape(s) {', '.join(map(repr, bad))}; variants: {', '.join(VARIANTS)}; "
                 f"shapes: {', '.join(SHAPES)}")
    require_cuda(__file__)
    memcpy, rows, corrupt = _Memcpy(), [], 0
    for shape in shapes:
        wl = Workload(shape, args.tokens, args.page_size)
        base_ms = 0.0
        for label in labels:
            if variant(label)["kind"] == "hold" and not base_ms:  # hold for as long as base takes
                wl.check(BASE)
                base_ms = _median_ms(functools.partial(wl.launch, BASE), args.reps)
            try:
                row = measure(shape, label, wl, memcpy, args.reps, args.gemm, base_ms)
                if label == "base":
                    base_ms = row["ms"]
            except AssertionError as exc:
                corrupt += 1
                print(json.dumps({"shape": shape, "variant": label, "CORRUPT": str(exc)}), flush=True)
                continue
            rows.append(row)
            print(json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}), flush=True)
            with open(args.out, "w") as f:  # rewritten after every row: a killed run keeps its results
                json.dump(rows, f, indent=1)
        del wl
        torch.cuda.empty_cache()
    return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main())

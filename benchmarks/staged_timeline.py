"""Where a staged layer-major backup's time goes (GPU): the route, its parts, and its copies alone.

Usage: ``python benchmarks/staged_timeline.py [mla] [mha]``.  MLA 61 x 576 bf16 and MHA 80 x 8 x 128
bf16, 4096 tokens, page 64, random pages, separately allocated device layers,
``layer_first`` host layout, ``direct`` with ``staging="auto"`` (plain runs) and a
staged route built as ``staging="always"`` builds it (packed page images, one pitched
copy per page).  Prints, as ratios to a pinned ``copy_`` of the same bytes: the staged
route; the route with its relayout skipped; its copies alone from one staging buffer
(of zeros, of random bytes, and as row descriptors); and event traces of the pipeline
(``route``: as it runs; ``d2d``: a plain device copy in place of the relayout; ``prefilled``:
every chunk relaid first, then the copies; ``plain``: the pitched copies sent as row descriptors).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ce_probe import _event_ms  # noqa: E402
from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core import HostKVPool, LayerMap, PoolSpec  # noqa: E402


REPS = 10


def trace(st, copier, pages: int, ps: int, d: torch.Tensor, variant: str = "route") -> None:
    """The staged pipeline replayed with events around every relayout and copy (ms from the start).

    ``variant``: ``route`` (as the route runs), ``d2d`` (a plain device copy of the same bytes in
    place of the relayout), ``prefilled`` (every chunk relaid first, then the copies alone),
    ``plain`` (the route with its pitched copies sent as row descriptors).
    """
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    buf = torch.empty(2 * st.chunk_bytes, dtype=torch.uint8, device="cuda")
    other = torch.empty(st.chunk_bytes, dtype=torch.uint8, device="cuda")
    halves = (buf[: st.chunk_bytes], buf[st.chunk_bytes :])
    ev = lambda s: s.record_event(torch.cuda.Event(enable_timing=True))  # noqa: E731
    copier._pitched_refused = variant == "plain"
    for _ in range(2):
        torch.cuda.synchronize()
        if variant == "prefilled":
            for k, p0 in enumerate(range(0, pages, st.chunk_pages)):
                st._relayout(halves[k % 2], d[p0 * ps : min(pages, p0 + st.chunk_pages) * ps],
                             min(pages, p0 + st.chunk_pages) - p0, to_image=True)
            torch.cuda.synchronize()
        t0 = ev(main)
        side.wait_stream(main)
        free = [None, None]
        marks = []
        for k, p0 in enumerate(range(0, pages, st.chunk_pages)):
            p1 = min(pages, p0 + st.chunk_pages)
            half = halves[k % 2]
            with torch.cuda.stream(side):
                if free[k % 2] is not None:
                    side.wait_event(free[k % 2])
                r0 = ev(side)
                if variant == "d2d":
                    half.copy_(other)
                elif variant != "prefilled":
                    st._relayout(half, d[p0 * ps : p1 * ps], p1 - p0, to_image=True)
                r1 = ev(side)
            main.wait_event(r1)
            c0 = ev(main)
            st._copy(copier, p0, p1, half.data_ptr(), main.cuda_stream, to_host=True)
            c1 = ev(main)
            free[k % 2] = c1
            marks.append((r0, r1, c0, c1))
        main.wait_stream(side)
        torch.cuda.synchronize()
    copier._pitched_refused = False
    total = t0.elapsed_time(marks[-1][3])
    print(f"    trace {variant}: {total:.2f} ms: " + "; ".join(
        "R %.2f-%.2f C %.2f-%.2f" % tuple(t0.elapsed_time(e) for e in m) for m in marks), flush=True)


def freshness(st, copier, pages: int, ps: int, d: torch.Tensor, base_ms: float) -> None:
    """One chunk's copies alone, timed after different ways of preparing its staging image: written
    by torch just before, relaid by the route's kernel just before, and either one followed by an
    unrelated 256 MiB device write (which evicts the image from L2) before the copies start."""
    buf = torch.empty(st.chunk_bytes, dtype=torch.uint8, device="cuda")
    junk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    noise = torch.randint(0, 255, buf.shape, dtype=torch.uint8, device="cuda")
    p1 = min(pages, st.chunk_pages)
    share = (p1 * ps * 1.0) / (pages * ps)  # the chunk's share of the memcpy baseline's bytes
    for prep in ("torch", "relayout", "torch+evict", "relayout+evict", "relayout+sleep"):
        times = []
        for _ in range(REPS):
            if prep.startswith("torch"):
                buf.copy_(noise)
            else:
                st._relayout(buf, d[: p1 * ps], p1, to_image=True)
            if prep.endswith("evict"):
                junk.fill_(1)
            torch.cuda.synchronize()
            if prep.endswith("sleep"):
                torch.cuda._sleep(20_000_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            st._copy(copier, 0, p1, buf.data_ptr(), None, to_host=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        ms = times[len(times) // 2]
        print(f"    one chunk ({p1} pages) copied after {prep}: ratio {base_ms * share / ms:.3f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kinds", nargs="*", metavar="mla|mha", help="default: both")
    args = ap.parse_args(argv)
    if bad := [k for k in args.kinds if k not in ("mla", "mha")]:
        ap.error(f"{', '.join(bad)}: choose from mla, mha")
    require_cuda(__file__)
    for kind in args.kinds or ["mla", "mha"]:
        run(kind)


def run(kind: str) -> None:
    T, ps = 4096, 64
    if kind == "mla":
        L = 61
        spec = PoolSpec.mla(layer_map=LayerMap.unsharded(L), kv_lora_rank=512, qk_rope_head_dim=64,
                            dtype=torch.bfloat16, page_size=ps, capacity=T, device=torch.device("cuda"))
        dev = {"kv": [torch.randn(2 * T, 1, 576, device="cuda").to(torch.bfloat16) for _ in range(L)]}
        nbytes = L * T * 1152
    else:
        L = 80
        spec = PoolSpec.mha(layer_map=LayerMap.unsharded(L), head_num=8, head_dim=128, dtype=torch.bfloat16,
                            page_size=ps, capacity=T, device=torch.device("cuda"))
        dev = {c: [torch.randn(2 * T, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(L)] for c in ("k", "v")}
        nbytes = L * T * 4096
    print(kind, flush=True)
    gen = torch.Generator().manual_seed(0)
    h = (torch.randperm(T // ps, generator=gen).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    d = (torch.randperm(2 * T // ps, generator=gen)[: T // ps].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1).cuda()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    base = _event_ms(lambda: dst.copy_(src, non_blocking=True), REPS)[0]
    src.copy_(torch.randint(0, 255, src.shape, dtype=torch.uint8, device="cuda"))
    base_random = _event_ms(lambda: dst.copy_(src, non_blocking=True), REPS)[0]
    print(f"memcpy of never-written memory {nbytes / base / 1e6:.1f} GB/s, of random bytes {nbytes / base_random / 1e6:.1f} GB/s",
          flush=True)
    for budget in (512 << 20,):
        for staging in ("auto", "always"):
            pool = HostKVPool(spec, "layer_first", "direct", dev, strategy="core.direct",
                              strategy_options={"staging": staging, "staging_bytes": budget})
            for _ in range(3):
                pool.backup_all_layers(h, d)
            ms, host = _event_ms(lambda: pool.backup_all_layers(h, d), REPS)
            line = f"budget {budget >> 20} MiB staging={staging}: ratio {base / ms:.3f} host {host:.0f} us"
            sub = pool.strategy.submission(pool.binding, h, d, None)
            st = sub.staged
            if st is not None:
                buf = torch.empty(st.chunk_bytes, dtype=torch.uint8, device="cuda")
                rows = d[: st.chunk_pages * ps]
                rms, rhost = _event_ms(lambda: st._relayout(buf, rows, st.chunk_pages, to_image=True), REPS)
                line += (f" | {st.chunks} chunks of {st.chunk_pages} pages, {st.count} ops, relayout {rms * 1e3:.0f} us "
                         f"({st.chunk_bytes / rms / 1e6:.0f} GB/s) host {rhost:.0f} us, relayout={st.relayout}")
            print(line, flush=True)
            if st is not None:
                # the same route with its relayout skipped (copies and stream ordering only)
                real = st._relayout
                st._relayout = lambda *a, **k: None  # type: ignore[method-assign]
                ms2, host2 = _event_ms(lambda: pool.backup_all_layers(h, d), REPS)
                st._relayout = real  # type: ignore[method-assign]
                # copies alone, one chunk at a time on the caller's stream
                copier = pool.binding.scratch["direct.copier"]
                buf = torch.empty(st.chunk_bytes, dtype=torch.uint8, device="cuda")
                def copies() -> None:
                    for p0 in range(0, T // ps, st.chunk_pages):
                        st._copy(copier, p0, min(T // ps, p0 + st.chunk_pages), buf.data_ptr(), None, to_host=True)
                ms3, host3 = _event_ms(copies, REPS)
                freshness(st, copier, T // ps, ps, d, base)
                for variant in ("route", "d2d", "prefilled", "plain"):
                    trace(st, copier, T // ps, ps, d, variant)
                # the copies alone from a staging image of zeros, then of random bytes, then (random) as rows
                for fill in ("zeros", "random", "random-rows"):
                    if fill == "zeros":
                        buf.zero_()
                    else:
                        buf.copy_(torch.randint(0, 255, buf.shape, dtype=torch.uint8, device="cuda"))
                    copier._pitched_refused = fill == "random-rows"
                    ms4 = _event_ms(copies, REPS)[0]
                    copier._pitched_refused = False
                    print(f"    copies alone, staging of {fill}: ratio {base / ms4:.3f}", flush=True)
                print(f"    no relayout: ratio {base / ms2:.3f} host {host2:.0f} us; copies alone: ratio {base / ms3:.3f} "
                      f"host {host3:.0f} us", flush=True)


if __name__ == "__main__":
    main()

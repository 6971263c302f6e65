"""Host (CPU) time per ``load_layer`` / ``backup_all_layers`` call, and where it goes (H200).

Usage (GPU): ``python benchmarks/host_time.py [--out DIR] [--shapes mla61x576-bf16,mla61x656-fp8] [--layouts ...]``.
For every strategy that resolves for each shape (default MLA 61 x 576 bf16; 4096 tokens, 64-token pages, indices on
the GPU) it reports the median wall time of one call issued on an idle stream (``sync``: synchronise, time one call),
the mean per call of a forward-pass style burst (``burst``: one ``load_layer`` per layer back to back, then
synchronise), one call with new index tensors (``fresh``: what a batch's first call pays), and all-layer backups
with the same and with new index tensors, with the replays those served (``backup_all_replays``: calls the pool's
recorded launches took, of ``backup_all_calls``; ``None`` where the strategy keeps none), with Triton's
compiled-handle shortcut on and off (:func:`hicache_core.launch.set_fast_launch`).  cProfiles of each strategy's
burst, of one load and of one all-layer backup with new index tensors go to ``host_profile.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from typing import Any

import torch

from hicache_core.bench import SHAPES, _device_buffers, _indices, _targets
from hicache_core.launch import set_fast_launch
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def _sync_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _fresh_us(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, layer: int, reps: int) -> float:
    """Median host time of a ``load_layer`` whose index tensors are new objects (same values): what the
    first per-layer call of every batch pays (plans and index copies are memoised per tensor object)."""
    pairs = [(h.clone(), d.clone()) for _ in range(reps)]  # all alive: a freed tensor's id could hit a memo
    it = iter(pairs)
    return _sync_us(lambda: pool.load_layer(layer, *next(it)), reps)


def _replay_hits(pool: HostKVPool) -> int | None:
    """Calls the pool's recorded launches served so far (``None``: the strategy keeps no replays)."""
    scratch = pool.binding.scratch.get(pool.strategy_name)
    replays = getattr(scratch, "replays", None)
    return None if replays is None else int(replays.hits)


def _backup_fresh_us(pool: HostKVPool, h: torch.Tensor, s: torch.Tensor, reps: int) -> float:
    """Median host time of an all-layer backup whose index tensors are new objects (same values)."""
    pairs = [(h.clone(), s.clone()) for _ in range(reps)]  # all alive, as in _fresh_us
    it = iter(pairs)
    return _sync_us(lambda: pool.backup_all_layers(*next(it)), reps)


def _burst_us(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, rounds: int) -> float:
    layers = pool.spec.layer_map.device_layers
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in layers:
            pool.load_layer(layer, h, d)
        per_call.append((time.perf_counter() - t0) * 1e6 / len(layers))
    torch.cuda.synchronize()
    return statistics.median(per_call)


def _profile(fn, out: str, title: str, sort: str, lines: int) -> None:
    """cProfile one run of ``fn``; append the top ``lines`` by ``sort`` to ``<out>/host_profile.txt``."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(lines)
    with open(os.path.join(out, "host_profile.txt"), "a") as f:
        f.write(f"===== {title} =====\n{buf.getvalue()}\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--backends", default="kernel,direct")
    ap.add_argument("--shapes", default="mla61x576-bf16", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--layouts", default=None, help="comma-separated layouts (default: every one that resolves)")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    unknown = [x for x in shapes if x not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    require_cuda(__file__)
    os.makedirs(args.out, exist_ok=True)
    reg = create_registry()
    rows = []
    for shape in shapes:
        rows += _shape_rows(args, reg, shape)
    with open(os.path.join(args.out, "host_time.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "tokens": args.tokens, "page_size": args.page_size,
                   "rows": rows}, f, indent=1)
    return 0


def _shape_rows(args: argparse.Namespace, reg: Any, shape: str) -> list[dict[str, Any]]:
    """Every resolving strategy's rows for one shape (fast launch on and off)."""
    spec = SHAPES[shape](args.tokens, args.page_size, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * args.tokens + args.page_size)
    h, s, d = _indices(spec, torch.Generator().manual_seed(0))
    rows = []
    layouts = args.layouts.split(",") if args.layouts else None
    for layout, backend, name in _targets(reg, spec, layouts, args.backends.split(",")):
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pool = HostKVPool(spec, layout, backend, dev, host_buffers=host, strategy=name, registry=reg,
                          validate="shapes")
        layer0 = spec.layer_map.device_layers[0]
        for fast in ("1", "0"):
            set_fast_launch(fast == "1")
            pool.backup_all_layers(h, s)
            pool.load_layer(layer0, h, d)  # warm both specialisations
            row: dict[str, Any] = {
                "shape": shape, "strategy": name, "layout": layout, "backend": backend, "fast_launch": fast == "1",
                "load_layer_sync_us": _sync_us(lambda: pool.load_layer(layer0, h, d), args.reps),
                "load_layer_burst_us": _burst_us(pool, h, d, max(3, args.reps // 30)),
                "load_layer_fresh_us": _fresh_us(pool, h, d, layer0, max(5, args.reps // 10)),
            }
            calls = max(5, args.reps // 10)
            hits = _replay_hits(pool)
            row["backup_all_sync_us"] = _sync_us(lambda: pool.backup_all_layers(h, s), calls)
            after = _replay_hits(pool)
            row["backup_all_calls"] = calls
            row["backup_all_replays"] = None if hits is None or after is None else after - hits
            row["backup_all_fresh_us"] = _backup_fresh_us(pool, h, s, calls)
            rows.append(row)
            print(f"{shape} {name:28s} fast={fast} load sync {row['load_layer_sync_us']:7.1f} us  "
                  f"burst {row['load_layer_burst_us']:7.1f} us/layer  "
                  f"new indices {row['load_layer_fresh_us']:7.1f} us  "
                  f"backup_all {row['backup_all_sync_us']:7.1f} us ({row['backup_all_replays']} of {calls} replayed), "
                  f"new indices {row['backup_all_fresh_us']:7.1f} us", flush=True)
        set_fast_launch(True)
        hf, df = h.clone(), d.clone()
        torch.cuda.synchronize()
        _profile(lambda: pool.load_layer(layer0, hf, df), args.out,
                 f"{shape} {name}: one load_layer with new index tensors", "cumtime", 30)
        _profile(lambda: _burst_us(pool, h, d, 5), args.out, f"{shape} {name}", "tottime", 25)
        hb, sb = h.clone(), s.clone()
        torch.cuda.synchronize()
        _profile(lambda: pool.backup_all_layers(hb, sb), args.out,
                 f"{shape} {name}: one backup_all_layers with new index tensors", "cumtime", 30)
        torch.cuda.synchronize()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

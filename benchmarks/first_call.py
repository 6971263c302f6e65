"""Where a batch's first ``direct`` call spends its host time: phases and a profile.

Usage (GPU): ``python benchmarks/first_call.py [--shape mla61x576-bf16] [--layout layer_first] [--reps 200]
[--out DIR]``.  A ``direct`` pool (4096 tokens, page 64, random pages, separately allocated device layers) takes
``load_layer`` calls with new index tensors every call (same values, new objects), with the indices on the CPU
and on the GPU, each on an idle stream.  Per call it times the phases (the pool's index check, the plan cache's
lookup and the plan's construction, the submission's build, the rest of the call: the runtime submission and
bookkeeping) with ``perf_counter``, prints their medians, then runs the same calls under ``cProfile`` and prints
the functions by own time.  Every pool is checked bit-exact first (``hicache_core.bench``'s check).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch

from hicache_core.backends.direct import DirectStrategy
from hicache_core.bench import _check, _workload
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def _phases(pool: HostKVPool, layer: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Median microseconds per phase over ``pairs`` (one first call each)."""
    strategy = pool.strategy
    assert isinstance(strategy, DirectStrategy)
    plans, copier = pool.binding.scratch["direct.plans"], pool.binding.scratch["direct.copier"]
    out: dict[str, list[float]] = {k: [] for k in ("check", "plan", "submission", "submit", "whole call")}
    for i, (h, d) in enumerate(pairs):
        torch.cuda.synchronize()
        if i % 2:  # the whole call as the pool makes it
            t0 = time.perf_counter()
            pool.load_layer(layer, h, d)
            out["whole call"].append((time.perf_counter() - t0) * 1e6)
            continue
        t0 = time.perf_counter()
        pool._check(h, d, to_host=False)
        t1 = time.perf_counter()
        plan = plans.get(h, d, copier.stream())
        t2 = time.perf_counter()
        plan.submission(layer)
        t3 = time.perf_counter()
        strategy.transfer(pool.binding, h, d, layer, to_host=False)  # the plan is memoised: the call's rest
        t4 = time.perf_counter()
        pool.binding.checked = None  # as the pool's call ends
        for k, a, b in (("check", t0, t1), ("plan", t1, t2), ("submission", t2, t3), ("submit", t3, t4)):
            out[k].append((b - a) * 1e6)
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mla61x576-bf16")
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None, help="also write the profiles here")
    args = ap.parse_args()
    require_cuda(__file__)
    reg = create_registry()
    spec, dev, h, s, d = _workload(args.shape)
    layer = spec.layer_map.device_layers[0]
    host = allocate_host_buffers(reg.layout(args.layout).plan(spec), pin_memory=True)
    pool = HostKVPool(spec, args.layout, "direct", dev, host_buffers=host, registry=reg)
    _check(pool, dev, h, s, d)
    for where in ("cpu", "cuda"):
        hh, dd = h.to(where), d.to(where)
        pairs = [(hh.clone(), dd.clone()) for _ in range(args.reps)]  # all alive: a freed id could hit a memo
        phases = _phases(pool, layer, pairs)
        print(f"{args.shape} {args.layout} indices on {where}: " + ", ".join(f"{k} {v:.1f} us" for k, v in phases.items()),
              flush=True)
        pairs = [(hh.clone(), dd.clone()) for _ in range(args.reps)]
        prof = cProfile.Profile()
        for a, b in pairs:
            torch.cuda.synchronize()
            prof.enable()
            pool.load_layer(layer, a, b)
            prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue(), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            prof.dump_stats(os.path.join(args.out, f"first_call-{args.shape}-{args.layout}-{where}.prof"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

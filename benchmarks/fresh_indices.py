"""Host time of a batch's first call: ``load_layer`` and ``backup_all_layers`` with new index tensors.

Usage (GPU): ``python benchmarks/fresh_indices.py [--out DIR] [--label NAME]``.  An engine hands every
batch new index tensors, so the first call of each batch validates them and builds its copy plan
(later per-layer calls of the batch hit the memo).  For ``direct`` and ``auto`` pools (MLA 61 x 576
bf16 and MHA 80 x 8 x 128 bf16, 4096 tokens, page 64, random pages, separately allocated device
layers) this times one call with new index tensors (same values, new objects) issued on an idle
stream, with the indices on the CPU and on the GPU, median of ``--reps``.  Every pool is checked
bit-exact first (``hicache_core.bench``'s check).

``--ab DIR`` compares this code with an older tree's index checks and plan helpers in the same
process, call by call (``DIR/hicache_core/validate.py`` and ``.../backends/plans.py``, or ``plans_plan.py``
where that tree has it, loaded beside the current package; their ``check_indices``, ``coalesce``, ``_page_runs``
and ``Plan`` swapped in for the "old" calls, where the current ``Plan`` and ``PlanCache`` look them up; the older
``Plan`` runs its own module's helpers and the current package's everything else, so an older ``plans_plan.py``
brings its ``Plan`` alone): host time per call on these machines drifts by up to 2x over seconds, so two processes
run one after the other do not compare.  Results: ``<out>/fresh_indices-<label>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from types import ModuleType

import torch

import hicache_core.pool as pool_mod
from hicache_core.backends import plans_cache, plans_plan
from hicache_core.bench import _check, _workload
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def _load_beside(path: str, name: str) -> ModuleType:
    """``path`` as module ``name`` inside the current package (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class _Versions:
    """Swaps an older tree's index checks and plan helpers in and out (``--ab``)."""

    def __init__(self, old_tree: str | None) -> None:
        self.new = {"check": pool_mod.check_indices, "coalesce": plans_plan.coalesce,
                    "page_runs": plans_plan._page_runs, "within": plans_plan._within, "plan": plans_plan.Plan}
        self.old = None
        if old_tree:
            v = _load_beside(os.path.join(old_tree, "hicache_core", "validate.py"), "hicache_core._old_validate")
            backends = os.path.join(old_tree, "hicache_core", "backends")
            plan_file = "plans_plan.py" if os.path.exists(os.path.join(backends, "plans_plan.py")) else "plans.py"
            p = _load_beside(os.path.join(backends, plan_file), "hicache_core.backends._old_plans")
            old_runs = p._page_runs
            # an older check may return nothing (no facts for the plan) and an older _page_runs take no facts
            self.old = {"check": v.check_indices, "coalesce": p.coalesce,
                        "page_runs": lambda h, d, ps, facts=None: old_runs(h, d, ps),
                        "within": lambda t, n: not (int(t.min()) < 0 or int(t.max()) >= n),  # the old inline check
                        "plan": p.Plan}

    def use(self, which: str) -> None:
        fns = self.new if which == "new" else self.old
        assert fns is not None
        pool_mod.check_indices = fns["check"]
        # where the current code looks them up: Plan its helpers in plans_plan, PlanCache the Plan class in plans_cache
        plans_plan.coalesce, plans_plan._page_runs = fns["coalesce"], fns["page_runs"]
        plans_plan._within = fns["within"]
        plans_cache.Plan = fns["plan"]


def _fresh_us(call, h: torch.Tensor, d: torch.Tensor, reps: int, versions: _Versions) -> dict[str, float]:
    labels = ["new", "old"] if versions.old is not None else ["new"]
    pairs = [(h.clone(), d.clone()) for _ in range(reps * len(labels))]  # all alive: a freed id could hit a memo
    times: dict[str, list[float]] = {k: [] for k in labels}
    for i, (hi, di) in enumerate(pairs):
        which = labels[i % len(labels)]
        versions.use(which)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(hi, di)
        times[which].append((time.perf_counter() - t0) * 1e6)
    versions.use("new")
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--label", default="current")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--ab", default=None, help="an older source tree to compare with, call by call")
    args = ap.parse_args()
    require_cuda(__file__)
    versions = _Versions(args.ab)
    os.makedirs(args.out, exist_ok=True)
    reg = create_registry()
    rows = []
    for shape in ("mla61x576-bf16", "mha80x8x128-bf16"):
        spec, dev, h, s, d = _workload(shape)
        layer = spec.layer_map.device_layers[0]
        for layout in ("layer_first", "page_first_direct"):
            for backend in ("direct", "auto"):
                host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
                pool = HostKVPool(spec, layout, backend, dev, host_buffers=host, registry=reg)
                _check(pool, dev, h, s, d)
                for where in ("cpu", "cuda"):
                    hh, ss, dd = (t.to(where) for t in (h, s, d))
                    load = _fresh_us(lambda a, b: pool.load_layer(layer, a, b), hh, dd, args.reps, versions)
                    backup = _fresh_us(pool.backup_all_layers, hh, ss, args.reps, versions)
                    for which in load:
                        row = {"label": args.label if which == "new" else f"{args.label}:old", "shape": shape,
                               "layout": layout, "io_backend": backend, "indices": where,
                               "load_layer_us": load[which], "backup_all_layers_us": backup[which]}
                        rows.append(row)
                        print(f"{row['label']:12s} {shape:18s} {layout:18s} {backend:6s} {where:4s} new indices: "
                              f"load_layer {row['load_layer_us']:7.1f} us  backup_all_layers "
                              f"{row['backup_all_layers_us']:7.1f} us", flush=True)
                del pool, host
    with open(os.path.join(args.out, f"fresh_indices-{args.label}.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A/B of one module-level setting of hicache on ``hicache bench`` rows (load bursts and lone loads).

Usage (GPU): ``python benchmarks/knob_ab.py --out FILE.json --knob hicache_core.backends.memcpy:TIGHT_GAP_US
--values 20,50 [--rounds 3] [--shapes mla61x656-fp8,mla61x576-bf16] [--layouts layer_first,page_first_direct]
[--backends direct,auto]``.

For each round and each value of the setting in turn (the order alternates between rounds, so the host's
drift over seconds falls on both), runs :func:`hicache_core.bench.run_bench` (4096 tokens, page 64,
``load_layer`` and ``load_burst``), every pool checked bit-exact first, and counts per row how many copy-engine
submissions started with small calls (split) and how many went in the fewest calls.  One JSON line per row on
stdout, then a summary per cell: the median ratio and host time over the rounds, per value.  The setting must be
one the library reads when it is used, not one copied at import.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core import bench  # noqa: E402
from hicache_core.backends import memcpy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--knob", required=True, help="MODULE:NAME of the setting, e.g. hicache_core.backends.memcpy:TIGHT_GAP_US")
    ap.add_argument("--values", required=True, help="comma-separated numbers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="mla61x656-fp8,mla61x576-bf16")
    ap.add_argument("--layouts", default="layer_first,page_first_direct")
    ap.add_argument("--backends", default="direct,auto")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    require_cuda(__file__)
    module_name, _, name = args.knob.partition(":")
    module = importlib.import_module(module_name)
    if not name or not hasattr(module, name):
        ap.error(f"--knob {args.knob}: no setting {name!r} in {module_name}")

    split = {True: 0, False: 0}
    real_eager = memcpy.QueueClock.eager

    def eager(self: memcpy.QueueClock, stream: int, cost_us: float, burstable: bool = True) -> bool:
        out = real_eager(self, stream, cost_us, burstable)
        split[out] += 1
        return out
    memcpy.QueueClock.eager = eager  # type: ignore[method-assign]

    rows: list[dict[str, Any]] = []
    value = [0.0]

    def sink(row: bench.BenchRow) -> None:
        r = asdict(row)
        r.update(knob=args.knob, value=value[0], split_calls=split[True], whole_calls=split[False])
        split[True] = split[False] = 0
        rows.append(r)
        print(json.dumps({k: r[k] for k in ("value", "shape", "layout", "io_backend", "variant", "op", "ratio",
                                            "host_us", "split_calls", "whole_calls", "served_by")}), flush=True)

    values = [float(v) for v in args.values.split(",")]
    reference = bench.timing._Memcpy()  # one baseline for every value, pool and round: their ratios compare directly
    for rnd in range(args.rounds):
        for v in (values if rnd % 2 == 0 else values[::-1]):
            value[0] = v
            setattr(module, name, v)
            split[True] = split[False] = 0
            for shape in args.shapes.split(","):
                # one pool per run_bench call (a layout's pools are all built, then timed in turns): the split counts
                # a row gets are its own pool's
                for backend in args.backends.split(","):
                    for variant, _ in bench._configs(backend, [None], ["auto"]):
                        bench._one_pool_each(bench.run_bench(
                            shapes=[shape], tokens=[4096], page_sizes=[64], programs=[None],
                            layouts=args.layouts.split(","), backends=[backend], variants=[variant],
                            ops=["load_layer", "load_burst"], reps=args.reps, sink=sink, memcpy=reference))
    cells: dict[tuple, dict[float, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[(r["shape"], r["layout"], r["io_backend"], r["variant"], r["op"])][r["value"]].append(r)
    summary = []
    for key, by_value in cells.items():
        entry: dict[str, Any] = {"cell": " ".join(str(k) for k in key if k)}
        for v, rs in sorted(by_value.items()):
            entry[f"{v:g}"] = {"ratio": round(statistics.median(r["ratio"] for r in rs), 3),
                               "host_us": round(statistics.median(r["host_us"] for r in rs), 1),
                               "ratios": [round(r["ratio"], 3) for r in rs],
                               "split_share": round(sum(r["split_calls"] for r in rs)
                                                    / max(1, sum(r["split_calls"] + r["whole_calls"] for r in rs)), 3)}
        summary.append(entry)
        print("summary", json.dumps(entry), flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

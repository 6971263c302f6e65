"""Markdown tables from ``hicache bench`` JSON: ratio to memcpy per SM budget, one table per operation.

Usage: ``python benchmarks/tables.py docs/perf/bench-*.json [--backend kernel]``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--backend", default="kernel")
    args = ap.parse_args(argv)
    rows = [r for f in args.files for r in json.load(open(f))["rows"] if r["io_backend"] == args.backend]
    # the strategy's default budget (programs null) first, then the explicit ones
    budgets = ([None] if any(r["programs"] is None for r in rows) else []) + sorted(
        {r["programs"] for r in rows if r["programs"] is not None})
    by_op: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:
        key = (r["shape"], r["layout"], r["page_size"], r["tokens"])
        by_op[r["op"]].setdefault(key, {})[r["programs"]] = r
    for op, table in by_op.items():
        print(f"\n#### `{op}` ({args.backend}) — ratio to pinned memcpy, host us per call, by SM budget\n")
        print("| shape | layout | page | tokens | MB/layer | " + " | ".join(f"P={'default' if p is None else p}" for p in budgets) + " |")
        print("|---|---|---|---|---|" + "---|" * len(budgets))
        for (shape, layout, ps, n), cells in sorted(table.items()):
            any_row = next(iter(cells.values()))
            layers = 61 if shape.startswith("mla61") else int(shape[3:5])
            per_layer = any_row["bytes"] / (1 if op.endswith("_layer") else layers) / 1e6
            vals = []
            for p in budgets:
                r = cells.get(p)
                slow = f", GEMM +{r['gemm_slowdown'] * 100:.0f}%" if r and r.get("gemm_slowdown") is not None else ""
                # the default column says what the default launched (explicit columns are that budget, capped by work)
                grid = f", {r['launched_programs']} programs" if r and p is None and r.get("launched_programs") else ""
                vals.append(f"{r['ratio']:.2f} ({r['host_us']:.0f} us{slow}{grid})" if r else "-")
            print(f"| {shape} | {layout} | {ps} | {n} | {per_layer:.1f} | " + " | ".join(vals) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``auto`` against the better of its two candidates, row by row, from ``hicache bench`` JSON.

Usage: ``python benchmarks/auto_gaps.py docs/perf/bench-*.json [--points 3] [--json OUT]`` (CPU; reads the files,
runs nothing on a GPU).

Per cell of each file (shape, layout, page size, tokens, operation): the layout's kernel at its default programs
(``P=default``), ``direct`` at its default staging (``staging=auto``) and ``auto`` in its default configuration,
each as ratio to memcpy / GEMM slowdown % (where the row measured one) / host us per call; the route ``auto``'s calls
took (its ``served_by``: the copy engine or the kernel); and ``auto``'s gap in points (0.01 of the ratio) to the
better of the two candidates.  Gaps of more than ``--points`` below it (default 3: issue #11's target) are marked
and listed after the table, and so are the cells that lack one of the three rows.  Gaps are taken from the rows'
unrounded ratios, so a cell shown as "-3.0" may be either side of the line.

Exit status 0; 2 for a file that is not a ``hicache bench`` result (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tables import NotBench, load_rows  # noqa: E402

PROG = "auto_gaps.py"
#: The variant label of each candidate's default configuration in ``hicache bench`` rows (the kernel's also has
#: ``programs`` None: its default SM budget).
DEFAULTS = {"kernel": "P=default", "direct": "staging=auto", "auto": ""}
#: Points (0.01 of the ratio to memcpy) ``auto`` may fall below the better candidate (issue #11).
POINTS = 3.0

Cell = tuple[str, str, int, int, str]


def candidates(rows: list[dict[str, Any]]) -> dict[Cell, dict[str, dict[str, Any]]]:
    """Per cell, the default configuration's row of each of ``kernel``, ``direct`` and ``auto`` the rows hold."""
    cells: dict[Cell, dict[str, dict[str, Any]]] = {}
    for r in rows:
        backend = r["io_backend"]
        if backend in DEFAULTS and (r.get("variant") or "") == DEFAULTS[backend] and r.get("programs") is None:
            key = (r["shape"], r["layout"], int(r["page_size"]), int(r["tokens"]), r["op"])
            cells.setdefault(key, {})[backend] = r
    return cells


def route(auto_row: dict[str, Any]) -> str:
    """The route ``auto``'s calls took, from its ``served_by``: ``"copy engine"`` or ``"kernel"``."""
    served = str(auto_row.get("served_by") or "")
    return "copy engine" if served.startswith("direct") else "kernel"


def gaps(cells: dict[Cell, dict[str, dict[str, Any]]], points: float = POINTS) -> tuple[list[dict[str, Any]],
                                                                                        list[Cell]]:
    """``(entries, incomplete)``: per complete cell, its three rows, ``auto``'s route, its gap in points to the better
    candidate and whether that is more than ``points`` below; and the cells lacking a row."""
    entries, incomplete = [], []
    for key, got in cells.items():
        if set(got) != set(DEFAULTS):
            incomplete.append(key)
            continue
        better = max(got["kernel"]["ratio"], got["direct"]["ratio"])
        gap = (got["auto"]["ratio"] - better) * 100
        entries.append({"cell": key, "rows": got, "route": route(got["auto"]), "gap_points": gap,
                        "miss": gap < -points})
    return entries, incomplete


def _shown(r: dict[str, Any]) -> str:
    gemm = r.get("gemm_slowdown")
    return f"{r['ratio']:.3f}" + ("" if gemm is None else f" / {gemm * 100:+.1f}") + f" / {r['host_us']:.0f}"


def _label(key: Cell) -> str:
    shape, layout, page_size, tokens, op = key
    return f"{shape} `{layout}` p{page_size} n{tokens} {op}"


def table(entries: list[dict[str, Any]]) -> str:
    """A markdown table of ``entries`` (:func:`gaps`), misses' gaps in bold."""
    lines = ["| cell | kernel | `direct` | `auto` (route) | gap, points |", "|---|---|---|---|---|"]
    for e in entries:
        rows, gap = e["rows"], f"{e['gap_points']:+.1f}"
        lines.append(f"| {_label(e['cell'])} | {_shown(rows['kernel'])} | {_shown(rows['direct'])} | "
                     f"{_shown(rows['auto'])} ({e['route']}) | {f'**{gap}**' if e['miss'] else gap} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench.json files written by hicache bench")
    ap.add_argument("--points", type=float, default=POINTS, help=f"gap that counts as a miss (default {POINTS:g})")
    ap.add_argument("--json", default=None, help="also write the entries here")
    args = ap.parse_args(argv)
    out: list[dict[str, Any]] = []
    for path in args.results:
        try:
            rows = load_rows(path)
        except NotBench as exc:
            print(f"{PROG}: {path} {exc}", file=sys.stderr)
            return 2
        cells = candidates(rows)
        entries, incomplete = gaps(cells, args.points)
        misses = [e for e in entries if e["miss"]]
        print(f"## {path}\n\n{table(entries)}\n")
        print(f"`auto` more than {args.points:g} points below the better candidate in {len(misses)} of "
              f"{len(entries)} cells" + ("" if not misses else ":"))
        for e in misses:
            print(f"- {_label(e['cell'])}: {e['gap_points']:+.1f} ({e['route']})")
        for key in incomplete:
            print(f"- {_label(key)}: skipped, no default row of " + ", ".join(sorted(set(DEFAULTS) - set(cells[key]))))
        print()
        out += [{"file": path, "cell": list(e["cell"]), "route": e["route"], "gap_points": round(e["gap_points"], 2),
                 "miss": e["miss"]} for e in entries]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

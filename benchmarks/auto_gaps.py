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

A cell is skipped, with the reason, where a candidate's default row is missing or appears twice (two kernel
strategies of one layout, or merged runs).  A file that is not a ``hicache bench`` result is refused in one line on
stderr and the others are read on; the exit status is then 2 (else 0).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tables import NotBench, _variant, load_rows  # noqa: E402

PROG = "auto_gaps.py"
#: The candidates compared, each in its default configuration (``benchmarks/tables.py``'s ``_variant`` says which
#: rows those are: the kernel's ``P=default``, ``direct``'s ``staging=auto``, ``auto``'s unlabelled one).
CANDIDATES = ("kernel", "direct", "auto")
#: Points (0.01 of the ratio to memcpy) ``auto`` may fall below the better candidate (issue #11).
POINTS = 3.0

Cell = tuple[str, str, int, int, str]


def _default(r: dict[str, Any]) -> bool:
    """Whether ``r`` is its backend's default configuration: no variant beyond the default one (a row without a
    ``variant`` field, from before ``hicache bench`` had variants, is its backend's only one) and no SM budget set."""
    return r.get("programs") is None and _variant(r) == ""


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def candidates(rows: list[dict[str, Any]]) -> dict[Cell, dict[str, list[dict[str, Any]]]]:
    """Per cell, the default configuration's rows (:func:`_default`) of each of ``kernel``, ``direct`` and ``auto``
    that the rows hold with a ratio and a host time."""
    cells: dict[Cell, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        if r["io_backend"] in CANDIDATES and _default(r) and _number(r["ratio"]) and _number(r["host_us"]):
            key = (r["shape"], r["layout"], int(r["page_size"]), int(r["tokens"]), r["op"])
            cells.setdefault(key, {}).setdefault(r["io_backend"], []).append(r)
    return cells


def route(auto_row: dict[str, Any]) -> str:
    """The route ``auto``'s calls took, from its ``served_by``: ``"copy engine"``, ``"kernel"``, or ``"?"`` where the
    row does not say."""
    served = str(auto_row.get("served_by") or "")
    return "?" if not served else "copy engine" if served.startswith("direct") else "kernel"


def gaps(cells: dict[Cell, dict[str, list[dict[str, Any]]]], points: float = POINTS) -> tuple[list[dict[str, Any]],
                                                                                              list[tuple[Cell, str]]]:
    """``(entries, skipped)``: per cell with one row of each candidate, the rows, ``auto``'s route, its gap in points to
    the better candidate and whether that is more than ``points`` below; and each other cell with the reason."""
    entries: list[dict[str, Any]] = []
    skipped: list[tuple[Cell, str]] = []
    for key, got in cells.items():
        missing = sorted(set(CANDIDATES) - set(got))
        twice = sorted(b for b, rs in got.items() if len(rs) > 1)
        if missing or twice:
            why = [f"no default row of {', '.join(missing)}"] if missing else []
            why += [f"{len(got[b])} default rows of {b} ({', '.join(str(r.get('strategy')) for r in got[b])})"
                    for b in twice]
            skipped.append((key, "; ".join(why)))
            continue
        one = {b: rs[0] for b, rs in got.items()}
        better = max(one["kernel"]["ratio"], one["direct"]["ratio"])
        gap = (one["auto"]["ratio"] - better) * 100
        entries.append({"cell": key, "rows": one, "route": route(one["auto"]), "gap_points": gap,
                        "miss": gap < -points})
    return entries, skipped


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


def _points(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: use a finite number of points, 0 or more")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench.json files written by hicache bench")
    ap.add_argument("--points", type=_points, default=POINTS, help=f"gap that counts as a miss (default {POINTS:g})")
    ap.add_argument("--json", default=None, help="also write the entries here")
    args = ap.parse_args(argv)
    out: list[dict[str, Any]] = []
    refused = 0
    for path in args.results:
        try:
            rows = load_rows(path)
        except NotBench as exc:  # said, and the other files read on
            print(f"{PROG}: {path} {exc}", file=sys.stderr)
            refused += 1
            continue
        entries, skipped = gaps(candidates(rows), args.points)
        misses = [e for e in entries if e["miss"]]
        print(f"## {path}\n")
        if entries:
            print(f"{table(entries)}\n")
            print(f"`auto` more than {args.points:g} points below the better candidate in {len(misses)} of "
                  f"{len(entries)} cells" + ("" if not misses else ":"))
        else:
            print("no cell with `auto` and both candidates in their default configurations")
        for e in misses:
            print(f"- {_label(e['cell'])}: {e['gap_points']:+.1f} ({e['route']})")
        for key, why in skipped:
            print(f"- {_label(key)}: skipped, {why}")
        print()
        out += [{"file": path, "cell": list(e["cell"]), "route": e["route"], "gap_points": round(e["gap_points"], 2),
                 "miss": e["miss"]} for e in entries]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())

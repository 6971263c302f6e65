"""Markdown tables from ``hicache bench`` JSON: ratio to memcpy per SM budget and variant, one table per operation.

Usage: ``python benchmarks/tables.py docs/perf/bench-*.json [--backend kernel]``.

Each configuration a file holds for the backend gets its own column: the SM budget (``P=default``, ``P=4``: the
kernel's ``programs``) and the variant (``auto lone=off``, ``direct staging=never``); a backend's default variant
is shown as the plain backend name (``auto``, ``direct``).  A file that is not a ``hicache bench`` result, or a
``--backend`` the files do not hold, is refused with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

PROG = "tables.py"
#: The fields of a ``hicache bench`` row that the tables read (``hicache_core.bench.BenchRow``).
ROW_FIELDS = ("shape", "layout", "io_backend", "page_size", "tokens", "op", "bytes", "ratio", "host_us")
#: Variants that are a backend's default configuration (``hicache bench``'s own defaults), shown as the bare name.
DEFAULT_VARIANTS = {"direct": "staging=auto"}
#: Backends served by the copy engine, which runs on no SM: their tables have no SM budget.
COPY_ENGINE = ("direct",)
EXPECTED = "expected a JSON object whose 'rows' each have " + ", ".join(ROW_FIELDS)


class NotBench(Exception):
    """A file :func:`load_rows` cannot read as a ``hicache bench`` result; the message says why."""


def _kind(data: Any) -> str:
    """What produced ``data``, where its shape says so ('' when it is not recognised)."""
    if isinstance(data, dict):
        rows = data.get("rows")
        first = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
        if "peer" in first:
            return "a peer benchmark result (benchmarks/peers.py or hicache bench --peers, which print their own table)"
        if {"alone", "both"} <= set(first):
            return "a two-GPU result (benchmarks/two_gpu.py)"
        if "rows" not in data and data and all(isinstance(v, dict) and "link_gbps" in v for v in data.values()):
            return "a calibration file (hicache calibrate)"
    if isinstance(data, list) and data and isinstance(data[0], dict) and {"cycles", "summary"} <= set(data[0]):
        return "a pace probe result (benchmarks/pace_probe.py; benchmarks/pace_bins.py reads it)"
    return ""


def load_rows(path: str) -> list[dict[str, Any]]:
    """The rows of the ``hicache bench`` JSON at ``path``; :class:`NotBench` when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise NotBench(f"cannot be read ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotBench(f"is not JSON, so not a `hicache bench` result ({exc}); {EXPECTED}") from None
    rows: Any = data.get("rows") if isinstance(data, dict) else None
    bad = None if isinstance(rows, list) else "no 'rows' list"
    if bad is None:
        for i, r in enumerate(rows):
            missing = [k for k in ROW_FIELDS if k not in r] if isinstance(r, dict) else list(ROW_FIELDS)
            if missing:
                bad = f"row {i} lacks {', '.join(repr(k) for k in missing)}"
                break
    if bad is not None:
        kind = _kind(data)
        looks = f"it looks like {kind}; " if kind else ""
        raise NotBench(f"is not a `hicache bench` result: {looks}{bad}; {EXPECTED}")
    return rows


def signed_pct(fraction: float) -> str:
    """``fraction`` as a signed percentage: ``+1%``, ``-0.3%``, ``-0.03%``, ``+45%``; ``±0%`` only for an exact
    zero or one that rounds to it.  Whole percents from 1% up, one decimal below and two below 0.05% (so that no sign
    stands before a 0)."""
    pct = fraction * 100
    if pct == 0:
        return "±0%"
    digits = 0 if abs(pct) >= 0.95 else 1 if abs(pct) >= 0.05 else 2
    text = f"{pct:+.{digits}f}"
    return "±0%" if float(text) == 0 else f"{text}%"


def _variant(r: dict[str, Any]) -> str:
    """The row's variant less what its column says otherwise: the kernel's ``P=...`` (its ``programs``) and the
    backend's default variant are ''."""
    v = r.get("variant") or ""
    p = r.get("programs")
    if v == f"P={'default' if p is None else p}" or v == DEFAULT_VARIANTS.get(r["io_backend"]):
        return ""
    return v


def _num(x: float | None, fmt: str) -> str:
    return "?" if x is None else format(x, fmt)


def _layers(shape: str) -> int | None:
    """Layers of a ``hicache bench`` shape name (``mla61x576-bf16``: 61), None when the name does not say."""
    m = re.match(r"(?:mla|mha)(\d+)", shape)
    return int(m.group(1)) if m else None


def render(rows: list[dict[str, Any]], backend: str) -> str:
    """The markdown tables of ``backend``'s ``rows``, one per operation."""
    rows = [r for r in rows if r["io_backend"] == backend]
    # columns: the strategy's default budget (programs null) first, then the explicit ones; per budget, the
    # default variant first, then the others in the order the file holds them
    order: dict[str, int] = {}
    for r in rows:
        order.setdefault(_variant(r), len(order))
    columns = sorted({(r.get("programs"), _variant(r)) for r in rows},
                     key=lambda c: (c[0] is not None, c[0] or 0, c[1] != "", order[c[1]]))
    by_budget = any(p is not None for p, _ in columns)
    by_variant = len({v for _, v in columns}) > 1

    def label(col: tuple[int | None, str]) -> str:
        p, v = col
        if by_budget:
            return f"P={'default' if p is None else p}" + (f" {v}" if v else "")
        return f"{backend} {v}" if v else backend

    what = " and ".join(w for w, on in (("SM budget", by_budget), ("variant", by_variant)) if on)
    engine = ": copy engine, no SM budget" if backend in COPY_ENGINE else ""
    by_op: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:
        key = (r["shape"], r["layout"], r["page_size"], r["tokens"])
        by_op[r["op"]].setdefault(key, {})[(r.get("programs"), _variant(r))] = r
    out: list[str] = []
    for op, table in by_op.items():
        out += [f"\n#### `{op}` ({backend}{engine}) — ratio to pinned memcpy, host us per call"
                + (f", by {what}" if what else "") + "\n",
                "| shape | layout | page | tokens | MB/layer | " + " | ".join(map(label, columns)) + " |",
                "|---|---|---|---|---|" + "---|" * len(columns)]
        for (shape, layout, ps, n), cells in sorted(table.items()):
            any_row = next(iter(cells.values()))
            layers = _layers(shape)
            div = 1 if op.endswith("_layer") else layers
            # (the earliest files record no bytes for some rows)
            per_layer = "?" if div is None or any_row["bytes"] is None else f"{any_row['bytes'] / div / 1e6:.1f}"
            vals = []
            for col in columns:
                c = cells.get(col)
                slow = f", GEMM {signed_pct(c['gemm_slowdown'])}" if c and c.get("gemm_slowdown") is not None else ""
                # the default budget says what it launched (explicit budgets are that budget, capped by work)
                grid = (f", {c['launched_programs']} programs"
                        if c and col[0] is None and c.get("launched_programs") else "")
                vals.append(f"{_num(c['ratio'], '.2f')} ({_num(c['host_us'], '.0f')} us{slow}{grid})" if c else "-")
            out.append(f"| {shape} | {layout} | {ps} | {n} | {per_layer} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="hicache bench JSON (the rows of several files are merged)")
    ap.add_argument("--backend", default="kernel", help="the io_backend whose rows are tabled (default kernel)")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    seen: dict[tuple, str] = {}
    repeated = 0
    for f in args.files:
        try:
            file_rows = load_rows(f)
        except NotBench as exc:
            print(f"{PROG}: {f} {exc}", file=sys.stderr)
            return 2
        for r in file_rows:
            cell = (r["io_backend"], r["op"], r["shape"], r["layout"], r["page_size"], r["tokens"],
                    r.get("programs"), _variant(r))
            repeated += cell in seen and seen[cell] != f
            seen[cell] = f
        rows += file_rows
    backends = list(dict.fromkeys(r["io_backend"] for r in rows))
    if args.backend not in backends:
        held = f"these hold {', '.join(backends)}" if backends else "these hold no rows"
        print(f"{PROG}: no {args.backend!r} rows in {', '.join(args.files)} ({held}); pick one with --backend",
              file=sys.stderr)
        return 2
    if repeated:
        print(f"{PROG}: {repeated} cell(s) appear in more than one file; each shows the last file's figures",
              file=sys.stderr)
    print(render(rows, args.backend))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

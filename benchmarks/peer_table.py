"""A takeover table for the SGLang bridge, from the peer benchmark's results (``peers.json``).

Usage: ``python benchmarks/peer_table.py RESULTS/peers.json [--out table.json] [--shape SHAPE ...] [--tokens N]``.

:mod:`benchmarks.peers` puts hicache's io_backends beside SGLang's own transfers on the same buffers.  This turns its
rows into the entries of a takeover table (:mod:`hicache_core.integrations.sglang.takeover`, the file
``HICACHE_SGLANG_TABLE`` names): one per pool kind, host layout and operation, for SGLang's ``kernel`` io_backend on
an unsharded pool.  SGLang's side is its default for the operation: for loads its TMA kernel at its default CTAs
where that ran, else its generic JIT kernel at its default; for all-layer backups its JIT kernel at its default
(``page_first``: its staged write-back).  hicache's side is each of ``kernel`` (its default programs), ``auto`` (its
default forward mode) and ``direct``, on the table's metrics:

- ``backup``: ``copy_ratio``, ``gemm_slowdown_pct`` (where measured) and ``host_us`` of ``backup_all_layers``;
- ``load``: ``copy_ratio`` and ``host_us`` of ``load_layer``, ``burst_copy_ratio`` and ``burst_gemm_slowdown_pct``
  of ``load_burst``.

An entry is taken over where an io_backend is no worse than SGLang on every metric both sides have (of those, the one
that copies fastest); otherwise it names the fastest io_backend, ``take_over`` is false, and its note says where that
one is worse.  The table keys cells by pool kind, not row width, so it holds one shape per kind: ``--shape`` (default:
the first of each kind in the results), at ``--tokens`` (default: the fewest tokens measured for it, where the GEMM
slowdowns are).  An operation without SGLang's default row gets no entry (one line on stderr says so): fp8 656-byte
rows, say, whose backups SGLang's JIT kernel refuses (SGLang then calls ``sgl_kernel``, which the harness cannot
run).  The table is checked with the bridge's own loader before it is written; a result file without the rows a
table needs is refused with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``hicache_core`` importable from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache_core.errors import TakeoverTableError  # noqa: E402
from hicache_core.integrations.sglang.takeover import FORMAT, _worse, load_table  # noqa: E402

PROG = "peer_table.py"
#: hicache's io_backends, as the bridge names them, in the order a tie in speed goes.
OURS = ("kernel", "auto", "direct")
#: The rows each operation's metrics come from: (peer op, metric name from the row's ``ratio``, from its GEMM
#: slowdown, from its host time); ``None`` where the op's row gives no such metric to the table.
SOURCES = {
    "backup": (("backup_all_layers", "copy_ratio", "gemm_slowdown_pct", "host_us"),),
    "load": (("load_layer", "copy_ratio", None, "host_us"),
             ("load_burst", "burst_copy_ratio", "burst_gemm_slowdown_pct", None)),
}


class Refused(Exception):
    """The results cannot give a table (the message says why)."""


def _ok(rows: list[dict[str, Any]], shape: str, tokens: int, layout: str, op: str) -> list[dict[str, Any]]:
    return [r for r in rows if (r.get("status"), r.get("shape"), r.get("tokens"), r.get("layout"), r.get("op"))
            == ("ok", shape, tokens, layout, op)]


def _ours(row: dict[str, Any]) -> str | None:
    """The bridge's io_backend name of a hicache row in its default configuration, else ``None``."""
    if row.get("peer") != "hicache":
        return None
    backend, _, rest = str(row.get("variant", "")).partition(" ")
    if backend == "kernel":
        return backend if rest.endswith(" default") else None  # not an SM budget of the benchmark's own choosing
    return backend if backend in OURS and " " not in rest else None  # auto's other forward modes name themselves


def _sglang(row: dict[str, Any], op: str, layout: str) -> bool:
    """Whether ``row`` is SGLang's default for ``op`` (its loads' TMA kernel is looked for first: see :func:`_side`)."""
    peer, variant = row.get("peer"), str(row.get("variant", ""))
    if op == "backup":
        return (peer, variant) == ("sglang-staged", "default") if layout == "page_first" else \
            peer == "sglang-jit" and variant.endswith("(default)")
    return peer in ("sglang-tma", "sglang-jit") and variant.endswith("(default)")


def _metrics(rows_by_op: dict[str, dict[str, Any] | None], op: str) -> dict[str, float] | None:
    """The table's metrics of one side from its rows per peer op; ``None`` where its first op has no row."""
    out: dict[str, float] = {}
    for i, (peer_op, ratio, gemm, host) in enumerate(SOURCES[op]):
        row = rows_by_op.get(peer_op)
        if row is None:
            if i == 0:
                return None
            continue
        out[ratio] = round(float(row["ratio"]), 4)
        if gemm is not None and row.get("gemm_slowdown") is not None:
            out[gemm] = round(float(row["gemm_slowdown"]) * 100, 2)
        if host is not None and row.get("host_us") is not None:
            out[host] = round(float(row["host_us"]), 2)
    return out


def _side(rows: list[dict[str, Any]], shape: str, tokens: int, layout: str, op: str,
          who: Any) -> dict[str, dict[str, Any] | None]:
    """Per peer op of ``op``, the row of one target: the first that ``who(row)`` accepts for the first peer op
    (SGLang's loads: its TMA kernel before its JIT one), and that target's rows of the others."""
    out: dict[str, dict[str, Any] | None] = {}
    target = None
    for peer_op, *_ in SOURCES[op]:
        found = [r for r in _ok(rows, shape, tokens, layout, peer_op) if who(r)]
        found.sort(key=lambda r: r.get("peer") != "sglang-tma")
        if target is not None:
            found = [r for r in found if (r.get("peer"), r.get("variant")) == target]
        elif found:
            target = (found[0].get("peer"), found[0].get("variant"))
        out[peer_op] = found[0] if found else None
    return out


def _pick(shapes: list[str], rows: list[dict[str, Any]], tokens: int | None) -> list[tuple[str, str, int]]:
    """``(kind, shape, tokens)`` per pool kind: the shapes named (in their order; one per kind), else the first of each
    kind in the results; at ``tokens``, else the fewest measured for the shape."""
    kinds: dict[str, str] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("shape"):
            kinds.setdefault(str(r["shape"]), str(r.get("kind", "")).split(" ")[0])
    out: list[tuple[str, str, int]] = []
    for shape in shapes or list(kinds):
        if shape not in kinds:
            raise Refused(f"shape {shape!r} has no timed rows in the results; they hold {', '.join(kinds) or 'none'}")
        kind = kinds[shape]
        if any(k == kind for k, _, _ in out):
            if shapes:
                raise Refused(f"--shape {shape!r}: a {kind} shape is named already (the table keys cells by pool "
                              "kind: one shape per kind)")
            continue
        measured = sorted({int(r["tokens"]) for r in rows if r.get("shape") == shape and r.get("status") == "ok"})
        if tokens is not None and tokens not in measured:
            raise Refused(f"--tokens {tokens}: {shape} was measured at {', '.join(map(str, measured))} tokens")
        out.append((kind, shape, tokens if tokens is not None else measured[0]))
    return out


def build(data: dict[str, Any], shapes: list[str] | None = None, tokens: int | None = None,
          source: str = "peers.json", say: Any = None) -> dict[str, Any]:
    """The takeover table (a JSON object) from a ``peers.json`` object; ``say(line)`` hears of operations left out."""
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise Refused("not a peers.json result: expected an object whose 'rows' is a list of row objects")
    meta = data.get("meta") or {}
    date, gpu = str(meta.get("date", ""))[:10], meta.get("gpu", "an unnamed GPU")
    try:
        datetime.date.fromisoformat(date)
    except ValueError:
        raise Refused(f"the results' meta.date is {meta.get('date')!r}, not a date a table entry can carry "
                      "(benchmarks/peers.py writes 'YYYY-MM-DD HH:MM')") from None
    entries = []
    for kind, shape, n in _pick(list(shapes or []), rows, tokens):
        layouts = list(dict.fromkeys(str(r["layout"]) for r in rows if r.get("shape") == shape
                                     and r.get("tokens") == n and r.get("status") == "ok"))
        for layout in layouts:
            for op in SOURCES:
                theirs = _side(rows, shape, n, layout, op, lambda r, op=op, lay=layout: _sglang(r, op, lay))
                sglang = _metrics(theirs, op)
                if sglang is None:
                    (say or print)(f"{kind} {layout} {op}: no row of SGLang's default in the results ({shape} at "
                                   f"{n} tokens): no entry")
                    continue
                measured = []
                for io in OURS:
                    ours = _metrics(_side(rows, shape, n, layout, op, lambda r, io=io: _ours(r) == io), op)
                    if ours is not None:
                        both = sorted(sglang.keys() & ours.keys())
                        measured.append((io, {k: ours[k] for k in both}, {k: sglang[k] for k in both}))
                if not measured:
                    (say or print)(f"{kind} {layout} {op}: no row of hicache's io_backends in the results: no entry")
                    continue
                fastest = sorted(measured, key=lambda m: -m[1]["copy_ratio"])  # stable: OURS's order breaks ties
                better = [m for m in fastest if not _worse(m[2], m[1])]
                io, ours, theirs_m = (better or fastest)[0]
                sglang_rows = ", ".join(f"{r['peer']} {r['variant']}" for r in theirs.values() if r is not None)
                note = "no worse on every metric" if better else \
                    f"hicache {io} is worse on {'; '.join(_worse(theirs_m, ours))}"
                entries.append({
                    "kind": kind, "layout": layout, "sglang_io_backend": "kernel", "sharded": False, "op": op,
                    "take_over": bool(better), "hicache_io_backend": io, "sglang": theirs_m, "hicache": ours,
                    "source": f"{gpu}, {source} (benchmarks/peers.py, same process and buffers): {shape} at {n} "
                              f"tokens, page {_page(rows, shape, n)}; SGLang's default here: {sglang_rows}",
                    "date": date, "note": note})
    if not entries:
        raise Refused("no operation had both SGLang's default and one of hicache's io_backends timed: nothing to "
                      "put in a table")
    return {"format": FORMAT, "description": f"Measured by benchmarks/peers.py on {gpu}; written by {PROG}. An "
            "entry is taken over only where hicache is no worse on every metric.", "entries": entries}


def _page(rows: list[dict[str, Any]], shape: str, tokens: int) -> Any:
    return next((r.get("page_size") for r in rows if r.get("shape") == shape and r.get("tokens") == tokens), "?")


def write(table: dict[str, Any], out: str) -> None:
    """Write ``table`` to ``out`` once the bridge's loader accepts it (a table it refuses is never written)."""
    folder = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(table, fh, indent=2)
            fh.write("\n")
        load_table(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("results", help="a peers.json written by benchmarks/peers.py (hicache bench --peers)")
    p.add_argument("--out", default=None, help="write the table here (for HICACHE_SGLANG_TABLE); else print it")
    p.add_argument("--shape", action="append", default=[], help="the shape standing for its pool kind (repeatable)")
    p.add_argument("--tokens", type=int, default=None, help="the token count of the rows to use")
    args = p.parse_args(argv)
    try:
        with open(args.results, encoding="utf-8") as fh:
            data = json.load(fh)
        table = build(data, args.shape, args.tokens, source=os.path.basename(args.results),
                      say=lambda line: print(f"{PROG}: {line}", file=sys.stderr))
        if args.out:
            write(table, args.out)
        else:
            with tempfile.TemporaryDirectory() as folder:  # checked as a written table is
                write(table, os.path.join(folder, "table.json"))
            print(json.dumps(table, indent=2))
    except (OSError, ValueError, Refused, TakeoverTableError) as e:
        print(f"{PROG}: {args.results}: {e}", file=sys.stderr)
        return 2
    for entry in table["entries"]:
        verdict = f"taken over by {entry['hicache_io_backend']}" if entry["take_over"] else \
            f"SGLang keeps it ({entry['note']})"
        print(f"{entry['kind']} {entry['layout']} {entry['op']}: {verdict}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The takeover table: measured SGLang cells, and which of them hicache serves by default.

In ``measured`` mode (the default, see :mod:`.mode`) hicache serves every cell
SGLang cannot serve, plus the cells this table marks ``"take_over": true``.  The
table ships as ``takeover.json`` beside this module; ``HICACHE_SGLANG_TABLE``
names another file (e.g. numbers measured on the user's own GPU).

The format (``"format": "hicache-sglang-takeover/1"``), one object per cell and op::

    {"kind": "mla", "layout": "layer_first", "sglang_io_backend": "kernel",
     "sharded": false, "op": "backup",
     "take_over": false, "hicache_io_backend": "kernel",
     "sglang": {"copy_ratio": 0.94, "gemm_slowdown_pct": 14},
     "hicache": {"copy_ratio": 0.93, "gemm_slowdown_pct": 21},
     "source": "where and how it was measured", "date": "2026-11-29",
     "note": "optional"}

``op`` is ``backup`` (all-layer backups and the per-layer backups of sharded
pools) or ``load``.  ``hicache_io_backend`` is the hicache io_backend that was
measured and that serves the cell when it is taken over.  The two metric
objects hold the same :data:`METRICS`; an entry may be taken over only when
hicache is no worse than SGLang on every one of them (the product rule: a user
who installs hicache must never get a cell worse than SGLang's own).  Every
violation raises :class:`~hicache_core.errors.TakeoverTableError` naming the
file, the entry and the fix.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ...errors import TakeoverTableError

__all__ = [
    "ENV_TABLE", "FORMAT", "SHIPPED_TABLE", "METRICS", "OPS", "Cell", "Entry", "TakeoverTable",
    "load_table", "table_path", "active_table",
]

logger = logging.getLogger(__name__)

ENV_TABLE = "HICACHE_SGLANG_TABLE"
FORMAT = "hicache-sglang-takeover/1"
SHIPPED_TABLE = Path(__file__).with_name("takeover.json")

#: Metric name -> True when higher is better.
METRICS: Mapping[str, bool] = {
    "copy_ratio": True,  # throughput / a pinned copy_ of the same bytes (per call: all layers, or one layer)
    "gemm_slowdown_pct": False,  # GEMM time increase while the op runs beside it, percent
    "burst_copy_ratio": True,  # loads of every layer back to back (a forward pass' prefetch)
    "burst_gemm_slowdown_pct": False,  # GEMM slowdown during such bursts, percent
    "host_us": False,  # host (scheduler-thread) time per call, microseconds
}
KINDS = ("mla", "mha", "dsa_indexer")
SGLANG_IO_BACKENDS = ("kernel", "direct")
OPS = ("backup", "load")
_TOP = {"format", "description", "entries"}
_KEYS = {"kind", "layout", "sglang_io_backend", "sharded", "op"}
_REQUIRED = _KEYS | {"take_over", "hicache_io_backend", "sglang", "hicache", "source", "date"}
_OPTIONAL = {"note"}


@dataclass(frozen=True)
class Cell:
    """One SGLang cell and op: ``(kind, layout, SGLang io_backend, sharded, op)``."""

    kind: str
    layout: str
    sglang_io_backend: str
    sharded: bool
    op: str


@dataclass(frozen=True)
class Entry:
    """A measured cell: both sides' numbers, where they come from, and the decision."""

    cell: Cell
    take_over: bool
    hicache_io_backend: str
    sglang: Mapping[str, float]
    hicache: Mapping[str, float]
    source: str
    date: str
    note: str = ""


@dataclass(frozen=True)
class TakeoverTable:
    """A validated table; :meth:`serving` answers per cell."""

    path: str
    entries: Mapping[Cell, Entry]

    def serving(self, cell: Cell) -> str | None:
        """The hicache io_backend the table assigns to ``cell``, or ``None`` (not taken over by the table)."""
        entry = self.entries.get(cell)
        return entry.hicache_io_backend if entry is not None and entry.take_over else None


def _fail(path: str, where: str, what: str) -> TakeoverTableError:
    return TakeoverTableError(f"takeover table {path}: {where}: {what}")


def _metrics(path: str, where: str, side: str, value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or not value:
        raise _fail(path, where, f"{side!r} must be a non-empty object of metrics ({', '.join(METRICS)})")
    for name, number in value.items():
        if name not in METRICS:
            raise _fail(path, where, f"unknown metric {name!r} in {side!r}; known metrics: {', '.join(METRICS)}")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise _fail(path, where, f"{side}.{name} must be a finite number, got {number!r}")
    return {k: float(v) for k, v in value.items()}


def _worse(sglang: Mapping[str, float], hicache: Mapping[str, float]) -> list[str]:
    out = []
    for name, higher_better in METRICS.items():
        if name in sglang:
            s, h = sglang[name], hicache[name]
            if (h < s) if higher_better else (h > s):
                out.append(f"{name} {h:g} vs SGLang {s:g}")
    return out


def _text(path: str, where: str, raw: Mapping[str, Any], key: str, choices: tuple[str, ...] | None = None) -> str:
    value = raw[key]
    if not isinstance(value, str) or not value:
        raise _fail(path, where, f"{key!r} must be a non-empty string, got {value!r}")
    if choices is not None and value not in choices:
        raise _fail(path, where, f"{key!r} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _flag(path: str, where: str, raw: Mapping[str, Any], key: str) -> bool:
    if not isinstance(raw[key], bool):
        raise _fail(path, where, f"{key!r} must be true or false, got {raw[key]!r}")
    return bool(raw[key])


def _entry(path: str, i: int, raw: Any) -> Entry:
    where = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise _fail(path, where, f"must be an object, got {type(raw).__name__}")
    missing, unknown = sorted(_REQUIRED - raw.keys()), sorted(raw.keys() - _REQUIRED - _OPTIONAL)
    if missing:
        raise _fail(path, where, f"missing {', '.join(map(repr, missing))}")
    if unknown:
        raise _fail(path, where, f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                    f"{', '.join(sorted(_REQUIRED | _OPTIONAL))}")
    cell = Cell(_text(path, where, raw, "kind", KINDS), _text(path, where, raw, "layout"),
                _text(path, where, raw, "sglang_io_backend", SGLANG_IO_BACKENDS), _flag(path, where, raw, "sharded"),
                _text(path, where, raw, "op", OPS))
    where = f"{where} {cell.kind}/{cell.layout}/{cell.sglang_io_backend}/sharded={cell.sharded}/{cell.op}"
    sglang = _metrics(path, where, "sglang", raw["sglang"])
    hicache = _metrics(path, where, "hicache", raw["hicache"])
    if sglang.keys() != hicache.keys():
        raise _fail(path, where, f"'sglang' and 'hicache' must hold the same metrics, got {sorted(sglang)} and "
                    f"{sorted(hicache)}")
    date = _text(path, where, raw, "date")
    try:
        datetime.date.fromisoformat(date)
    except ValueError:
        raise _fail(path, where, f"'date' must be YYYY-MM-DD, got {date!r}") from None
    entry = Entry(cell, _flag(path, where, raw, "take_over"), _text(path, where, raw, "hicache_io_backend"),
                  sglang, hicache, _text(path, where, raw, "source"), date, str(raw.get("note", "")))
    worse = _worse(sglang, hicache)
    if entry.take_over and worse:
        raise _fail(path, where, f"take_over is true but hicache is worse on {'; '.join(worse)}; "
                    "set take_over to false (hicache must never serve a cell worse than SGLang's own)")
    return entry


def load_table(path: str | os.PathLike[str]) -> TakeoverTable:
    """Read and validate the table at ``path``.

    :raises TakeoverTableError: unreadable file, bad JSON, wrong format tag, a
        malformed or duplicated entry, or a take-over that the numbers do not justify.
    """
    name = str(path)
    try:
        with open(name, encoding="utf-8") as fh:
            raw = json.load(fh)
    except OSError as exc:
        raise TakeoverTableError(f"takeover table {name}: cannot read it ({exc.strerror or exc}); "
                                 f"fix the path in {ENV_TABLE} or unset it to use the shipped table") from None
    except json.JSONDecodeError as exc:
        raise _fail(name, f"line {exc.lineno} column {exc.colno}", f"not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise _fail(name, "top level", f"must be an object with \"format\": {FORMAT!r}, got {got!r}")
    unknown = sorted(raw.keys() - _TOP)
    if unknown or not isinstance(raw.get("entries"), list):
        raise _fail(name, "top level", f"needs a list 'entries' and no other keys than {', '.join(sorted(_TOP))}"
                    + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    entries: dict[Cell, Entry] = {}
    for i, item in enumerate(raw["entries"]):
        entry = _entry(name, i, item)
        if entry.cell in entries:
            raise _fail(name, f"entries[{i}]", f"duplicates the cell {entry.cell}; keep one entry per cell and op")
        entries[entry.cell] = entry
    return TakeoverTable(name, entries)


def table_path() -> str:
    """The table in force: ``HICACHE_SGLANG_TABLE`` when set, else the shipped one."""
    return os.environ.get(ENV_TABLE, "").strip() or str(SHIPPED_TABLE)


_cache: dict[str, TakeoverTable] = {}


def active_table() -> TakeoverTable:
    """The table in force, loaded once per path.

    :raises TakeoverTableError: as :func:`load_table` (not cached: a fixed file is picked up).
    """
    path = table_path()
    table = _cache.get(path)
    if table is None:
        table = _cache[path] = load_table(path)
        logger.info("hicache: SGLang takeover table %s: %d cells measured, %d taken over", path,
                    len(table.entries), sum(e.take_over for e in table.entries.values()))
    return table

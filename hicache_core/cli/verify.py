"""``hicache verify``: round-trip random KV through every resolvable cell (PASS, FAIL or SKIP), then time a medium
pool; progress on stderr when it is a terminal."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence, TextIO

import torch

from ..kernel_support import interpreting
from ..pool import HostKVPool
from ..registry import Registry
from ..spec import PoolSpec
from ..testing.conformance import CASES, INDEX_VARIANTS, Case, check_load_all, check_strategy, make_device_buffers
from . import shared
from .args import _add_filters, _check_filters, _device, _kinds, _positive_int
from .matrix import Cell, matrix_cells
from .shared import (UsageError, _first_line, _interpreter_problem, _n, _Notes, _table, _yn, install_problems,
                     no_layout, representative_spec)

logger = logging.getLogger(__package__)  # hicache_core.cli: the name its records had before the CLI was a package

#: What a PASS of ``verify`` proved.
PASS_MEANS = (
    "A PASS means: random KV backed up through the strategy is byte-identical to the reference backend's host buffers "
    "(canary-filled slots and the guard bytes around each host buffer untouched), and loading every layer back into "
    "other device slots returns the original rows and leaves the guard bytes around the device rows untouched (small "
    "pools, shuffled int64 and device-resident int32 indices; --all-cases runs the whole kit)."
)
CPU_GBPS = "GB/s on cpu time host-memory copies in Python; they say nothing about GPU transfer speed."
#: Default tokens of the timed pool in ``verify`` (CPU copies are Python loops: keep them small).
VERIFY_TOKENS = {"cpu": 1024, "cuda": 8192}
VERIFY_REPS = {"cpu": 2, "cuda": 5}


@dataclass
class VerifyRow:
    """The verdict of one cell: ``PASS``, ``FAIL`` or ``SKIP``, with throughput when measured."""

    layout: str
    io_backend: str
    sharded: bool
    kind: str
    strategy: str | None
    result: str
    backup_gbps: float | None = None
    load_gbps: float | None = None
    note: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cases(reg: Registry, cell: Cell, device: torch.device, all_cases: bool) -> list[tuple[Case, tuple[str, ...]]]:
    """Small conformance cases for ``cell``, each with the index variants to run."""
    small = Case(f"{cell.kind}-small", lambda dev: representative_spec(cell.kind, cell.sharded, dev))
    out: list[tuple[Case, tuple[str, ...]]] = [(small, ("shuffled-i64", "last-page-i32-dev"))]
    if not all_cases:
        return out
    for case in CASES:
        spec = case.build(device)
        if spec.kind != cell.kind or spec.sharded != cell.sharded:
            continue
        res, _ = reg.try_resolve(spec, cell.layout, cell.io_backend)
        if res is not None and res.info.name == cell.strategy:
            out.append((case, INDEX_VARIANTS))
    return out


def _conformance(reg: Registry, cell: Cell, device: torch.device, all_cases: bool) -> None:
    for case, variants in _cases(reg, cell, device, all_cases):
        for variant in variants:
            check_strategy(reg, case, cell.layout, cell.io_backend, variant=variant, device=device, strategy=cell.strategy)
        check_strategy(reg, case, cell.layout, cell.io_backend, device=device, strategy=cell.strategy,
                       per_layer_backup=True)
        check_load_all(reg, case, cell.layout, cell.io_backend, device=device, strategy=cell.strategy)


def _timed(fn: Callable[[], None], reps: int, device: torch.device) -> float:
    fn()  # warm-up (first-call set-up, kernel compilation)
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def _throughput(reg: Registry, cell: Cell, device: torch.device, tokens: int, reps: int) -> tuple[float, float]:
    """GB/s of ``backup_all_layers`` and ``load_all_layers`` of every slot of a medium pool."""
    spec = representative_spec(cell.kind, cell.sharded, device, tokens=tokens, medium=True)
    gen = torch.Generator().manual_seed(0)
    dev = make_device_buffers(spec, Case("timed", lambda d: spec), gen)
    pool = HostKVPool(spec, cell.layout, cell.io_backend, dev, registry=reg, strategy=cell.strategy,
                      pin_memory=device.type == "cuda", validate="shapes")
    host = torch.arange(spec.capacity, dtype=torch.int64)
    pages = torch.randperm(2 * spec.num_pages, generator=gen)[: spec.num_pages]
    rows = ((pages.unsqueeze(1) * spec.page_size + torch.arange(spec.page_size)).reshape(-1) + spec.page_size).to(device)
    nbytes = spec.capacity * spec.bytes_per_token
    t_backup = _timed(lambda: pool.backup_all_layers(host, rows), reps, device)
    t_load = _timed(lambda: pool.load_all_layers(host, rows), reps, device)
    return nbytes / t_backup / 1e9, nbytes / t_load / 1e9


def verify_cell(reg: Registry, cell: Cell, device: torch.device, *, tokens: int, reps: int, timing: bool,
                all_cases: bool) -> VerifyRow:
    """Round-trip random KV through ``cell``'s strategy, then time a medium pool."""
    row = VerifyRow(cell.layout, cell.io_backend, cell.sharded, cell.kind, cell.strategy, "SKIP")
    if cell.strategy is None:
        row.note = cell.reason
        if cell.load_failed:  # a broken strategy fails, it is not skipped
            row.result = "FAIL"
        return row
    try:
        _conformance(reg, cell, device, all_cases)
    except Exception as exc:  # any failure of the strategy is a FAIL of its cell, not of the run
        logger.debug("verify %s failed", cell, exc_info=True)
        row.result, row.note = "FAIL", _first_line(exc)
        return row
    row.result = "PASS"
    if not timing:
        return row
    if device.type == "cpu" and interpreting() and cell.io_backend == "kernel":
        row.note = "not timed: Triton interpreter (TRITON_INTERPRET=1)"
        return row
    try:
        row.backup_gbps, row.load_gbps = _throughput(reg, cell, device, tokens, reps)
    except Exception as exc:
        row.result, row.note = "FAIL", f"timed pool: {_first_line(exc)}"
    return row


def verified_cells(reg: Registry, cells: Sequence[Cell]) -> list[Cell]:
    """The cells ``verify`` reports: those with a candidate strategy, and those whose layout and io_backend have one for
    the other kind of pool (sharded or not: a SKIP that names it)."""
    return [c for c in cells if c.candidates or reg.candidates(c.layout, c.io_backend, not c.sharded)]


def verify_cells(reg: Registry, cells: Sequence[Cell], device: torch.device, *, tokens: int, reps: int,
                 timing: bool = True, all_cases: bool = False,
                 progress: Callable[[int, int, Cell], None] | None = None) -> list[VerifyRow]:
    """Verify every cell that has a candidate strategy; a cell with none is left out, but for one whose layout and
    io_backend have a strategy for the other kind of pool (sharded or not): it is a SKIP that names it.

    ``progress(done, total, cell)`` is called before each cell is verified.
    """
    todo = verified_cells(reg, cells)
    out = []
    for i, cell in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), cell)
        row = verify_cell(reg, cell, device, tokens=tokens, reps=reps, timing=timing, all_cases=all_cases)
        logger.info("verify %s: %s %s", _cell_name(cell), row.result, row.note)
        out.append(row)
    return out


def _cell_name(cell: Cell) -> str:
    return f"{cell.layout}/{cell.io_backend}/{'sharded' if cell.sharded else 'unsharded'}/{cell.kind}"


class _Progress:
    """``[ 3/68] layout/io_backend/sharded/kind`` rewritten in place on a terminal's stderr."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.width = 0

    def __call__(self, done: int, total: int, cell: Cell) -> None:
        text = f"[{done + 1:>{len(str(total))}}/{total}] verifying {_cell_name(cell)}"
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def clear(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_verify(rows: Sequence[VerifyRow], device: torch.device, timed: Sequence[PoolSpec],
                  problems: Sequence[str] = ()) -> str:
    """The verify table with notes for skips and failures, the installation's problems, then what PASS means, then
    the summary line."""
    notes = _Notes()
    table = [[r.layout, r.io_backend, _yn(r.sharded), r.kind, r.strategy or "-", r.result,
              _gbps(r.backup_gbps), _gbps(r.load_gbps), notes.mark(r.note) if r.note else ""] for r in rows]
    counts = {k: sum(1 for r in rows if r.result == k) for k in ("PASS", "FAIL", "SKIP")}
    lines = [f"timed pool: {t.describe()}, {t.capacity} tokens (sharded cells: owned layers)" for t in timed] or \
        ["timing: off"]
    lines.append("")
    lines += _table(["layout", "io_backend", "sharded", "kind", "strategy", "result", "backup GB/s", "load GB/s", ""],
                    table)
    if notes.texts:
        lines += ["", "notes:"] + notes.lines()
    if counts["FAIL"]:
        lines.append("(-vv shows each failure's traceback)")
    if problems:
        lines += ["", "installation problems (their layouts and strategies are not verified; `hicache plugins` lists "
                  "what loaded):"] + [f"  {p}" for p in problems]
    lines += ["", PASS_MEANS]
    if timed and device.type == "cpu":
        lines.append(CPU_GBPS)
    lines.append(f"verify on {device}: {_n(len(rows), 'cell')}, {counts['PASS']} passed, {counts['FAIL']} failed, "
                 f"{counts['SKIP']} skipped" + (f"; {_n(len(problems), 'installation problem')}" if problems else ""))
    return "\n".join(lines)


def _cmd_verify(args: argparse.Namespace) -> int:
    reg = shared._registry()
    _check_filters(reg, args)
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device} but CUDA is not available")
    if device.type == "cpu":
        problem = _interpreter_problem()
        if problem:
            raise UsageError(problem)
    if "reference" not in reg.io_backends:  # every cell is compared with it
        raise UsageError(f"no reference io_backend to compare with: hicache's own plugin is not loaded; {reg.core_fix()}")
    if not reg.layouts:  # nothing to verify proves nothing (as when the filters leave no cell)
        if args.json:
            print(json.dumps({"device": str(device), "rows": [], "installation_problems": install_problems(reg)},
                             indent=1))
        print(f"hicache verify: {no_layout(reg)}", file=sys.stderr)
        return 1 if install_problems(reg) else 2  # a broken plugin fails; nothing installed is a usage problem
    kinds = _kinds(args)
    tokens = args.tokens or VERIFY_TOKENS.get(device.type, VERIFY_TOKENS["cpu"])
    reps = args.reps or VERIFY_REPS.get(device.type, VERIFY_REPS["cpu"])
    cells = matrix_cells(reg, kinds=kinds, device=device, layouts=args.layout, io_backends=args.io_backend)
    progress = _Progress(sys.stderr) if sys.stderr.isatty() and not args.json else None
    try:
        rows = verify_cells(reg, cells, device, tokens=tokens, reps=reps, timing=not args.no_timing,
                            all_cases=args.all_cases, progress=progress)
    finally:
        if progress is not None:
            progress.clear()
    problems = install_problems(reg)
    if args.json:
        print(json.dumps({"device": str(device), "tokens": tokens, "rows": [asdict(r) for r in rows],
                          "installation_problems": problems}, indent=1))
    else:
        timed = [] if args.no_timing else [representative_spec(k, False, device, tokens=tokens, medium=True)
                                           for k in kinds]
        print(render_verify(rows, device, timed, problems))
    if problems or any(r.result == "FAIL" for r in rows):
        return 1
    if not any(r.result == "PASS" for r in rows):  # filters or settings that leave nothing to verify prove nothing
        print(f"hicache verify: no cell was verified ({_n(len(rows), 'cell')}, all skipped: see the notes); check the "
              "filters and the HICACHE_* settings", file=sys.stderr)
        return 2
    return 0


def _parser_verify(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("verify", parents=[common],
                       help="round-trip random KV through every resolvable cell; PASS/FAIL and GB/s")
    _add_filters(p)
    p.add_argument("--device", type=_device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help=f"tokens of the timed pool (default {VERIFY_TOKENS})")
    p.add_argument("--reps", type=_positive_int, default=None, help=f"timed repetitions (default {VERIFY_REPS})")
    p.add_argument("--no-timing", action="store_true", help="conformance only")
    p.add_argument("--all-cases", action="store_true", help="also every matching conformance-kit case and index variant")
    p.set_defaults(func=_cmd_verify)

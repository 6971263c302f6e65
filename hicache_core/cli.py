"""The ``hicache`` command: ``plugins``, ``matrix``, ``explain``, ``verify`` (and ``bench`` when installed).

Results go to stdout, diagnostics through :mod:`logging` (stderr).  Every
command builds a fresh registry from the environment, so ``HICACHE_PLUGINS``,
``HICACHE_DISABLE_PLUGINS``, ``HICACHE_STRATEGY`` and ``HICACHE_TRACE`` apply.

Exit codes: 0 success; 1 ``verify`` found a failing cell; 2 a usage, registry
or resolution error (``explain`` on a miss).

Examples::

    hicache plugins
    hicache matrix --kind mla
    hicache explain --layout page_first --io-backend kernel --sharded --kind mla
    hicache verify --tokens 4096
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch

from .errors import RegistryError, ResolutionError, UnknownLayoutError
from .kernel_support import interpreting
from .pool import HostKVPool
from .registry import ENV_STRATEGY, Registry, create_registry
from .spec import MHA, MLA, LayerMap, PoolSpec
from .strategy import OPERATIONS
from .testing.conformance import CASES, INDEX_VARIANTS, Case, check_load_all, check_strategy, make_device_buffers

__all__ = ["main", "build_parser", "representative_spec", "Cell", "matrix_cells", "VerifyRow", "verify_cells"]

logger = logging.getLogger(__name__)

KINDS = (MHA, MLA)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.uint8}
NO_LAYOUT = (
    "no layout is installed: hicache-core alone gives generic backends and no layouts; "
    "install a layout plugin (e.g. pip install hicache-layer-first hicache-page-first hicache-kv-split)"
)
#: Layers of every representative pool; the sharded one is rank 1 of 2 (layers 2-3).
LAYERS = 4
#: Default tokens of the timed pool in ``verify`` (CPU copies are Python loops: keep them small).
VERIFY_TOKENS = {"cpu": 1024, "cuda": 8192}
VERIFY_REPS = {"cpu": 2, "cuda": 5}


# -- pools -------------------------------------------------------------------------
def _layer_map(sharded: bool) -> LayerMap:
    return LayerMap.sharded_cp(LAYERS, 2, 1) if sharded else LayerMap.unsharded(LAYERS)


def representative_spec(
    kind: str, sharded: bool, device: torch.device | str = "cpu", *, dtype: torch.dtype | None = None,
    page_size: int = 16, tokens: int = 64, medium: bool = False,
) -> PoolSpec:
    """The pool a matrix cell is resolved (and verified) on.

    MHA: 4 layers, 2 heads x 8 (``medium``: 8 heads x 128), fp16.  MLA: 4 layers,
    512 + 64, bf16.  Sharded: ``LayerMap.sharded_cp(4, 2, 1)``.  ``tokens`` is
    rounded up to whole pages.
    """
    lmap = _layer_map(sharded)
    capacity = max(1, -(-tokens // page_size)) * page_size
    if kind == MHA:
        heads, dim = (8, 128) if medium else (2, 8)
        return PoolSpec.mha(layer_map=lmap, head_num=heads, head_dim=dim, dtype=dtype or torch.float16,
                            page_size=page_size, capacity=capacity, device=device)
    if kind == MLA:
        return PoolSpec.mla(layer_map=lmap, kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype or torch.bfloat16,
                            page_size=page_size, capacity=capacity, device=device)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


# -- matrix ------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One (layout, io_backend, sharded, kind) cell: the serving strategy or why nothing serves it."""

    layout: str
    io_backend: str
    sharded: bool
    kind: str
    strategy: str | None
    provider: str | None
    candidates: tuple[str, ...]
    reasons: tuple[tuple[str, str], ...]

    @property
    def reason(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.reasons)


def _pick(values: Iterable[str], wanted: Sequence[str] | None) -> list[str]:
    return [v for v in values if not wanted or v in wanted]


def matrix_cells(
    reg: Registry, *, kinds: Sequence[str] = KINDS, device: torch.device | str = "cpu",
    layouts: Sequence[str] | None = None, io_backends: Sequence[str] | None = None,
) -> list[Cell]:
    """Resolve every cell on the representative pools, in a fixed order (layout, io_backend, sharded, kind)."""
    out = []
    for layout in _pick(sorted(reg.layouts), layouts):
        for backend in _pick(reg.io_backends, io_backends):
            for sharded in (False, True):
                for kind in kinds:
                    spec = representative_spec(kind, sharded, device)
                    res, rejected = reg.try_resolve(spec, layout, backend)
                    cands = tuple(c.name for c in reg.candidates(layout, backend, sharded))
                    out.append(Cell(layout, backend, sharded, kind, res.info.name if res else None,
                                    res.provider.label if res else None, cands, tuple(rejected) if not res else ()))
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


class _Notes:
    """Numbered footnotes, one per distinct text, in first-use order."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"[{i}] {t}" for i, t in enumerate(self.texts, 1)]


def _yn(b: bool) -> str:
    return "yes" if b else "no"


def _pool_lines(kinds: Sequence[str], device: torch.device | str) -> list[str]:
    lines = [f"pools (device {torch.device(device)}):"]
    for kind in kinds:
        for sharded in (False, True):
            lines.append(f"  {kind}{' sharded' if sharded else ''}: {representative_spec(kind, sharded, device).describe()}")
    return lines


def render_matrix(cells: Sequence[Cell], kinds: Sequence[str], device: torch.device | str) -> str:
    """The fixed-width support table with a footnote per distinct reason."""
    notes = _Notes()
    rows = []
    for c in cells:
        ops = [c.strategy or "-"] * len(OPERATIONS)
        rows.append([c.layout, c.io_backend, _yn(c.sharded), c.kind, *ops, "" if c.strategy else notes.mark(c.reason)])
    lines = _pool_lines(kinds, device) + [""]
    lines += _table(["layout", "io_backend", "sharded", "kind", *OPERATIONS, ""], rows)
    served = sum(1 for c in cells if c.strategy)
    lines += ["", f"{served} of {_n(len(cells), 'cell')} served; '-': nothing serves the cell, because:"] if notes.texts else \
        ["", f"{served} of {_n(len(cells), 'cell')} served"]
    return "\n".join(lines + notes.lines())


# -- explain -------------------------------------------------------------------------
def _close(name: str, options: Iterable[str]) -> str:
    near = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"did you mean: {', '.join(near)}?" if near else ""


def explain_lines(reg: Registry, spec: PoolSpec, layout: str, io_backend: str, override: str | None) -> tuple[list[str], bool]:
    """The resolution trace of one key and whether it resolved.  Raises :class:`UnknownLayoutError`."""
    lay = reg.layout(layout)
    lay_rec = reg.layouts[layout][1]
    res, rejected = reg.try_resolve(spec, layout, io_backend, override=override)
    why = dict(rejected)
    cands = reg.candidates(layout, io_backend, spec.sharded)
    names = [c.name for c in cands]
    env_pick = reg.env.get(ENV_STRATEGY)
    pick, pick_src = (override, "--strategy") if override else (env_pick, ENV_STRATEGY)
    lines = [
        f"key: layout={layout!r} io_backend={io_backend!r} sharded={spec.sharded}",
        f"pool: {spec.describe()} (device {spec.device})",
        f"layout: {layout} from {lay_rec.label}: {lay.description}",
    ]
    layout_why = why.get(f"layout {layout}")
    if layout_why:
        lines.append(f"layout check: rejected: {layout_why}")
    lines.append("candidates, in order:" if cands else f"candidates: none; {why.get('(none)', '')}".rstrip("; "))
    for i, info in enumerate(cands, 1):
        if layout_why:
            state = "not tried (the layout rejects this pool)"
        elif pick and pick in names and info.name != pick:
            state = f"skipped ({pick_src}={pick})"
        elif res is not None and info.name == res.info.name:
            state = "chosen"
        elif info.name in why:
            state = f"rejected: {why[info.name]}"
        else:
            state = "not tried (an earlier candidate serves)"
        kind = "generic" if info.generic else "exact"
        lines.append(f"  {i}. {info.name} ({kind}; {reg.strategies[info.name][1].label}): {state}")
    if override and override not in names:
        lines.append(f"--strategy {override}: {why.get(override, 'not a candidate')}")
    if res is not None:
        lines.append(f"chosen: {res.info.name} from {res.provider.label}")
    return lines, res is not None


# -- verify --------------------------------------------------------------------------
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def verify_cell(reg: Registry, cell: Cell, device: torch.device, *, tokens: int, reps: int, timing: bool,
                all_cases: bool) -> VerifyRow:
    """Round-trip random KV through ``cell``'s strategy, then time a medium pool."""
    row = VerifyRow(cell.layout, cell.io_backend, cell.sharded, cell.kind, cell.strategy, "SKIP")
    if cell.strategy is None:
        row.note = cell.reason
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


def verify_cells(reg: Registry, cells: Sequence[Cell], device: torch.device, *, tokens: int, reps: int,
                 timing: bool = True, all_cases: bool = False) -> list[VerifyRow]:
    """Verify every cell that has a candidate strategy (cells with none are left out)."""
    out = []
    for cell in cells:
        if not cell.candidates:
            continue
        row = verify_cell(reg, cell, device, tokens=tokens, reps=reps, timing=timing, all_cases=all_cases)
        logger.info("verify %s/%s/%s/%s: %s %s", cell.layout, cell.io_backend, _yn(cell.sharded), cell.kind,
                    row.result, row.note)
        out.append(row)
    return out


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_verify(rows: Sequence[VerifyRow], device: torch.device, timed: Sequence[PoolSpec]) -> str:
    """The verify table: one row per cell, notes for skips and failures."""
    notes = _Notes()
    table = [[r.layout, r.io_backend, _yn(r.sharded), r.kind, r.strategy or "-", r.result,
              _gbps(r.backup_gbps), _gbps(r.load_gbps), notes.mark(r.note) if r.note else ""] for r in rows]
    counts = {k: sum(1 for r in rows if r.result == k) for k in ("PASS", "FAIL", "SKIP")}
    lines = [f"verify on {device}: {_n(len(rows), 'cell')}, {counts['PASS']} passed, {counts['FAIL']} failed, "
             f"{counts['SKIP']} skipped"]
    lines += [f"timed pool: {t.describe()}, {t.capacity} tokens (sharded cells: owned layers)" for t in timed] or \
        ["timing: off"]
    lines.append("")
    lines += _table(["layout", "io_backend", "sharded", "kind", "strategy", "result", "backup GB/s", "load GB/s", ""],
                    table)
    if notes.texts:
        lines += ["", "notes:"] + notes.lines()
    return "\n".join(lines)


# -- commands ------------------------------------------------------------------------
def _registry() -> Registry:
    return create_registry()


def _n(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _sharded_text(sharded: tuple[bool, ...]) -> str:
    return "both" if set(sharded) == {False, True} else _yn(sharded[0]) if sharded else "none"


def _cmd_plugins(args: argparse.Namespace) -> int:
    reg = _registry()
    if args.json:
        data = [{**asdict(p), "layouts": sorted(p.layouts), "strategies": [
            {"name": n, "io_backend": reg.strategies[n][0].io_backend, "layouts": list(reg.strategies[n][0].layouts),
             "sharded": list(reg.strategies[n][0].sharded)} for n in sorted(p.strategies)]} for p in reg.plugins]
        print(json.dumps({"plugins": data, "layouts": sorted(reg.layouts)}, indent=1))
        return 0
    lines = []
    for p in reg.plugins:
        lines.append(f"{p.name} ({p.label})" + (f": BROKEN, {p.error}" if p.error else ""))
        for name in sorted(p.layouts):
            lines.append(f"  layout {name}: {reg.layouts[name][0].description}")
        for name in sorted(p.strategies):
            info = reg.strategies[name][0]
            desc = f": {info.description}" if info.description else ""
            lines.append(f"  strategy {name} [io_backend={info.io_backend} layouts={','.join(info.layouts)} "
                         f"sharded={_sharded_text(info.sharded)}]{desc}")
    if not reg.plugins:
        lines.append("no hicache plugin is loaded")
    broken = sum(1 for p in reg.plugins if p.error)
    lines.append("")
    lines.append(f"{_n(len(reg.plugins), 'plugin')} ({broken} broken), {_n(len(reg.layouts), 'layout')}, "
                 f"{_n(len(reg.strategies), 'strategy', 'strategies')}; "
                 f"io_backends: {', '.join(reg.io_backends) or '(none)'}")
    if not reg.layouts:
        lines.append(NO_LAYOUT)
    print("\n".join(lines))
    return 0


def _kinds(args: argparse.Namespace) -> list[str]:
    return [k for k in KINDS if not args.kind or k in args.kind]


def _cmd_matrix(args: argparse.Namespace) -> int:
    reg = _registry()
    kinds = _kinds(args)
    device = torch.device(args.device)
    cells = matrix_cells(reg, kinds=kinds, device=device, layouts=args.layout, io_backends=args.io_backend)
    if args.json:
        data = {"device": str(device), "operations": list(OPERATIONS), "cells": [
            {**asdict(c), "operations": {op: c.strategy for op in OPERATIONS}, "reason": c.reason or None}
            for c in cells]}
        print(json.dumps(data, indent=1))
        return 0
    if not reg.layouts:
        print(NO_LAYOUT)
        return 0
    print(render_matrix(cells, kinds, device))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    reg = _registry()
    dtype = DTYPES[args.dtype] if args.dtype else None
    spec = representative_spec(args.kind, args.sharded, args.device, dtype=dtype)
    try:
        lines, ok = explain_lines(reg, spec, args.layout, args.io_backend, args.strategy)
    except UnknownLayoutError as exc:
        hint = _close(args.layout, reg.layouts)
        print(f"hicache explain: {exc}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
        return 2
    print("\n".join(lines))
    if ok:
        return 0
    try:
        reg.resolve(spec, args.layout, args.io_backend, override=args.strategy)
    except ResolutionError as exc:
        hint = _close(args.io_backend, reg.io_backends) if args.io_backend not in reg.io_backends else ""
        print(f"hicache explain: {exc}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
    return 2


def _cmd_verify(args: argparse.Namespace) -> int:
    reg = _registry()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"hicache verify: --device {device} but CUDA is not available", file=sys.stderr)
        return 2
    if not reg.layouts:
        print(NO_LAYOUT)
        return 0
    kinds = _kinds(args)
    tokens = args.tokens or VERIFY_TOKENS.get(device.type, VERIFY_TOKENS["cpu"])
    reps = args.reps or VERIFY_REPS.get(device.type, VERIFY_REPS["cpu"])
    cells = matrix_cells(reg, kinds=kinds, device=device, layouts=args.layout, io_backends=args.io_backend)
    rows = verify_cells(reg, cells, device, tokens=tokens, reps=reps, timing=not args.no_timing,
                        all_cases=args.all_cases)
    if args.json:
        print(json.dumps({"device": str(device), "tokens": tokens, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        timed = [] if args.no_timing else [representative_spec(k, False, device, tokens=tokens, medium=True)
                                           for k in kinds]
        print(render_verify(rows, device, timed))
    return 1 if any(r.result == "FAIL" for r in rows) else 0


# -- parser --------------------------------------------------------------------------
def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", action="extend", nargs="+", choices=KINDS, help="pool kinds (default: all)")
    p.add_argument("--layout", action="append", help="only this layout (repeatable)")
    p.add_argument("--io-backend", action="append", help="only this io_backend (repeatable)")
    p.add_argument("--json", action="store_true", help="JSON instead of the table")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hicache`` (``bench`` is added when :mod:`hicache_core.bench` exists)."""
    parser = argparse.ArgumentParser(prog="hicache", description="hicache: KV cache host pools in any layout.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log INFO (-v) or DEBUG (-vv) to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plugins", help="loaded plugins and what each registers")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)

    p = sub.add_parser("matrix", help="support table: layout x io_backend x sharded x kind x operation")
    _add_filters(p)
    p.add_argument("--device", default="cpu", help="device of the representative pools (default: cpu)")
    p.set_defaults(func=_cmd_matrix)

    p = sub.add_parser("explain", help="how one (layout, io_backend, sharded) key resolves, and why")
    p.add_argument("--layout", required=True)
    p.add_argument("--io-backend", required=True)
    p.add_argument("--sharded", action="store_true", help="layer-sharded device pool (rank 1 of 2)")
    p.add_argument("--kind", choices=KINDS, default=MHA)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="pool dtype (default: fp16 for mha, bf16 for mla)")
    p.add_argument("--strategy", help="strategy name to use instead of the default pick")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("verify", help="round-trip random KV through every resolvable cell; PASS/FAIL and GB/s")
    _add_filters(p)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tokens", type=int, default=None, help=f"tokens of the timed pool (default {VERIFY_TOKENS})")
    p.add_argument("--reps", type=int, default=None, help=f"timed repetitions (default {VERIFY_REPS})")
    p.add_argument("--no-timing", action="store_true", help="conformance only")
    p.add_argument("--all-cases", action="store_true", help="also every matching conformance-kit case and index variant")
    p.set_defaults(func=_cmd_verify)

    if importlib.util.find_spec(f"{__package__}.bench") is not None:
        from . import bench

        bench.add_parser(sub)
    from . import calibration

    calibration.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``hicache``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except RegistryError as exc:
        print(f"hicache {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. ``hicache verify | head``: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

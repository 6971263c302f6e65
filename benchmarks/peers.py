"""Peer benchmark: hicache's strategies beside SGLang's and LMCache's transfer kernels.

Same process, same pools, same bytes: for each cell (shape, tokens; page 64, random
page order on both sides) and host layout, every target moves rows between the same
device tensors and the same pinned host tensors, and is checked bit-exact against
hicache's ``reference`` backend (:mod:`benchmarks.peer_check`) before it is timed.

Targets: hicache ``kernel`` (each ``--programs`` budget), ``auto`` (when registered),
``direct``; SGLang's generic JIT kernel and its TMA kernel at each quota, its staged
``page_first`` write-back, its direct path (:mod:`benchmarks.peer_sglang`); LMCache's
multi-layer kernel (:mod:`benchmarks.peer_lmcache`).  A target that cannot run gets a
row with the error; nothing aborts the run.

Operations: ``backup_all_layers`` (D2H, all layers, one call), ``load_layer`` (H2D, one
layer), ``load_burst`` (H2D, ``load_layer`` of every layer back to back, as a forward
pass issues them), ``load_burst_new`` (the same with index tensors the target has not
seen: what each new batch pays for per-pair plans and index copies), ``backup_new``
(``backup_all_layers`` likewise).  Per row: GB/s, ratio to a pinned ``copy_`` of the same bytes and
direction, CTAs/programs, slowdown of a bf16 GEMM on another stream while the operation
runs back to back (``--gemm-ops``, cells up to ``--gemm-max-tokens``), host time per
call (per layer call for bursts), bit-exact.  The targets of a layout are timed in turns:
each operation's timed calls are split into ``--rounds`` rounds, every target running its
share in each, so that the host's drift reaches them alike (:func:`_measure_op`).  Rows go
to ``<out>/peers.json`` after every row (a layout's in the order its operations end, then regrouped per target); a
markdown table is printed at the end.  ``--time-budget`` seconds after the start, the operations and targets not yet
begun are recorded as skipped (an operation that has begun finishes for every target of its layout).

Usage (CUDA machine, SGLang/LMCache installed as ``dev/gpu_peers.sh`` does)::

    python -m benchmarks.peers --out results --time-budget 360
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import peer_lmcache, peer_sglang  # noqa: E402
from benchmarks.needs_cuda import require_cuda  # noqa: E402
from benchmarks.peer_check import ALL_OPS, PeerMismatch, check_bit_exact, sync  # noqa: E402
from hicache_core.backends.auto import FORWARD_MODES  # noqa: E402
from hicache_core.backends.auto_rules import BACKUP_ROOM  # noqa: E402
from hicache_core.bench import (  # noqa: E402
    DEFAULT_ROUNDS,
    SHAPES,
    _device_buffers,
    _gemm_slowdown,
    _hbm_reader,
    _in_turns,
    _host_us,
    _ms_beside,
    _ms_beside_gemm,
    _neighbor_slowdown,
    _indices,
    _Memcpy,
    _served_by,
    _targets,
)
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import Registry, create_registry  # noqa: E402
from hicache_core.spec import PoolSpec  # noqa: E402

__all__ = ["PeerRow", "ROW_FIELDS", "DEFAULT_CELLS", "add_arguments", "parse_args", "plan_grid", "run_peers",
           "markdown", "main"]

#: Most important first: a run cut short by its time budget still has them.
DEFAULT_CELLS = "mla61x576-bf16@4096,mla61x656-fp8@4096,mha80x8x128-bf16@4096,mla61x576-bf16@32768"
DEFAULT_LAYOUTS = "layer_first,page_first"
#: Index tensor pairs ``load_burst_new`` cycles through: more than any per-pool memo keeps.
NEW_INDEX_PAIRS = 32
JSON_NAME = "peers.json"


@dataclass
class PeerRow:
    """One row of ``peers.json``.  ``status``: ok, error, mismatch, skipped, unsupported."""

    peer: str
    variant: str
    layout: str
    shape: str
    kind: str
    tokens: int
    page_size: int
    op: str
    status: str
    ctas: int | None = None
    bytes: int | None = None
    ms: float | None = None
    gbps: float | None = None
    memcpy_gbps: float | None = None
    ratio: float | None = None
    gemm_slowdown: float | None = None
    host_us: float | None = None
    bit_exact: bool | None = None
    error: str | None = None
    note: str | None = None
    hbm_slowdown: float | None = None
    hbm_ratio: float | None = None
    #: the op's own ratio to memcpy while bf16 GEMMs run without pause beside it (where the GEMM slowdown is measured)
    gemm_ratio: float | None = None


ROW_FIELDS = tuple(PeerRow.__dataclass_fields__)


# -- arguments and grid -----------------------------------------------------------
def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in _csv(s)]


def _cells(s: str) -> list[tuple[str, int]]:
    out = []
    for item in _csv(s):
        shape, sep, tokens = item.partition("@")
        if not sep or shape not in SHAPES or not tokens.isdigit():
            raise argparse.ArgumentTypeError(f"cell {item!r}: use SHAPE@TOKENS with SHAPE in {sorted(SHAPES)}")
        out.append((shape, int(tokens)))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The peer benchmark's options (for ``hicache bench --peers`` or this module's ``main``)."""
    p.add_argument("--out", default="peers-results", help=f"folder for {JSON_NAME}")
    p.add_argument("--cells", type=_cells, default=_cells(DEFAULT_CELLS),
                   help=f"comma list of SHAPE@TOKENS, run in this order (default {DEFAULT_CELLS})")
    p.add_argument("--layouts", type=_csv, default=_csv(DEFAULT_LAYOUTS))
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--programs", type=_ints, default=[0, 8],
                   help="SM budgets of hicache kernel strategies; 0 = strategy default")
    p.add_argument("--io-backends", type=_csv, default=["kernel", "auto", "direct"],
                   help="hicache io_backends; ones not registered are noted and skipped")
    p.add_argument("--auto-forward", type=_csv, default=["compute"],
                   help=f"hicache auto's forward option(s) to measure, comma list of {', '.join(FORWARD_MODES)} "
                        "(default compute)")
    p.add_argument("--sglang-quotas", type=_ints, default=[2, 8], help="CTAs of SGLang's generic JIT kernel (2 = its default)")
    p.add_argument("--sglang-tma-quotas", type=_ints, default=[4, 8], help="CTAs of SGLang's TMA kernel (4 = its default)")
    p.add_argument("--peers", type=_csv, default=["hicache", "sglang", "lmcache"])
    p.add_argument("--ops", type=_csv, default=list(ALL_OPS))
    p.add_argument("--gemm-ops", type=_csv, default=["backup_all_layers", "load_burst"])
    p.add_argument("--gemm-max-tokens", type=int, default=4096, help="measure GEMM slowdown only up to this many tokens")
    p.add_argument("--hbm", action="store_true",
                   help="where the GEMM slowdown is measured, also measure a memory-bound reduction's slowdown and the "
                        "transfer's ratio while it runs (hicache bench --hbm)")
    p.add_argument("--reps", type=int, default=10,
                   help="timed calls per target and operation (at least 3; fewer for slow operations: --op-budget-ms)")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help="rounds each operation's timed calls are split into, the targets of a layout taking turns in "
                        "each (1: each target's timed calls back to back, one target after another)")
    p.add_argument("--op-budget-ms", type=float, default=1500.0, help="fewer reps (>= 3) for slow operations")
    p.add_argument("--slow-ms", type=float, default=1000.0, help="an operation slower than this per call is not timed")
    p.add_argument("--time-budget", type=float, default=400.0,
                   help="seconds; operations and targets not yet begun then are recorded as skipped")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if unknown := [op for op in args.ops if op not in ALL_OPS]:
        p.error(f"--ops {unknown}: choose from {list(ALL_OPS)}")
    if unknown := [f for f in args.auto_forward if f not in FORWARD_MODES]:
        p.error(f"--auto-forward {unknown}: choose from {', '.join(FORWARD_MODES)}")
    if args.rounds < 1 or args.reps < 1:
        p.error(f"--rounds {args.rounds} and --reps {args.reps} must be at least 1")
    return args


def plan_grid(cells: list[tuple[str, int]], layouts: list[str]) -> list[tuple[str, int, str]]:
    """``(shape, tokens, layout)`` in run order: cells in the order given, each over ``layouts``."""
    return [(shape, tokens, layout) for shape, tokens in cells for layout in layouts]


# -- targets ----------------------------------------------------------------------
@dataclass
class Ctx:
    """Buffers of one (cell, layout), shared by every target."""

    spec: PoolSpec
    layout: str
    dev: dict[str, list[torch.Tensor | None]]
    host: dict[str, torch.Tensor]
    reg: Registry


@dataclass
class TargetSpec:
    peer: str
    variant: str
    build: Callable[[Ctx], Any]


class Ours:
    """A hicache pool on the shared buffers, as a benchmark target."""

    ops_supported = ALL_OPS
    contiguous_host = False

    def __init__(self, ctx: Ctx, backend: str, strategy: str, programs: int | None,
                 options: dict[str, Any] | None = None) -> None:
        opts = {**({"programs": programs} if programs else {}), **(options or {})} or None
        self.pool = HostKVPool(ctx.spec, ctx.layout, backend, ctx.dev, host_buffers=ctx.host, strategy=strategy,
                               strategy_options=opts, registry=ctx.reg, validate="shapes")
        self.host_buffers = self.pool.host_buffers
        self.backend = backend
        # the last call of each direction (backups: True), for ctas: (host indices, device indices, layer, to_host)
        self._last: dict[bool, tuple[torch.Tensor, torch.Tensor, int | None, bool]] = {}
        # auto's count of loads its lone-load rule gave the kernel, and whether the last load was one of them
        self._lone_of: Any = self.pool.strategy if hasattr(self.pool.strategy, "lone_kernel_loads") else None
        self._last_lone = False

    def ctas(self, op: str) -> int | None:
        """The most programs one kernel launch of the op's last call ran (0: the copy engine served it)."""
        backup = op.startswith("backup")
        last = self._last.get(backup)
        if last is None:
            return None
        grid = _served_by(self.pool, *last, lone=not backup and self._last_lone)[1]
        return 0 if grid is None and self.backend in ("direct", "auto") else grid

    def backup_all_layers(self, h: torch.Tensor, s: torch.Tensor) -> None:
        self._last[True] = (h, s, None, True)
        self.pool.backup_all_layers(h, s)

    def load_layer(self, layer: int, h: torch.Tensor, d: torch.Tensor) -> None:
        self._last[False] = (h, d, layer, False)
        counter = self._lone_of
        if counter is None:
            self.pool.load_layer(layer, h, d)
            return
        before = counter.lone_kernel_loads
        self.pool.load_layer(layer, h, d)
        self._last_lone = counter.lone_kernel_loads != before


def _ours(backend: str, name: str, programs: int | None, options: dict[str, Any] | None = None
          ) -> Callable[[Ctx], Ours]:
    """A target's builder: :class:`Ours` over the context it is given."""
    return lambda c: Ours(c, backend, name, programs, options)


def _our_targets(args: argparse.Namespace, reg: Registry, spec: PoolSpec, layout: str) -> list[TargetSpec]:
    out = []
    backends = [b for b in args.io_backends if b in reg.io_backends]
    for _, backend, name in _targets(reg, spec, [layout], backends):
        if backend == "auto":
            for fwd in args.auto_forward:
                variant = f"{backend} {name}" + ("" if fwd == "compute" else f" forward={fwd}")
                pin = {"forward": fwd, "backup_room": BACKUP_ROOM}  # the default room, whatever the environment sets
                out.append(TargetSpec("hicache", variant, _ours(backend, name, None, pin)))
            continue
        for p in args.programs if backend == "kernel" else [0]:
            variant = f"{backend} {name}" + (f" P={p}" if p else " default" if backend == "kernel" else "")
            out.append(TargetSpec("hicache", variant, _ours(backend, name, p or None)))
    return out


def _sglang_targets(args: argparse.Namespace, kit: peer_sglang.SglangKit | None, layout: str) -> list[TargetSpec]:
    def failing(msg: str) -> Callable[[Ctx], Any]:
        def build(_: Ctx) -> Any:
            raise RuntimeError(msg)
        return build

    if kit is None:
        return []
    if kit.import_error:
        return [TargetSpec("sglang", "jit/tma", failing(kit.import_error))]
    out: list[TargetSpec] = []
    if layout in peer_sglang.JIT_LAYOUTS:
        default_q, default_tma = int(kit.ops.DEFAULT_BLOCK_QUOTA), int(kit.ops.TMA_BLOCK_QUOTA)
        def jit(tma: bool, quota: int) -> Callable[[Ctx], Any]:
            return lambda c: peer_sglang.SglangJit(kit, tma, quota, c.spec, c.layout, c.dev, c.host)
        for q in args.sglang_quotas:
            tag = f"q={q}" + (" (default)" if q == default_q else "")
            out.append(TargetSpec("sglang-jit", tag, jit(False, q)))
        for q in args.sglang_tma_quotas:
            tag = f"q={q}" + (" (default)" if q == default_tma else "")
            out.append(TargetSpec("sglang-tma", tag, jit(True, q)))
    if layout == "page_first":
        out.append(TargetSpec("sglang-staged", "default", lambda c: peer_sglang.SglangStaged(kit, c.spec, c.layout,
                                                                                             c.dev, c.host)))
    if layout == "layer_first" and kit.direct_error:
        out.append(TargetSpec("sglang-direct", "transfer_kv_direct", failing(kit.direct_error)))
    return out


def _lmcache_targets(lm: tuple[Any, str | None] | None, layout: str) -> list[TargetSpec]:
    if lm is None or layout != "layer_first":
        return []
    ops, err = lm

    def build(c: Ctx) -> Any:
        if ops is None:
            raise RuntimeError(f"LMCache's CUDA ops do not import: {err}")
        return peer_lmcache.LmcacheMultiLayer(ops, c.spec, c.layout, c.dev, c.host)
    return [TargetSpec("lmcache", "multi_layer_kv_transfer_unilateral", build)]


# -- measurement --------------------------------------------------------------------
def _describe(spec: PoolSpec) -> str:
    return f"{spec.kind} {len(spec.layer_map.device_layers)}x" + "+".join(f"{c.row_bytes}B" for c in spec.components)


#: One operation of one target: (the call, calls per call (layers of a burst), bytes per call, to the host).
OpCall = tuple[Callable[[], Any], int, int, bool]


def _probe_ms(fn: Callable[[], Any]) -> float:
    """Wall milliseconds of one call of ``fn`` after one untimed call (the GPU idle before and after each)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _measure_op(args: argparse.Namespace, calls: list[OpCall], memcpy: _Memcpy, gemm: bool,
                served: list[Callable[[], Any]] | None = None) -> list[dict[str, Any] | Exception]:
    """Time one operation of several targets of one layout: per target, its result fields (``status`` ok or skipped)
    or the exception its calls raised; with ``served`` (per target, what served its last call: the CTAs a target
    reports), also ``ctas``, asked of every target once the timed calls are over, before any host-time or GEMM call
    runs (``auto`` may route the pair anew during those).

    Each target is probed (one call timed; slower than ``--slow-ms``: skipped) and given its number of timed calls
    (``--reps``, fewer for slow ones, never under 3).  Those calls are split over ``--rounds`` rounds, and in each round
    every target runs its share in turn (``bench.timing._in_turns``), so that the host's drift over the
    operation's window reaches every target alike; the median of all of a target's calls gives its speed.  Host time
    and the GEMM slowdown are then measured per target, one after the other."""
    out: list[dict[str, Any] | Exception | None] = [None] * len(calls)
    reps: dict[int, int] = {}
    for i, (fn, _, nbytes, _) in enumerate(calls):
        try:
            probe = _probe_ms(fn)
        except Exception as e:  # noqa: BLE001
            out[i] = e
            continue
        if probe > args.slow_ms:
            out[i] = {"status": "skipped", "gbps": nbytes / probe / 1e6, "ms": probe,
                      "note": f"one call took {probe:.0f} ms (> --slow-ms); GB/s from that call, not timed further"}
            continue
        reps[i] = max(3, min(args.reps, int(args.op_budget_ms / max(probe, 1e-3))))
    timed, failed = list(reps), dict[int, Exception]()
    samples, _ = _in_turns([calls[i][0] for i in timed], [reps[i] for i in timed], args.rounds, failed)
    times = dict(zip(timed, samples))
    for k, err in failed.items():
        out[timed[k]] = err
    ctas: dict[int, Any] = {}
    for i, x in enumerate(out if served is not None else []):  # timed (None here) or skipped (a dict) targets'
        if isinstance(x, Exception):
            continue
        try:
            ctas[i] = served[i]()  # type: ignore[index]
        except Exception as e:  # noqa: BLE001
            out[i] = e
            continue
        if x is not None:  # a skipped target's fields
            x["ctas"] = ctas[i]
    for i in reps:
        if out[i] is not None:
            continue
        fn, n_calls, nbytes, to_host = calls[i]
        try:
            m = _result(args, fn, n_calls, nbytes, to_host, memcpy, gemm, statistics.median(times[i]), reps[i])
            out[i] = {**m, "ctas": ctas[i]} if i in ctas else m
        except Exception as e:  # noqa: BLE001
            out[i] = e
    assert all(x is not None for x in out)  # every target timed, skipped or failed
    return cast(list[dict[str, Any] | Exception], out)


def _result(args: argparse.Namespace, fn: Callable[[], Any], calls: int, nbytes: int, to_host: bool, memcpy: _Memcpy,
            gemm: bool, ms: float, reps: int) -> dict[str, Any]:
    """A timed target's fields: its speed from ``ms``, then its host time and GEMM slowdown, measured now."""
    base = memcpy.gbps(nbytes, to_host, args.reps)
    gbps = nbytes / ms / 1e6
    out = {"status": "ok", "ms": ms, "gbps": gbps, "memcpy_gbps": base, "ratio": gbps / base,
           "host_us": _host_us(fn, max(5, reps // 2)) / calls, "gemm_slowdown": _gemm_slowdown(fn) if gemm else None,
           "note": None if reps == args.reps else f"{reps} reps"}
    if gemm:  # the other side of the SMs' sharing: the transfer's own speed while the GEMM runs
        out["gemm_ratio"] = nbytes / _ms_beside_gemm(fn) / 1e6 / base
    if gemm and args.hbm:
        reader = _hbm_reader()
        out["hbm_slowdown"] = _neighbor_slowdown(fn, reader)
        out["hbm_ratio"] = nbytes / _ms_beside(fn, reader) / 1e6 / base
    return out


class _Writer:
    """Rewrites ``<out>/peers.json`` after every row, so a killed run keeps its rows."""

    def __init__(self, out: str, meta: dict[str, Any], progress: Callable[[str], None]) -> None:
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, JSON_NAME)
        self.rows: list[dict[str, Any]] = []
        self.meta, self.progress = meta, progress
        self._groups: list[int] = []  # per row, the target it belongs to (regroup); -1: none named

    def add(self, row: PeerRow, group: int = -1) -> None:
        self.rows.append(asdict(row))
        self._groups.append(group)
        self._write()
        self.progress(_line(self.rows[-1]))

    def regroup(self, first: int) -> None:
        """Order the rows from ``first`` on by the ``group`` they were added with, stably (the runner writes a layout's
        rows as each operation ends: this puts each target's rows together again, in operation order), and write
        them."""
        order = sorted(range(first, len(self.rows)), key=lambda i: self._groups[i])
        self.rows[first:] = [self.rows[i] for i in order]
        self._groups[first:] = [self._groups[i] for i in order]
        self._write()

    def _write(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1, default=str)


def _line(r: dict[str, Any]) -> str:
    head = f"{r['peer']} {r['variant']} {r['layout']} {r['shape']} n={r['tokens']} {r['op']}"
    if r["status"] != "ok":
        return f"{head}: {r['status'].upper()} {r['error'] or r['note'] or ''}"[:600]
    gemm = f" gemm {r['gemm_slowdown'] * 100:+.1f}%" if r["gemm_slowdown"] is not None else ""
    if r.get("gemm_ratio") is not None:
        gemm += f", ratio beside it {r['gemm_ratio']:.3f}"
    if r.get("hbm_slowdown") is not None:
        gemm += f" hbm-reader {r['hbm_slowdown'] * 100:+.1f}%, ratio beside it {r['hbm_ratio']:.3f}"
    return f"{head}: {r['gbps']:.1f} GB/s ratio {r['ratio']:.3f} CTAs {r['ctas']} host {r['host_us']:.0f}us{gemm}"


@dataclass
class _Live:
    """A target that passed its bit-exact check, with its operations' calls (:data:`OpCall`); ``group``: its place in
    the layout's list of targets (its rows are regrouped by it)."""

    target: Any
    base: dict[str, Any]
    calls: dict[str, OpCall]
    group: int


def _build_target(ts: TargetSpec, ctx: Ctx, truth: HostKVPool, idx: dict[str, torch.Tensor], base: dict[str, Any],
                  writer: _Writer, group: int) -> _Live | None:
    """Build ``ts`` on the shared buffers and check it bit-exact; a target that fails either gets its row here."""
    spec = ctx.spec
    try:
        target = ts.build(ctx)
        h = idx["h_contig"] if target.contiguous_host else idx["h"]
        check_bit_exact(target, truth, ctx.dev, h, idx["s"], idx["d"], label=f"{ts.peer} {ts.variant}")
    except PeerMismatch as e:
        writer.add(PeerRow(**base, op="-", status="mismatch", bit_exact=False, error=str(e)), group)
        return None
    except Exception as e:  # noqa: BLE001
        writer.add(PeerRow(**base, op="-", status="error", error=f"{type(e).__name__}: {e}"), group)
        return None
    layers = spec.layer_map.device_layers
    mid = layers[len(layers) // 2]
    total = spec.bytes_per_token * spec.capacity

    def burst() -> None:
        for layer in layers:
            target.load_layer(layer, h, idx["d"])

    def turns(d: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The same values in tensors the target has not seen (more pairs than any memo keeps), as each batch brings
        them, made at the first call: a target holds them only for the operations that run."""
        pairs: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

        def take() -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal pairs
            if pairs is None:
                pairs = itertools.cycle([(h.clone(), d.clone()) for _ in range(NEW_INDEX_PAIRS)])
            return next(pairs)
        return take

    load_pair, backup_pair = turns(idx["d"]), turns(idx["s"])

    def burst_new() -> None:
        hn, dn = load_pair()
        for layer in layers:
            target.load_layer(layer, hn, dn)

    def backup_new() -> None:
        target.backup_all_layers(*backup_pair())

    return _Live(target, base, {
        "backup_all_layers": (lambda: target.backup_all_layers(h, idx["s"]), 1, total, True),
        "load_layer": (lambda: target.load_layer(mid, h, idx["d"]), 1, total // len(layers), False),
        "load_burst": (burst, len(layers), total, False),
        "load_burst_new": (burst_new, len(layers), total, False),
        "backup_new": (backup_new, 1, total, True),
    }, group)


def _run_op(args: argparse.Namespace, op: str, live: list[_Live], spec: PoolSpec, memcpy: _Memcpy, writer: _Writer,
            deadline: float) -> None:
    """One operation of every live target of a layout, timed in turns (:func:`_measure_op`), a row per target."""
    timed = []
    for t in live:
        if op not in t.target.ops_supported:
            writer.add(PeerRow(**t.base, op=op, status="unsupported", note=f"{t.base['peer']} has no {op} here"),
                       t.group)
        elif time.monotonic() > deadline:
            writer.add(PeerRow(**t.base, op=op, status="skipped", bit_exact=True, note="time budget"), t.group)
        else:
            timed.append(t)
    if not timed:
        return
    gemm = op in args.gemm_ops and spec.capacity <= args.gemm_max_tokens
    # the CTA count asks the target (auto: its route for the last call), which may raise: an error row, as a call's
    results = _measure_op(args, [t.calls[op] for t in timed], memcpy, gemm,
                          served=[functools.partial(t.target.ctas, op) for t in timed])
    for t, m in zip(timed, results):
        if isinstance(m, Exception):
            row = PeerRow(**t.base, op=op, status="error", bit_exact=True, error=f"{type(m).__name__}: {m}")
        else:
            note = "; ".join(x for x in (getattr(t.target, "note", None), m.pop("note")) if x) or None
            row = PeerRow(**t.base, op=op, bytes=t.calls[op][2], bit_exact=True, note=note, **m)
        writer.add(row, t.group)


def _meta(args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "notes": notes,
            "args": {k: v for k, v in vars(args).items() if k != "func"}}


def run_peers(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run the grid of ``args`` (see :func:`add_arguments`); returns the rows written to ``peers.json``.  CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("the peer benchmark needs a CUDA device")
    say = progress or (lambda msg: print(f"[peers] {msg}", file=sys.stderr, flush=True))
    deadline = time.monotonic() + args.time_budget
    reg = create_registry()
    notes = [f"io_backend {b!r} is not registered here; its rows are skipped"
             for b in args.io_backends if b not in reg.io_backends]
    device = torch.device("cuda")
    grid = plan_grid(args.cells, args.layouts)
    specs = {(shape, n): SHAPES[shape](n, args.page_size, device) for shape, n, _ in grid}
    kit = None
    if "sglang" in args.peers:
        keys = peer_sglang.module_keys(list(specs.values()), args.sglang_quotas, args.sglang_tma_quotas)
        kit = peer_sglang.prepare(keys, say)
    lm = peer_lmcache.load_ops() if "lmcache" in args.peers else None
    if lm is not None:
        notes.append(f"lmcache ops: {getattr(lm[0], '__file__', None) or lm[1]}")
    writer = _Writer(args.out, _meta(args, notes), say)
    for note in notes:
        say(note)
    memcpy = _Memcpy()
    gen = torch.Generator().manual_seed(0)
    for (shape, n), spec in specs.items():
        layouts = [lay for s, t, lay in grid if (s, t) == (shape, n)]
        try:
            dev = _device_buffers(spec, 2 * n + args.page_size) if time.monotonic() < deadline else {}
            h, s, d = _indices(spec, gen)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: the next cell may fit)
            _cell_failed(writer, spec, shape, layouts, e)
            continue
        idx = {"h": h, "s": s, "d": d, "h_contig": torch.arange(n, device=spec.device)}
        for layout in layouts:
            try:
                _run_layout(args, reg, kit, lm, spec, shape, layout, dev, idx, memcpy, writer, deadline)
            except Exception as e:  # noqa: BLE001
                _cell_failed(writer, spec, shape, [layout], e)
        del dev
        torch.cuda.empty_cache()
    say(f"done: {len(writer.rows)} rows in {writer.path}")
    return writer.rows


def _common(spec: PoolSpec, shape: str, layout: str) -> dict[str, Any]:
    return {"layout": layout, "shape": shape, "kind": _describe(spec), "tokens": spec.capacity,
            "page_size": spec.page_size}


def _cell_failed(writer: _Writer, spec: PoolSpec, shape: str, layouts: list[str], e: Exception) -> None:
    for layout in layouts:
        writer.add(PeerRow(peer="*", variant="*", op="-", status="error", error=f"{type(e).__name__}: {e}",
                           **_common(spec, shape, layout)))


def _run_layout(args: argparse.Namespace, reg: Registry, kit: Any, lm: Any, spec: PoolSpec, shape: str, layout: str,
                dev: dict[str, list[torch.Tensor | None]], idx: dict[str, torch.Tensor], memcpy: _Memcpy,
                writer: _Writer, deadline: float) -> None:
    common = _common(spec, shape, layout)
    if layout not in reg.layouts:
        writer.add(PeerRow(peer="*", variant="*", op="-", status="error", **common,
                           error=f"layout {layout!r} is not installed; installed: {sorted(reg.layouts)}"))
        return
    targets = (_our_targets(args, reg, spec, layout) if "hicache" in args.peers else []) \
        + _sglang_targets(args, kit, layout) + _lmcache_targets(lm, layout)
    if time.monotonic() > deadline:
        for ts in targets:
            writer.add(PeerRow(peer=ts.peer, variant=ts.variant, op="-", status="skipped", note="time budget", **common))
        return
    plan = reg.layout(layout).plan(spec)
    fused = layout == "layer_first" and spec.kind == "mha"  # LMCache's [2, L, S, row] memory object
    pin = spec.device.type == "cuda"
    host = peer_lmcache.fused_host(spec, pin=pin) if fused else allocate_host_buffers(plan, pin_memory=pin)
    truth = HostKVPool(spec, layout, "reference", dev, host_buffers=allocate_host_buffers(plan, pin_memory=False),
                       registry=reg)
    ctx = Ctx(spec, layout, dev, host, reg)
    first = len(writer.rows)
    live: list[_Live] = []
    try:
        for group, ts in enumerate(targets):
            base = {"peer": ts.peer, "variant": ts.variant, **common}
            if time.monotonic() > deadline:
                writer.add(PeerRow(**base, op="-", status="skipped", note="time budget"), group)
                continue
            built = _build_target(ts, ctx, truth, idx, base, writer, group)
            sync(spec.device)
            if built is not None:
                live.append(built)
        for op in args.ops:
            _run_op(args, op, live, spec, memcpy, writer, deadline)
            sync(spec.device)
    finally:  # the rows of this layout, one target's after another's (as the targets were listed), each in --ops order
        writer.regroup(first)


# -- output ---------------------------------------------------------------------------
def _fmt(v: Any, spec: str) -> str:
    return "" if v is None else format(v, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (columns as in docs/performance.md's peer section)."""
    hbm = any(r.get("hbm_slowdown") is not None for r in rows)  # --hbm's two columns, where it ran
    beside = any(r.get("gemm_ratio") is not None for r in rows)  # the ratio beside the GEMM, where measured
    head = ("| peer | layout | kind/rows | tokens | op | CTAs/programs | GB/s | ratio to memcpy | GEMM slowdown % "
            + ("| ratio beside the GEMM " if beside else "")
            + ("| HBM-reader slowdown % | ratio beside it " if hbm else "") + "| host µs/call | bit-exact |")
    lines = [head, "|" + "---|" * (11 + beside + 2 * hbm)]
    for r in rows:
        exact = {True: "yes", False: "**no**", None: ""}[r["bit_exact"]]
        if r["status"] == "ok":
            cells = [_fmt(r["ctas"], "d") if r["ctas"] is not None else "?", _fmt(r["gbps"], ".1f"),
                     _fmt(r["ratio"], ".3f"),
                     _fmt(r["gemm_slowdown"] * 100 if r["gemm_slowdown"] is not None else None, "+.1f")]
            if beside:
                cells.append(_fmt(r.get("gemm_ratio"), ".3f"))
            if hbm:
                slow = r.get("hbm_slowdown")
                cells += [_fmt(slow * 100 if slow is not None else None, "+.1f"), _fmt(r.get("hbm_ratio"), ".3f")]
            cells.append(_fmt(r["host_us"], ".1f"))
        else:
            why = (r["error"] or r["note"] or "").replace("|", "/").replace("\n", " ")[:160]
            cells = [f"{r['status']}: {why}"] + [""] * (4 + beside + 2 * hbm)
        lines.append(f"| {r['peer']} {r['variant']} | {r['layout']} | {r['kind']} | {r['tokens']} | {r['op']} | "
                     + " | ".join(cells) + f" | {exact} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_cuda(__file__)
    rows = run_peers(args)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

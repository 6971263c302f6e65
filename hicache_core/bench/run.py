"""The benchmark's runner: :func:`run_bench` over the grid of shapes, page sizes, token counts, strategies and
their variants: per cell and layout it builds and checks every pool (:func:`_build`), then times each operation of
them all in turns (:func:`_measure`), with what it measures per pool (:func:`_timed_calls`) and the candidate that
served it (:func:`_served_by`).  It calls the clocks and the workload through their modules (``timing._samples_ms``,
``workload._check``), so that replacing one there reaches every caller."""

from __future__ import annotations

import functools
import itertools
import logging
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..backends.auto_rules import BACKUP_ROOM
from ..pool import HostKVPool, allocate_host_buffers
from ..registry import Registry, create_registry
from ..spec import PoolSpec
from . import timing, workload
from .shapes import DEFAULT_ROUNDS, DIRECT_VARIANTS, GEMM_OPS, HBM_LONE_OPS, MAX_DIRECT_COPIES, OPS, SHAPES, BenchRow

logger = logging.getLogger(__package__)  # hicache_core.bench: the name its records had before bench was a package


def _served_by(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, layer: int | None,
               to_host: bool, lone: bool = False) -> tuple[str, int | None]:
    """The strategy serving this call (for ``auto``: its candidate, and the host's pace it measured) and the most
    programs one of its kernel launches runs (:meth:`~hicache_core.rowcopy.RowKernelStrategy.launch_grid`; ``None``
    where the serving strategy launches no row kernel of its own, e.g. the copy engine).  ``lone``: the calls went
    by ``auto``'s lone-load rule (its ``lone_kernel_loads`` counted them), which serves them with its kernel
    candidate whatever ``pick()`` memoised for the pair: that candidate is named."""
    pick = getattr(pool.strategy, "pick", None)
    kernel = getattr(pool.strategy, "kernel", None) if lone and pick is not None else None
    chosen = kernel if kernel is not None else pool.strategy if pick is None else \
        pick(pool.binding, h, d, layer, to_host=to_host)
    grid = getattr(chosen, "launch_grid", None)
    programs = None if grid is None else grid(pool.binding, int(h.numel()), layer, to_host=to_host)
    if pick is None:
        return pool.strategy_name, programs
    name = "direct" if chosen is getattr(pool.strategy, "direct", None) else getattr(pool.strategy, "kernel_name", "kernel")
    seen = []
    for attr, what in (("paces", "planning"), ("warm_paces", "plan reused")):
        paces = getattr(pool.strategy, attr, None)
        desc_us = None if paces is None else paces[to_host].desc_us
        if desc_us is not None:
            seen.append(f"{desc_us:.2f} {what}")
    return (name if not seen else f"{name} (host us per descriptor: {', '.join(seen)})"), programs


def _targets(reg: Registry, spec: PoolSpec, layouts: Iterable[str] | None, backends: Iterable[str]) -> list[tuple[str, str, str]]:
    out = []
    for layout in sorted(layouts or reg.layouts):
        for backend in backends:
            for info in reg.candidates(layout, backend, spec.sharded):
                res, _ = reg.try_resolve(spec, layout, backend, override=info.name)
                if res is not None:
                    out.append((layout, backend, info.name))
    return out


def _configs(backend: str, programs: list[int | None], direct_variants: list[str]) -> list[tuple[str, dict[str, Any] | None]]:
    """(variant label, strategy options) to measure for one backend."""
    if backend == "kernel":
        return [(f"P={p}" if p else "P=default", {"programs": p} if p else None) for p in programs]
    if backend == "direct":
        return [(v if v == "unpitched" else f"staging={v}", DIRECT_VARIANTS[v]) for v in direct_variants]
    if backend == "auto":  # the default; the block-size rule alone for lone loads; the calibration alone for host speed;
        # a forward pass bound by memory beside the loads (the others pinned to the default's, whatever the environment)
        room: dict[str, Any] = {"backup_room": BACKUP_ROOM}
        compute = {"forward": "compute", **room}
        return [("", compute), ("lone=off", {"lone": False, **compute}), ("pace=off", {"pace": False, **compute}),
                ("forward=memory", {"forward": "memory", **room}), ("forward=watch", {"forward": "watch", **room})]
    return [("", None)]


def _uneven(tokens: Iterable[int], page_sizes: Iterable[int]) -> str:
    """What is wrong with a grid whose token counts are not whole pages of every page size ('' when none is)."""
    sizes = list(page_sizes)
    bad = [f"{n} tokens at page size {ps}" for n in tokens for ps in sizes if n % ps]
    return f"not so for {', '.join(bad)} (a pool holds whole pages)" if bad else ""


@dataclass
class _Target:
    """One pool of a cell's layout, built and checked bit-exact, with its calls (:func:`_timed_calls`)."""

    backend: str
    name: str
    variant: str
    budget: int | None
    pool: HostKVPool
    bursts: dict[str, list[Callable[[], Any]]]
    calls: dict[str, _Call]


def run_bench(
    *,
    shapes: list[str],
    tokens: list[int],
    page_sizes: list[int],
    programs: list[int | None],
    layouts: list[str] | None = None,
    backends: list[str] = ("kernel", "direct"),  # type: ignore[assignment]
    ops: list[str] = OPS,  # type: ignore[assignment]
    reps: int = 20,
    rounds: int = DEFAULT_ROUNDS,
    gemm: bool = False,
    hbm: bool = False,
    direct_variants: list[str] = ("auto",),  # type: ignore[assignment]
    variants: Iterable[str] | None = None,
    registry: Registry | None = None,
    progress: Callable[[str], None] | None = None,
    sink: Callable[[BenchRow], None] | None = None,
    memcpy: timing.MemcpyReference | None = None,
) -> list[BenchRow]:
    """Measure; see :mod:`hicache_core.bench`.  CUDA only.

    Per cell (shape, page size, token count) and layout, every pool (strategy and variant) is built over the same host
    buffers and checked bit-exact first; then per operation their ``reps`` timed calls are taken in turns over
    ``rounds`` rounds (:func:`.timing._in_turns`), and each pool's host time and neighbours' slowdowns are measured
    after all of them.  Rows come operation by operation, each pool's in the order the pools were built.  ``variants``:
    build only the configurations with these labels (:func:`_configs`; e.g. ``["P=default"]``, ``["lone=off"]``).
    ``memcpy``: the memcpy reference every ratio divides by, measured once per size and direction and kept; pass the same
    one to several calls (a probe that makes one call per pool) so that their ratios share one baseline (default: a
    new one for this call)."""
    uneven = _uneven(tokens, page_sizes)
    if uneven:  # before anything is measured: the grid would stop with a SpecError at the first such cell
        raise ValueError(f"every token count must be a multiple of every page size; {uneven}")
    if reps < 1 or rounds < 1:
        raise ValueError(f"reps ({reps}) and rounds ({rounds}) must be at least 1")
    if not torch.cuda.is_available():
        raise RuntimeError("hicache bench needs a CUDA device")
    reg = registry or create_registry()
    reference = memcpy if memcpy is not None else timing._Memcpy()
    clocks = _Clocks(reference, timing._LinkWarmer(), timing._hbm_reader() if hbm else None)
    gen = torch.Generator().manual_seed(0)
    rows: list[BenchRow] = []
    for shape in shapes:
        for ps in page_sizes:
            for n in tokens:
                spec = SHAPES[shape](n, ps, torch.device("cuda"))
                torch.cuda.empty_cache()
                dev = workload._device_buffers(spec, 2 * n + ps)
                h, s, d = workload._indices(spec, gen)
                targets = _targets(reg, spec, layouts, backends)
                for layout in dict.fromkeys(t[0] for t in targets):
                    cell = _Cell(shape, ps, n, spec, layout, dev, h, s, d)
                    live = _build(reg, cell, [t[1:] for t in targets if t[0] == layout], ops, programs,
                                  list(direct_variants), None if variants is None else set(variants))
                    for op in ops:
                        for row in _measure(live, op, cell, reps, rounds, gemm, clocks):
                            rows.append(row)
                            if sink:
                                sink(row)
                            if progress:
                                progress(_line(row))
                    # the calls hold the pools and their buffers, the cell the device buffers: all dropped before the
                    # next layout, and before the next cell allocates its own
                    del live, cell
                del dev
    return rows


@dataclass
class _Cell:
    """One layout of a grid cell: its shape's name, page size, token count, spec, device buffers and indices."""

    shape: str
    page_size: int
    tokens: int
    spec: PoolSpec
    layout: str
    dev: Any
    h: torch.Tensor
    s: torch.Tensor
    d: torch.Tensor


@dataclass
class _Clocks:
    """What every row of a run measures against: the memcpy reference, the link warm-up, the memory-bound reader."""

    memcpy: timing.MemcpyReference
    warm_link: Callable[[], object]
    reader: Callable[[], object] | None


def _build(reg: Registry, cell: _Cell, entries: list[tuple[str, str]], ops: list[str], programs: list[int | None],
           direct_variants: list[str], variants: set[str] | None = None) -> list[_Target]:
    """The pools of one layout in a cell (``entries``: io_backend and strategy name; ``variants``: the configuration
    labels to build, ``None`` for all), over one set of host buffers,
    each checked bit-exact before any is timed (``direct`` left out where a call would take more than
    :data:`MAX_DIRECT_COPIES` copies).  They are all alive until the layout's operations are measured: their own
    memory (plans, a staged route's bounded device buffer) adds up, the host and device buffers do not."""
    spec, n, ps, h, s, d = cell.spec, cell.tokens, cell.page_size, cell.h, cell.s, cell.d
    copies = n // ps * spec.bytes_per_token // max(1, min(c.row_bytes for c in spec.components))
    host = None
    live: list[_Target] = []
    for backend, name in entries:
        if backend == "direct" and copies > MAX_DIRECT_COPIES:
            logger.info("skipping %s at page_size %d, %d tokens: ~%d copies per call", name, ps, n, copies)
            continue
        configs = [(v, o) for v, o in _configs(backend, programs, direct_variants) if variants is None or v in variants]
        if configs and host is None:  # one set per layout: every strategy of it reads and writes the same host layout
            host = allocate_host_buffers(reg.layout(cell.layout).plan(spec), pin_memory=True)
        for variant, opts in configs:
            pool = HostKVPool(spec, cell.layout, backend, cell.dev, host_buffers=host, strategy=name,
                              strategy_options=opts, registry=reg, validate="shapes")
            workload._check(pool, cell.dev, h, s, d, ops)
            bursts, calls = _timed_calls(pool, n, h, s, d)
            live.append(_Target(backend, name, variant, opts.get("programs") if opts else None, pool, bursts, calls))
    return live


def _measure(live: list[_Target], op: str, cell: _Cell, reps: int, rounds: int, gemm: bool,
             clocks: _Clocks) -> list[BenchRow]:
    """One operation of every pool of a layout: their timed calls in turns, then what served each (asked before any
    other call runs: the neighbours can change ``auto``'s verdict, e.g. its watch beside the reduction), then each
    pool's host time (before its neighbours run: what they leave behind must not reach it) and neighbours."""
    if not live:
        return []
    h, s, d = cell.h, cell.s, cell.d
    clocks.warm_link()  # every operation from the same state, whatever ran before it
    fns = [t.calls[op][0] for t in live]
    lone0 = [getattr(t.pool.strategy, "lone_kernel_loads", 0) for t in live]
    times, made = timing._in_turns(fns, reps, rounds)
    served = []
    for t, before, made_calls in zip(live, lone0, made):
        _, _, to_host, lay = t.calls[op]
        calls = made_calls * len(t.bursts.get(op, [None]))  # one-layer calls: a burst's count as one each
        lone = getattr(t.pool.strategy, "lone_kernel_loads", 0) - before
        who, launched = _served_by(t.pool, h, s if to_host else d, lay, to_host, lone=2 * lone > calls)
        served.append((who + (f" ({lone} lone loads by the kernel in {calls} calls)" if lone else ""), launched))
    rows = []
    for t, samples, (who, launched) in zip(live, times, served):
        fn, nbytes, to_host, _ = t.calls[op]
        ms = statistics.median(samples)
        base = clocks.memcpy.gbps(nbytes, to_host, reps)
        gbps = nbytes / ms / 1e6
        host_us = (timing._burst_host_us(t.bursts[op], max(3, reps // 4)) if op in t.bursts
                   else timing._host_us(fn, max(5, reps // 2)))
        slow = gemm_ratio = None
        if gemm and op in GEMM_OPS:
            slow = timing._gemm_slowdown(fn)
            gemm_ratio = nbytes / timing._ms_beside_gemm(fn) / 1e6 / base
        hbm_slow = hbm_ratio = None
        if clocks.reader is not None and op in GEMM_OPS + HBM_LONE_OPS:
            lone_op = op in HBM_LONE_OPS
            hbm_slow = None if lone_op else timing._neighbor_slowdown(fn, clocks.reader)
            hbm_ratio = nbytes / timing._ms_beside(fn, clocks.reader, calls=1 if lone_op else 3) / 1e6 / base
        rows.append(BenchRow(cell.shape, cell.layout, t.backend, t.name, cell.page_size, cell.tokens, t.budget, op,
                             nbytes, ms, gbps, base, gbps / base, host_us, slow, t.variant, who,
                             hbm_slowdown=hbm_slow, hbm_ratio=hbm_ratio, gemm_ratio=gemm_ratio,
                             launched_programs=launched))
    return rows


def _line(row: BenchRow) -> str:
    """A row's progress line."""
    slow, hbm_slow, hbm_ratio = row.gemm_slowdown, row.hbm_slowdown, row.hbm_ratio
    return (f"{row.shape} {row.layout}/{row.io_backend} {row.variant} ps={row.page_size} n={row.tokens} {row.op}: "
            f"{row.gbps:.1f} GB/s ratio {row.ratio:.3f} host {row.host_us:.0f}us"
            + (f" gemm {slow * 100:+.1f}%" if slow is not None else "")
            + (f" ratio beside gemm {row.gemm_ratio:.3f}" if row.gemm_ratio is not None else "")
            + (f" hbm-reader {hbm_slow * 100:+.1f}%" if hbm_slow is not None else "")
            + (f" ratio beside hbm-reader {hbm_ratio:.3f}" if hbm_ratio is not None else "")
            + (f" via {row.served_by}" if row.io_backend == "auto" else "")
            + (f", {row.launched_programs} programs" if row.launched_programs else ""))


def _one_pool_each(rows: list[BenchRow]) -> list[BenchRow]:
    """``rows`` as they are, where a :func:`run_bench` call meant to build one pool per layout did (no two rows of one
    shape, page size, token count, layout and op); else :class:`RuntimeError` naming them.  Probes that attribute what
    they trace to the one pool being timed (benchmarks/pace_trace.py, knob_ab.py) check with it: a layout with two
    strategies of one io_backend would give them two pools timed in turns."""
    seen: dict[tuple, str] = {}
    for r in rows:
        key = (r.shape, r.page_size, r.tokens, r.layout, r.op)
        if key in seen:
            raise RuntimeError(f"two pools timed together for {key}: {seen[key]} and {r.strategy} {r.variant}; this "
                               "probe needs one pool per run (name one strategy per io_backend)")
        seen[key] = f"{r.strategy} {r.variant}"
    return rows


#: One timed call of an op: the call, the bytes it moves, whether to the host, the layer it names (None: all).
_Call = tuple[Callable[[], Any], int, bool, int | None]


def _timed_calls(pool: HostKVPool, n: int, h: torch.Tensor, s: torch.Tensor, d: torch.Tensor
                 ) -> tuple[dict[str, list[Callable[[], Any]]], dict[str, _Call]]:
    """The bursts (``load_burst``: one ``load_layer`` per owned layer; ``backup_burst``: one ``backup_layer`` per owned
    layer) and, per op, its call, bytes moved, direction (to host) and the layer it names (``None`` for all-layer ops),
    over host indices ``h``, source slots ``s`` and device slots ``d``.

    ``load_layer`` loads the middle owned layer every call; ``backup_layer`` backs up that layer first, then the next
    owned layer each call, round the pool (one layer every call would read rows the L2 cache still holds).  Both name
    the middle layer: what served a row (:func:`_served_by`) is asked for it, all layers being the same size."""
    spec = pool.spec
    owned = spec.layer_map.device_layers
    mid = len(owned) // 2
    layer0 = owned[mid]
    per_layer = spec.bytes_per_token // len(owned) * n
    bursts: dict[str, list[Callable[[], Any]]] = {
        "load_burst": [functools.partial(pool.load_layer, lay, h, d) for lay in owned],
        "backup_burst": [functools.partial(pool.backup_layer, lay, h, s) for lay in owned]}
    layers = itertools.cycle(owned[mid:] + owned[:mid])
    return bursts, {
        "backup_all_layers": (lambda: pool.backup_all_layers(h, s), spec.bytes_per_token * n, True, None),
        "backup_layer": (lambda: pool.backup_layer(next(layers), h, s), per_layer, True, layer0),
        "load_layer": (lambda: pool.load_layer(layer0, h, d), per_layer, False, layer0),
        "load_all_layers": (lambda: pool.load_all_layers(h, d), spec.bytes_per_token * n, False, None),
        "load_burst": (lambda: [f() for f in bursts["load_burst"]], spec.bytes_per_token * n, False, layer0),
        "backup_burst": (lambda: [f() for f in bursts["backup_burst"]], spec.bytes_per_token * n, True, layer0),
    }

"""The benchmark's runner: :func:`run_bench` over the grid of shapes, page sizes, token counts, strategies and
their variants, with what it measures per pool (:func:`_timed_calls`) and the candidate that served it
(:func:`_served_by`).  It calls the clocks and the workload through their modules (``timing._median_ms``,
``workload._check``), so that replacing one there reaches every caller."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

import torch

from ..backends.auto_rules import BACKUP_ROOM
from ..pool import HostKVPool, allocate_host_buffers
from ..registry import Registry, create_registry
from ..spec import PoolSpec
from . import timing, workload
from .shapes import DIRECT_VARIANTS, GEMM_OPS, HBM_LONE_OPS, MAX_DIRECT_COPIES, OPS, SHAPES, WARMUP, BenchRow

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
    gemm: bool = False,
    hbm: bool = False,
    direct_variants: list[str] = ("auto",),  # type: ignore[assignment]
    registry: Registry | None = None,
    progress: Callable[[str], None] | None = None,
    sink: Callable[[BenchRow], None] | None = None,
) -> list[BenchRow]:
    """Measure; see :mod:`hicache_core.bench`.  CUDA only."""
    uneven = _uneven(tokens, page_sizes)
    if uneven:  # before anything is measured: the grid would stop with a SpecError at the first such cell
        raise ValueError(f"every token count must be a multiple of every page size; {uneven}")
    if not torch.cuda.is_available():
        raise RuntimeError("hicache bench needs a CUDA device")
    reg = registry or create_registry()
    memcpy = timing._Memcpy()
    warm_link = timing._LinkWarmer()
    reader = timing._hbm_reader() if hbm else None
    gen = torch.Generator().manual_seed(0)
    rows: list[BenchRow] = []
    dev_cache: dict[tuple[str, int, int], Any] = {}
    for shape in shapes:
        for ps in page_sizes:
            for n in tokens:
                spec = SHAPES[shape](n, ps, torch.device("cuda"))
                dev_cache.clear()
                torch.cuda.empty_cache()
                dev = workload._device_buffers(spec, 2 * n + ps)
                h, s, d = workload._indices(spec, gen)
                for layout, backend, name in _targets(reg, spec, layouts, backends):
                    copies = n // ps * spec.bytes_per_token // max(1, min(c.row_bytes for c in spec.components))
                    if backend == "direct" and copies > MAX_DIRECT_COPIES:
                        logger.info("skipping %s at page_size %d, %d tokens: ~%d copies per call", name, ps, n, copies)
                        continue
                    plan = reg.layout(layout).plan(spec)
                    host = allocate_host_buffers(plan, pin_memory=True)
                    for variant, opts in _configs(backend, programs, list(direct_variants)):
                        budget = opts.get("programs") if opts else None
                        pool = HostKVPool(spec, layout, backend, dev, host_buffers=host, strategy=name,
                                          strategy_options=opts, registry=reg, validate="shapes")
                        workload._check(pool, dev, h, s, d, ops)
                        burst, calls = _timed_calls(pool, n, h, s, d)
                        fn: Callable[[], Any] | None = None
                        for op in ops:
                            fn, nbytes, to_host, lay = calls[op]
                            warm_link()  # every row from the same state, whatever ran before it
                            lone = getattr(pool.strategy, "lone_kernel_loads", 0)
                            ms = timing._median_ms(fn, reps)
                            lone = getattr(pool.strategy, "lone_kernel_loads", 0) - lone
                            # the candidate that served the timed calls, asked before anything else runs (the
                            # neighbours below can change auto's verdict, e.g. its watch beside the reduction)
                            served, launched = _served_by(pool, h, s if to_host else d, lay, to_host,
                                                          lone=2 * lone > reps + WARMUP)
                            served += f" ({lone} lone loads by the kernel in {reps + WARMUP} calls)" if lone else ""
                            base = memcpy.gbps(nbytes, to_host, reps)
                            gbps = nbytes / ms / 1e6
                            # host time before the neighbours run: what they leave behind (e.g. auto's watch
                            # verdict beside the reduction) must not reach it
                            host_us = (timing._burst_host_us(burst, max(3, reps // 4)) if op == "load_burst"
                                       else timing._host_us(fn, max(5, reps // 2)))
                            slow = timing._gemm_slowdown(fn) if gemm and op in GEMM_OPS else None
                            hbm_slow = hbm_ratio = None
                            if reader is not None and op in GEMM_OPS + HBM_LONE_OPS:
                                lone_op = op in HBM_LONE_OPS
                                hbm_slow = None if lone_op else timing._neighbor_slowdown(fn, reader)
                                hbm_ratio = nbytes / timing._ms_beside(fn, reader, calls=1 if lone_op else 3) / 1e6 / base
                            row = BenchRow(shape, layout, backend, name, ps, n, budget, op, nbytes, ms, gbps, base,
                                           gbps / base, host_us, slow, variant, served,
                                           hbm_slowdown=hbm_slow, hbm_ratio=hbm_ratio, launched_programs=launched)
                            rows.append(row)
                            if sink:
                                sink(row)
                            if progress:
                                progress(f"{shape} {layout}/{backend} {variant} ps={ps} n={n} {op}: "
                                         f"{gbps:.1f} GB/s ratio {row.ratio:.3f} host {row.host_us:.0f}us"
                                         + (f" gemm {slow * 100:+.1f}%" if slow is not None else "")
                                         + (f" hbm-reader {hbm_slow * 100:+.1f}%" if hbm_slow is not None else "")
                                         + (f" ratio beside hbm-reader {hbm_ratio:.3f}" if hbm_ratio is not None else "")
                                         + (f" via {row.served_by}" if backend == "auto" else "")
                                         + (f", {launched} programs" if launched else ""))
                        fn = None  # the calls hold the pool (and its buffers): drop them all before the next one
                        del pool, burst, calls
                    del host
                del dev
    return rows


def _timed_calls(pool: HostKVPool, n: int, h: torch.Tensor, s: torch.Tensor, d: torch.Tensor
                 ) -> tuple[list[Callable[[], Any]], dict[str, tuple[Callable[[], Any], int, bool, int | None]]]:
    """The burst (one ``load_layer`` per owned layer) and, per op, its call, bytes moved, direction (to host) and the
    layer it names (``None`` for all-layer ops), over host indices ``h``, source slots ``s`` and device slots ``d``."""
    spec = pool.spec
    owned = spec.layer_map.device_layers
    layer0 = owned[len(owned) // 2]
    per_layer = spec.bytes_per_token // len(owned) * n
    burst: list[Callable[[], Any]] = [functools.partial(pool.load_layer, lay, h, d) for lay in owned]
    return burst, {
        "backup_all_layers": (lambda: pool.backup_all_layers(h, s), spec.bytes_per_token * n, True, None),
        "backup_layer": (lambda: pool.backup_layer(layer0, h, s), per_layer, True, layer0),
        "load_layer": (lambda: pool.load_layer(layer0, h, d), per_layer, False, layer0),
        "load_all_layers": (lambda: pool.load_all_layers(h, d), spec.bytes_per_token * n, False, None),
        "load_burst": (lambda: [f() for f in burst], spec.bytes_per_token * n, False, layer0),
    }

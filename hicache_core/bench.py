"""``hicache bench``: throughput of every installed strategy against pinned memcpy of the same bytes.

For each shape, layout, io_backend, page size, token count, SM budget and
operation it reports GB/s, the ratio to a pinned ``copy_`` of the same number
of bytes in the same direction measured in the same run, the host time per
call, and (optionally) the slowdown of a bf16 GEMM on another stream while a
transfer runs (``--gemm``), and of a memory-bound reduction, with the transfer's own speed beside it
(``--hbm``).  Data are checked bit-exact (round trip against the original
rows) before timing.  Results go to ``<out>/bench.json``; ``--plot`` renders
``<out>/bench.png`` (ratio vs tokens per strategy) when matplotlib is present.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from .backends.auto_rules import BACKUP_ROOM
from .jsonfile import check_writable, write_json
from .pool import HostKVPool, allocate_host_buffers
from .registry import Registry, create_registry
from .spec import LayerMap, PoolSpec
from .testing.conformance import DEVICE_PLACEMENTS

__all__ = ["SHAPES", "BenchRow", "run_bench", "add_parser", "main"]

logger = logging.getLogger(__name__)


def _mla(layers: int, dtype: torch.dtype, row_bytes: int | None = None) -> Callable[[int, int, torch.device], PoolSpec]:
    def build(tokens: int, ps: int, device: torch.device) -> PoolSpec:
        return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype,
                            page_size=ps, capacity=tokens, row_bytes=row_bytes, device=device)
    return build


def _mha(layers: int, heads: int, dim: int) -> Callable[[int, int, torch.device], PoolSpec]:
    def build(tokens: int, ps: int, device: torch.device) -> PoolSpec:
        return PoolSpec.mha(layer_map=LayerMap.unsharded(layers), head_num=heads, head_dim=dim, dtype=torch.bfloat16,
                            page_size=ps, capacity=tokens, device=device)
    return build


#: name -> spec builder(tokens, page_size, device)
SHAPES: dict[str, Callable[[int, int, torch.device], PoolSpec]] = {
    "mla61x576-bf16": _mla(61, torch.bfloat16),
    "mla61x576-fp8": _mla(61, torch.uint8),
    "mla61x656-fp8": _mla(61, torch.uint8, 656),
    "mha80x8x128-bf16": _mha(80, 8, 128),
    "mha80x4x128-bf16": _mha(80, 4, 128),  # 1 KiB k and v rows (4 KV heads per rank)
    "mha32x8x128-bf16": _mha(32, 8, 128),
}

#: ``direct`` submits one copy per contiguous run; above this many per call the
#: measurement would take minutes per configuration (small pages), so it is skipped.
MAX_DIRECT_COPIES = 200_000

OPS = ("backup_all_layers", "backup_layer", "load_layer", "load_all_layers", "load_burst")
#: Operations whose GEMM slowdown ``--gemm`` measures (the ones a forward pass overlaps).
GEMM_OPS = ("backup_all_layers", "load_burst")
#: ``--hbm``: ops whose ratio beside the reduction is measured one call at a time (each call lone), without the
#: reduction's slowdown (one call is too short to cover its timing windows).
HBM_LONE_OPS = ("load_layer",)
#: Bytes one call of ``--hbm``'s memory-bound neighbour reads (:func:`_hbm_reader`).
HBM_READ_BYTES = 2 << 30
#: ``direct`` variants: strategy options per label (``--direct-variants``).
DIRECT_VARIANTS = {"auto": {"staging": "auto"}, "never": {"staging": "never"}, "always": {"staging": "always"},
                   "unpitched": {"staging": "auto", "pitched": "never"}}
#: Device layer placement of the benchmark's pools (see :func:`_device_buffers`).
ENV_PLACEMENT = "HICACHE_BENCH_PLACEMENT"


@dataclass
class BenchRow:
    shape: str
    layout: str
    io_backend: str
    strategy: str
    page_size: int
    tokens: int
    programs: int | None
    op: str
    bytes: int
    ms: float
    gbps: float
    memcpy_gbps: float
    ratio: float
    host_us: float
    gemm_slowdown: float | None = None
    variant: str = ""
    served_by: str = ""
    #: ``--hbm``: the slowdown of a memory-bound reduction (:func:`_hbm_reader`) while the op runs beside it
    hbm_slowdown: float | None = None
    #: ``--hbm``: the op's own ratio to memcpy while that reduction runs without pause beside it
    hbm_ratio: float | None = None
    #: the most programs one kernel launch of the timed call ran (``programs`` is the budget asked for, ``None`` for
    #: the strategy's default); ``None`` where the serving strategy launched no row kernel (e.g. the copy engine)
    launched_programs: int | None = None


#: Untimed calls before a row's timed ones.
WARMUP = 3


def _median_ms(fn: Callable[[], object], reps: int, warmup: int = WARMUP, idle: bool = False,
               before: Callable[[], object] | None = None) -> float:
    """Median event-timed milliseconds of ``fn``; ``idle``: each call starts on an idle GPU (a lone call),
    else calls follow each other as soon as the last one's end event is reached.  ``before`` (then a
    synchronise: the call is lone) runs ahead of each timed call, untimed."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if idle or before is not None:
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _release_memory() -> None:
    """Hand the device memory and the pinned host memory that a measurement freed back to the driver and the OS: torch's
    caching allocators keep both otherwise (a calibration's pinned buffers, hundreds of MB, stayed until the process
    ended).  Blocks still referenced are kept; call it once the measurement's tensors are gone (a pool's cycles, if
    any, are collected here first)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)  # torch's own call for this; no public name yet
    if empty_host is not None:
        empty_host()


def _host_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _burst_host_us(calls: Sequence[Callable[[], object]], reps: int) -> float:
    """Median host time of one call inside back-to-back bursts (no synchronisation between calls)."""
    times = []
    for _ in range(reps):
        for fn in calls:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


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


class _LinkWarmer:
    """Pinned copies both ways until the host link and copy engines are warm (buffers made once per run).

    Measured on an H200: the first transfer strategy timed in a process ran up to 10 points below
    the same strategy timed after another one (docs/performance.md, "bench order"); every row now
    starts from the same state."""

    def __init__(self, nbytes: int = 64 << 20, rounds: int = 8) -> None:
        self.nbytes, self.rounds = nbytes, rounds
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self) -> None:
        if self._bufs is None:
            self._bufs = (torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True),
                          torch.empty(self.nbytes, dtype=torch.uint8, device="cuda"))
        host, dev = self._bufs
        for _ in range(self.rounds):
            host.copy_(dev, non_blocking=True)
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()


class _Memcpy:
    """Pinned ``copy_`` of ``n`` bytes, cached per size and direction: the best of :attr:`TRIES` medians, so that a
    passing disturbance of the one measure every ratio of a run divides by does not inflate them all (``hicache
    calibrate`` once timed a 64 MB D2H memcpy at 38.9 GB/s on a host whose batched copies reached 54.2)."""

    #: Medians of ``reps`` calls timed per size and direction; the fastest is kept.
    TRIES = 3

    def __init__(self) -> None:
        self.cache: dict[tuple[int, bool], float] = {}

    def gbps(self, nbytes: int, to_host: bool, reps: int) -> float:
        key = (nbytes, to_host)
        if key not in self.cache:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            dst, src = (host, dev) if to_host else (dev, host)
            ms = min(_median_ms(lambda: dst.copy_(src, non_blocking=True), reps) for _ in range(self.TRIES))
            self.cache[key] = nbytes / ms / 1e6
        return self.cache[key]


def _gemm_slowdown(transfer: Callable[[], object], size: int = 8192, reps: int = 6, gemms: int = 4) -> float:
    """Relative slowdown of a bf16 ``size``^3 GEMM while ``transfer`` runs on another stream
    (:func:`_neighbor_slowdown`)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return _neighbor_slowdown(transfer, lambda: a @ b, reps, gemms)


@functools.lru_cache(maxsize=1)
def _hbm_reader(nbytes: int = HBM_READ_BYTES) -> Callable[[], object]:
    """A memory-bound neighbour: one reduction over ``nbytes`` of device memory (what a decode step's
    attention over the KV cache does: reads at the memory's speed, little arithmetic, almost no writes).
    One buffer per process, made on first use."""
    x = torch.ones(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.sum(x, dtype=torch.float32)


def _neighbor_slowdown(transfer: Callable[[], object], work: Callable[[], object], reps: int = 6,
                       per_window: int = 4) -> float:
    """Relative slowdown of ``work`` (a GPU op, timed in windows of ``per_window``) while ``transfer`` runs
    on another stream.

    Both run on their own non-default streams.  Windows are timed alternately alone and with enough
    back-to-back transfers queued first to cover the window, so clock drift hits both sides alike;
    medians compared.
    """
    work_stream, side, transfer_ms = _two_streams(transfer)

    def window(busy: bool) -> float:
        torch.cuda.synchronize()
        if busy:
            head = max(2, int(per_window * alone_est / max(transfer_ms, 1e-3)) + 2)
            start = time.perf_counter()
            _queue(side, transfer, head)
        e0, e1 = _queue(work_stream, work, per_window, timed=True)
        if busy:  # a transfer whose host time nears its GPU time drains what was queued before the window ends
            with torch.cuda.stream(side):
                _keep_busy(transfer, e1.query, head * transfer_ms, transfer_ms, start)
        e1.synchronize()
        side.synchronize()
        return e0.elapsed_time(e1) / per_window

    alone_est = 2.0
    alone_est = window(False)  # warm-up, and the window length estimate
    alone, busy = [], []
    for _ in range(reps):
        alone.append(window(False))
        busy.append(window(True))
    return statistics.median(busy) / statistics.median(alone) - 1.0


def _keep_busy(transfer: Callable[[], object], done: Callable[[], bool], queued_ms: float, transfer_ms: float,
               start: float, now: Callable[[], float] = time.perf_counter) -> int:
    """Issue ``transfer`` until ``done()`` (the neighbour's window has ended), whenever the GPU time queued since
    ``start`` (``queued_ms``, ``transfer_ms`` more per call) no longer leads the host's clock by a call: the
    transfer stream never runs dry during the window, however slowly the host submits, and a fast host does
    not pile up transfers past it.  Returns the calls issued."""
    calls = 0
    while not done():
        if queued_ms <= (now() - start) * 1e3 + transfer_ms:
            transfer()
            queued_ms += transfer_ms
            calls += 1
    return calls


def _ms_beside(transfer: Callable[[], object], work: Callable[[], object], reps: int = 5, calls: int = 3) -> float:
    """Median milliseconds of one ``transfer`` while ``work`` runs without pause on another stream.

    Each sample queues enough ``work`` to outlast ``calls`` transfers, then times those transfers
    back to back (events on their own stream) and waits for both streams.
    """
    work_stream, side, transfer_ms = _two_streams(transfer)
    with torch.cuda.stream(work_stream):
        work_ms = _median_ms(work, 3, warmup=1)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        _queue(work_stream, work, int(1.5 * calls * transfer_ms / max(work_ms, 1e-3)) + 2)
        e0, e1 = _queue(side, transfer, calls, timed=True)
        e1.synchronize()
        work_stream.synchronize()
        times.append(e0.elapsed_time(e1) / calls)
    return statistics.median(times)


def _two_streams(transfer: Callable[[], object]) -> tuple[torch.cuda.Stream, torch.cuda.Stream, float]:
    """A neighbour's stream, the transfer's stream, and the transfer's median milliseconds there."""
    work_stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        transfer_ms = _median_ms(transfer, 3, warmup=1)
    return work_stream, side, transfer_ms


def _queue(stream: torch.cuda.Stream, fn: Callable[[], object], n: int, timed: bool = False) -> Any:
    """Enqueue ``n`` calls of ``fn`` on ``stream``; ``timed``: between two recorded timing events (returned)."""
    e0, e1 = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timed else (None, None)
    with torch.cuda.stream(stream):
        if e0 is not None:
            e0.record()
        for _ in range(n):
            fn()
        if e1 is not None:
            e1.record()
    return e0, e1


def _device_buffers(spec: PoolSpec, rows: int, placement: str | None = None) -> dict[str, list[torch.Tensor | None]]:
    """Random per-layer device tensors; ``placement`` (default ``$HICACHE_BENCH_PLACEMENT`` or
    ``separate``): one allocation per layer as SGLang's pools make them, or the layers of one
    allocation at ascending / descending addresses (``one-allocation``, ``one-allocation-descending``)."""
    placement = placement or os.environ.get(ENV_PLACEMENT, "").strip() or "separate"
    if placement not in DEVICE_PLACEMENTS:
        raise ValueError(f"{ENV_PLACEMENT}={placement!r}: use one of {', '.join(DEVICE_PLACEMENTS)}")
    out: dict[str, list[torch.Tensor | None]] = {}
    layers = spec.layer_map.num_device_layers
    for comp in spec.components:
        items = comp.row_bytes // comp.itemsize
        if placement == "separate":
            raws = [torch.randint(0, 256, (rows, comp.row_bytes), dtype=torch.uint8, device=spec.device)
                    for _ in range(layers)]
        else:
            one = torch.randint(0, 256, (layers, rows, comp.row_bytes), dtype=torch.uint8, device=spec.device)
            raws = [one[k] for k in (range(layers) if placement == "one-allocation" else reversed(range(layers)))]
        out[comp.name] = [r.view(comp.dtype).view(rows, items) for r in raws]
    return out


def _workload(shape: str, tokens: int = 4096, page_size: int = 64,
              seed: int = 0) -> tuple[PoolSpec, dict[str, list[torch.Tensor | None]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probes' common set-up: a CUDA ``spec`` of :data:`SHAPES` ``shape``, random device layers holding
    2x the tokens, and :func:`_indices` (host slots, backup source rows, load target rows)."""
    spec = SHAPES[shape](tokens, page_size, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * tokens + page_size)
    h, s, d = _indices(spec, torch.Generator().manual_seed(seed))
    return spec, dev, h, s, d


def _indices(spec: PoolSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random host pages, random device pages for backup, other random device pages for load (on the GPU)."""
    ps, pages = spec.page_size, spec.num_pages
    offs = torch.arange(ps)
    hp = torch.randperm(pages, generator=gen)
    dp = torch.randperm(2 * pages, generator=gen)
    ex = lambda p: (p.unsqueeze(1) * ps + offs).reshape(-1)  # noqa: E731
    return ex(hp).cuda(), ex(dp[:pages]).cuda(), ex(dp[pages:]).cuda()


def _scramble(pool: HostKVPool, dev: dict[str, list[torch.Tensor | None]], s: torch.Tensor, d: torch.Tensor) -> None:
    """Make a round trip's result unmistakable: the host buffers zeroed and every byte of the load target rows ``d``
    the complement of the source rows ``s``.  Pools of one grid cell share the device and host buffers, so without
    this an earlier pool's round trip (``d`` already equal to ``s``, the host already holding ``s``) would let a
    later strategy that moves nothing pass."""
    for buf in pool.host_buffers.values():
        buf.zero_()
    for lst in dev.values():
        for t in lst:
            if t is not None:
                raw = t.view(torch.uint8)
                raw[d] = raw[s] ^ 0xFF


def _compare(pool: HostKVPool, dev: dict[str, list[torch.Tensor | None]], s: torch.Tensor, d: torch.Tensor,
             what: str) -> None:
    torch.cuda.synchronize()
    for name, lst in dev.items():
        for i, t in enumerate(lst):
            if t is not None and not torch.equal(t[s].view(torch.uint8), t[d].view(torch.uint8)):
                raise AssertionError(f"bench data check failed: {pool.strategy_name} {what} {name}[{i}]")


def _check(pool: HostKVPool, dev: dict[str, list[torch.Tensor | None]], h: torch.Tensor, s: torch.Tensor,
           d: torch.Tensor, ops: Iterable[str] = ()) -> None:
    """Round trip ``s`` -> host ``h`` -> ``d`` bit-exact: ``backup_all_layers`` then ``load_layer`` of every
    layer, and for the other ``ops`` to be timed (``backup_layer``, ``load_all_layers``) their own round trip,
    each from scrambled buffers (:func:`_scramble`)."""
    layers = pool.spec.layer_map.device_layers

    def backup_all() -> None:
        pool.backup_all_layers(h, s)

    def backup_each() -> None:
        for layer in layers:
            pool.backup_layer(layer, h, s)

    def load_each() -> None:
        for layer in layers:
            pool.load_layer(layer, h, d)

    trips = [("backup_all_layers", backup_all, "load_layer", load_each)]
    if "load_all_layers" in ops:
        trips.append(("backup_all_layers", backup_all, "load_all_layers", lambda: pool.load_all_layers(h, d)))
    if "backup_layer" in ops:
        trips.append(("backup_layer", backup_each, "load_layer", load_each))
    for backup_name, backup, load_name, load in trips:
        _scramble(pool, dev, s, d)
        backup()
        load()
        _compare(pool, dev, s, d, f"{backup_name} + {load_name}")


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
    """Measure; see the module docstring.  CUDA only."""
    uneven = _uneven(tokens, page_sizes)
    if uneven:  # before anything is measured: the grid would stop with a SpecError at the first such cell
        raise ValueError(f"every token count must be a multiple of every page size; {uneven}")
    if not torch.cuda.is_available():
        raise RuntimeError("hicache bench needs a CUDA device")
    reg = registry or create_registry()
    memcpy = _Memcpy()
    warm_link = _LinkWarmer()
    reader = _hbm_reader() if hbm else None
    gen = torch.Generator().manual_seed(0)
    rows: list[BenchRow] = []
    dev_cache: dict[tuple[str, int, int], Any] = {}
    for shape in shapes:
        for ps in page_sizes:
            for n in tokens:
                spec = SHAPES[shape](n, ps, torch.device("cuda"))
                dev_cache.clear()
                torch.cuda.empty_cache()
                dev = _device_buffers(spec, 2 * n + ps)
                h, s, d = _indices(spec, gen)
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
                        _check(pool, dev, h, s, d, ops)
                        burst, calls = _timed_calls(pool, n, h, s, d)
                        fn: Callable[[], Any] | None = None
                        for op in ops:
                            fn, nbytes, to_host, lay = calls[op]
                            warm_link()  # every row from the same state, whatever ran before it
                            lone = getattr(pool.strategy, "lone_kernel_loads", 0)
                            ms = _median_ms(fn, reps)
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
                            host_us = (_burst_host_us(burst, max(3, reps // 4)) if op == "load_burst"
                                       else _host_us(fn, max(5, reps // 2)))
                            slow = _gemm_slowdown(fn) if gemm and op in GEMM_OPS else None
                            hbm_slow = hbm_ratio = None
                            if reader is not None and op in GEMM_OPS + HBM_LONE_OPS:
                                lone_op = op in HBM_LONE_OPS
                                hbm_slow = None if lone_op else _neighbor_slowdown(fn, reader)
                                hbm_ratio = nbytes / _ms_beside(fn, reader, calls=1 if lone_op else 3) / 1e6 / base
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


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """Ratio vs tokens per (strategy, op), one panel per op.  ``False`` when matplotlib is missing."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        logger.warning("matplotlib is not installed; no plot written")
        return False
    fig, axes = plt.subplots(1, len(OPS), figsize=(5 * len(OPS), 4), sharey=True)
    for ax, op in zip(axes, OPS):
        best: dict[tuple[str, str, int], dict[int, float]] = {}
        for r in rows:
            if r["op"] != op:
                continue
            key = (r["shape"], r["strategy"], r["page_size"])
            best.setdefault(key, {})
            best[key][r["tokens"]] = max(best[key].get(r["tokens"], 0.0), r["ratio"])
        for (shape, strat, ps), pts in sorted(best.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=f"{strat} {shape} ps{ps}")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("tokens per call")
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0].set_ylabel("ratio to pinned memcpy (best SM budget)")
    axes[-1].legend(fontsize=5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _int_list(least: int) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of whole numbers >= ``least``, at least one."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or any(v < least for v in values):
            raise argparse.ArgumentTypeError(f"must be a comma list of whole numbers >= {least}, got {text!r}")
        return values
    return parse


def _name_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of names from ``choices``, at least one."""
    known = sorted(choices)

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in known]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad)) or repr(text)} not among {', '.join(known)}")
        return names
    return parse


#: io_backends measured by default (those installed).
DEFAULT_BACKENDS = ("kernel", "direct", "auto")
#: Keys of a bench.json row that the plot reads.
PLOT_KEYS = ("op", "shape", "strategy", "page_size", "tokens", "ratio")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="GPU throughput of every strategy vs pinned memcpy (JSON + PNG)",
        description="GPU throughput of every installed layout and io_backend against a pinned memcpy of the same bytes "
                    "(ratio), host time per call, and with --gemm the slowdown of a GEMM beside it. The default grid "
                    "(2 shapes x 2 token counts x 2 page sizes x 4 SM budgets x every layout, backend and op) is "
                    "hundreds of configurations; for a quick look narrow it, e.g. --tokens 4096 --page-sizes 64 "
                    "--programs 0 (the runs in docs/performance.md name theirs).")
    from .cli import _positive_int

    p.add_argument("--out", default=None, help="folder for bench.json and bench.png (default bench-results; with "
                   "--plot-only, the JSON file's folder)")
    p.add_argument("--shapes", type=_name_list(SHAPES), default="mla61x576-bf16,mha80x8x128-bf16",
                   help=f"comma list of {sorted(SHAPES)} (default: %(default)s)")
    p.add_argument("--tokens", type=_int_list(1), default="4096,32768",
                   help="comma list of tokens per call (default: %(default)s)")
    p.add_argument("--page-sizes", type=_int_list(1), default="1,64",
                   help="comma list of tokens per page (default: %(default)s)")
    p.add_argument("--programs", type=_int_list(0), default="4,8,16,0",
                   help="SM budgets for kernel strategies; 0 = strategy default (default: %(default)s)")
    p.add_argument("--layouts", default="", help="comma list (default: all installed)")
    p.add_argument("--io-backends", default=None, help=f"comma list (default: those of {','.join(DEFAULT_BACKENDS)} "
                   "installed)")
    p.add_argument("--direct-variants", type=_name_list(DIRECT_VARIANTS), default="auto",
                   help=f"direct staging modes to measure, comma list of {sorted(DIRECT_VARIANTS)} (default: "
                        "%(default)s)")
    p.add_argument("--ops", type=_name_list(OPS), default=",".join(OPS), help=f"comma list of {list(OPS)} (default: all)")
    p.add_argument("--reps", type=_positive_int, default=20,
                   help="timed calls per configuration, after 3 warm-up calls; the median is reported (default: "
                        "%(default)s)")
    p.add_argument("--gemm", action="store_true", help=f"measure GEMM slowdown during {' and '.join(GEMM_OPS)}")
    p.add_argument("--hbm", action="store_true",
                   help=f"during {' and '.join(GEMM_OPS)}, also measure the slowdown of a memory-bound reduction over "
                        f"{HBM_READ_BYTES >> 30} GiB (a decode step's attention reads the KV cache that way) and the "
                        f"transfer's own ratio while it runs; for {' and '.join(HBM_LONE_OPS)}, that ratio alone")
    p.add_argument("--plot-only", default="", help="render the plot of an existing bench.json and exit")
    p.add_argument("--peers", action="store_true",
                   help="run the peer benchmark (SGLang's and LMCache's kernels beside ours; source checkout only) "
                        "with --peers-args instead of the strategy grid")
    p.add_argument("--peers-args", default="", help="arguments for the peer benchmark, one string (see --peers-args=--help)")
    p.set_defaults(func=_cmd)


def _progress_printer() -> Callable[[str], None]:
    """A tqdm bar that also prints each result line, or plain stderr lines without tqdm."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    bar = tqdm(desc="hicache bench", unit="cfg", file=sys.stderr)

    def show(msg: str) -> None:
        bar.update(1)
        bar.write(msg)
    return show


def peers_module() -> Any:
    """``benchmarks/peers.py`` of the source checkout this package runs from (it is not installed)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "peers.py")
    if not os.path.exists(path):
        raise FileNotFoundError(
            "the peer benchmark ships in the source repository (benchmarks/peers.py), not in the installed "
            "package; run hicache bench --peers from an editable install of a checkout, or python -m benchmarks.peers there"
        )
    root = os.path.dirname(os.path.dirname(path))
    if root not in sys.path:
        sys.path.insert(0, root)  # peers.py imports its sibling modules as benchmarks.*
    spec = importlib.util.spec_from_file_location("benchmarks.peers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks.peers"] = module
    spec.loader.exec_module(module)
    return module


def _cmd(args: argparse.Namespace) -> int:
    if getattr(args, "peers", False):
        import shlex

        try:
            peers = peers_module()
        except FileNotFoundError as exc:
            print(f"hicache bench --peers: {exc}", file=sys.stderr)
            return 2
        # --out only when given: the peer benchmark has its own default folder (None there crashed it)
        out_args = ["--out", args.out] if args.out else []
        return int(peers.main([*out_args, *shlex.split(args.peers_args)]) or 0)
    if args.plot_only:
        try:
            rows = _plot_rows(args.plot_only)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"hicache bench --plot-only: cannot read rows from {args.plot_only} ({type(exc).__name__}: {exc}); "
                  "give a bench.json written by hicache bench", file=sys.stderr)
            return 2
    out = args.out or (os.path.dirname(os.path.abspath(args.plot_only)) if args.plot_only else "bench-results")
    if args.plot_only:
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:
            print(f"hicache bench: cannot create --out {out} ({exc})", file=sys.stderr)
            return 2
        return 0 if plot(rows, os.path.join(out, "bench.png")) else 1
    uneven = _uneven(args.tokens, args.page_sizes)
    if uneven:
        print(f"hicache bench: every --tokens value must be a multiple of every --page-sizes value; {uneven}",
              file=sys.stderr)
        return 2
    reg = create_registry()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()] or None
    backends = ([x.strip() for x in args.io_backends.split(",") if x.strip()] if args.io_backends is not None
                else [b for b in DEFAULT_BACKENDS if b in reg.io_backends])
    for option, names, known in (("--layouts", layouts or [], reg.layouts), ("--io-backends", backends, reg.io_backends)):
        bad = [x for x in names if x not in known]
        if bad or (option == "--io-backends" and not names):
            print(f"hicache bench: {option} {', '.join(map(repr, bad)) or 'is empty'}: installed are "
                  f"{', '.join(sorted(known))}", file=sys.stderr)
            return 2
    problem = check_writable(os.path.join(out, "bench.json"))
    if problem:
        print(f"hicache bench: {problem}; pass --out a folder you can write", file=sys.stderr)
        return 2
    progress = _progress_printer()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "sms": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count, "argv": sys.argv[1:]}
    path = os.path.join(out, "bench.json")
    done: list[dict[str, Any]] = []

    def sink(row: BenchRow) -> None:  # rewritten whole after every row: a killed run keeps its results
        done.append(asdict(row))
        write_json(path, {"meta": meta, "rows": done})

    run_bench(
        shapes=args.shapes, tokens=args.tokens, page_sizes=args.page_sizes,
        programs=[p or None for p in args.programs], layouts=layouts, backends=backends, ops=args.ops,
        reps=args.reps, gemm=args.gemm, hbm=args.hbm, direct_variants=args.direct_variants, registry=reg,
        progress=progress, sink=sink,
    )
    if not done:
        print("hicache bench: no cell of the grid could be measured (no installed strategy serves these layouts, "
              "io_backends and shapes: see hicache matrix); nothing written", file=sys.stderr)
        return 2
    plot(done, os.path.join(out, "bench.png"))
    return 0


def _plot_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a bench.json at ``path``, each with what :func:`plot` reads.

    :raises OSError, ValueError, KeyError, TypeError: not such a file (nothing is plotted)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    if not isinstance(rows, list) or not rows:
        raise ValueError("'rows' must be a non-empty list")
    for i, r in enumerate(rows):
        missing = [k for k in PLOT_KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise KeyError(f"row {i} lacks {', '.join(missing)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache-bench")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)

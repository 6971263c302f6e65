"""The benchmark's clocks: event-timed calls and their medians (:func:`_samples_ms`, :func:`_median_ms`), several
targets' calls timed in turns (:func:`_in_turns`), host time per call, the pinned memcpy every ratio divides by
(:class:`_Memcpy`), the link warm-up, the slowdown of a GEMM or a memory-bound neighbour on another stream while a
transfer runs, and the hand-back of the memory a measurement freed (:func:`_release_memory`)."""

from __future__ import annotations

import functools
import gc
import statistics
import time
from typing import Any, Callable, Protocol, Sequence

import torch

from .shapes import HBM_READ_BYTES, WARMUP


def _median_ms(fn: Callable[[], object], reps: int, warmup: int = WARMUP, idle: bool = False,
               before: Callable[[], object] | None = None) -> float:
    """Median event-timed milliseconds of ``fn`` (:func:`_samples_ms`)."""
    return statistics.median(_samples_ms(fn, reps, warmup, idle, before))


def _samples_ms(fn: Callable[[], object], reps: int, warmup: int = WARMUP, idle: bool = False,
                before: Callable[[], object] | None = None) -> list[float]:
    """Event-timed milliseconds of ``reps`` calls of ``fn``, after ``warmup`` untimed ones; ``idle``: each call starts
    on an idle GPU (a lone call), else calls follow each other as soon as the last one's end event is reached.
    ``before`` (then a synchronise: the call is lone) runs ahead of each timed call, untimed."""
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
    return times


def _shares(reps: int, rounds: int) -> list[int]:
    """``reps`` timed calls spread over ``rounds`` rounds, as evenly as they go (earlier rounds take the rest)."""
    return [reps // rounds + (1 if r < reps % rounds else 0) for r in range(rounds)]


def _turn(order: list[int], r: int) -> list[int]:
    """The order of round ``r``: reversed every other round and rotated by one every two (abc, cba, bca, acb, ...), so
    that each target goes first in turn and follows a different one from round to round."""
    if not order:
        return []
    k = r // 2 % len(order)
    turn = order[k:] + order[:k]
    return turn[::-1] if r % 2 else turn


def _in_turns(fns: Sequence[Callable[[], object]], reps: int | Sequence[int], rounds: int,
              failed: dict[int, Exception] | None = None) -> tuple[list[list[float]], list[int]]:
    """Event-timed milliseconds of ``reps`` calls of each of ``fns`` (one count for all, or one per function), in
    turns: each function's calls are split over ``rounds`` rounds (:func:`_shares`), and in each round every function
    runs its share in that round's order (:func:`_turn`), so that the host's drift over the window reaches all of them
    alike.  A function's first round starts with :data:`~.shapes.WARMUP` untimed calls, each later one with one (the
    others ran meanwhile).  With ``failed``, a function whose calls raise is recorded there by its position and left
    out of the later rounds, the others timed on; without it the exception propagates.  Returns, per function, its
    timed samples and the calls it made in all (warm-up calls included)."""
    counts = [reps] * len(fns) if isinstance(reps, int) else list(reps)
    if len(counts) != len(fns):
        raise ValueError(f"reps gives {len(counts)} counts for {len(fns)} functions: give one count, or one each")
    if min(counts, default=1) < 1 or rounds < 1:
        raise ValueError(f"reps ({reps}) and rounds ({rounds}) must be at least 1")
    times: list[list[float]] = [[] for _ in fns]
    made = [0] * len(fns)
    shares = [_shares(c, rounds) for c in counts]
    for r in range(rounds):
        warmup = WARMUP if r == 0 else 1
        for i in _turn(list(range(len(fns))), r):
            share = shares[i][r]
            if not share or (failed is not None and i in failed):
                continue  # fewer calls than rounds (the last rounds have none), or failed in an earlier round
            try:
                times[i] += _samples_ms(fns[i], share, warmup)
            except Exception as e:
                if failed is None:
                    raise
                failed[i] = e
                continue
            made[i] += warmup + share
    return times, made


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


class _LinkWarmer:
    """Pinned copies both ways until the host link and copy engines are warm (buffers made once per run).

    Measured on an H200: the first transfer strategy timed in a process ran up to 10 points below
    the same strategy timed after another one (docs/perf/runs.md, `perf/bench-order-2026-11-30.log`); every row now
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


class MemcpyReference(Protocol):
    """What :func:`~hicache_core.bench.run_bench` divides each row's speed by: the GB/s of a pinned copy of ``nbytes``
    in the direction ``to_host``, timed over ``reps`` calls (:class:`_Memcpy`)."""

    def gbps(self, nbytes: int, to_host: bool, reps: int) -> float: ...


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


def _gemm(size: int = 8192) -> Callable[[], object]:
    """One bf16 ``size``^3 GEMM per call (the model's compute in every neighbour measurement)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ b


def _gemm_slowdown(transfer: Callable[[], object], size: int = 8192, reps: int = 6, gemms: int = 4) -> float:
    """Relative slowdown of a bf16 ``size``^3 GEMM while ``transfer`` runs on another stream
    (:func:`_neighbor_slowdown`)."""
    return _neighbor_slowdown(transfer, _gemm(size), reps, gemms)


def _ms_beside_gemm(transfer: Callable[[], object], size: int = 8192) -> float:
    """Median milliseconds of one ``transfer`` while bf16 ``size``^3 GEMMs run without pause on another stream
    (:func:`_ms_beside`, three calls per sample, GEMMs queued for four times the transfers' time alone: a kernel
    the GEMM's CTAs keep off the SMs runs several times slower): the transfer's own speed beside the model, where
    :func:`_gemm_slowdown` is the model's beside the transfer."""
    return _ms_beside(transfer, _gemm(size), calls=3, cover=4.0)


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


def _ms_beside(transfer: Callable[[], object], work: Callable[[], object], reps: int = 5, calls: int = 3,
               cover: float = 1.5) -> float:
    """Median milliseconds of one ``transfer`` while ``work`` runs without pause on another stream.

    Each sample queues ``work`` for ``cover`` times ``calls`` transfers' time alone, then times those transfers
    back to back (events on their own stream) and waits for both streams.
    """
    work_stream, side, transfer_ms = _two_streams(transfer)
    with torch.cuda.stream(work_stream):
        work_ms = _median_ms(work, 3, warmup=1)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        _queue(work_stream, work, int(cover * calls * transfer_ms / max(work_ms, 1e-3)) + 2)
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

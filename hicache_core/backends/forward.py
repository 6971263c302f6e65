"""What the forward pass beside ``auto``'s loads is bound by, read from the speed of the kernel's lone loads.

Beside a model's GEMMs (a prefill) an SM kernel's load runs at its idle speed (H200: 0.85-0.96 of memcpy for a
lone load of one layer); beside memory-bound kernels (decode steps, whose attention reads the KV cache) it keeps
only 0.12-0.48 while the copy engine keeps most of its speed (docs/perf/runs.md, twelfth run).  With
``forward="watch"``, ``auto`` times its lone kernel loads (two CUDA events on the stream, made once) and
:class:`ForwardWatch` turns the timings into a verdict: a load under :data:`SLOW_SHARE` of the link marks the
forward pass memory-bound, and one at :data:`FAST_SHARE` or more marks it compute-bound again (a timing in between
keeps the verdict: one noisy timing near the line does not flip it, nor make ``auto`` decide all its picks again).
While the verdict says compute, every lone kernel load is timed (two event records around the launch, on ``auto``'s
fast path too), so a change shows at the next one; while it says memory, lone loads go by the rule of the other
loads but for one per :data:`RENEW_S`, which goes to the kernel to be timed again.  Loads too small to time reliably (under
:data:`MIN_TIMED_BYTES`) are never timed.

A lone load usually starts on an idle stream, where the start event fires as soon as it is recorded: the host's time
from that record to the launch's return is taken off the measured time (else a call's own host work, e.g. checking
new index tensors, would read as a slow load).  Where the stream was busy instead, or the host worked on after the
launch, that makes the load look faster than it was: errors lean to ``compute``, the default's judgement.  A timing
that comes out impossible (no time left, or faster than :data:`MAX_SHARE` of the link) is dropped.  The watch is
shared by a pool's load and backup threads: the events are claimed, and timings land, under a lock.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["ForwardWatch", "SLOW_SHARE", "FAST_SHARE", "RENEW_S", "MIN_TIMED_BYTES", "IDLE_SHARE", "MAX_ROOM",
           "MAX_SHARE", "ROOM_STEP"]

#: A timed lone kernel load under this share of the link's speed marks the forward pass memory-bound (H200: 0.85-0.96
#: beside nothing or a GEMM, 0.12-0.48 beside a memory-bound reduction).
SLOW_SHARE = 0.6
#: A timed lone kernel load at this share of the link or more marks the forward pass compute-bound again; between the
#: two shares the verdict stands (H200 idle lone loads: 0.85-0.96; the 0.72 of a slow host stretch also clears it).
FAST_SHARE = 0.7
#: Seconds after which a verdict is renewed by timing the next lone load through the kernel (in a memory-bound
#: stretch that one load runs at the kernel's slow speed: one per this many seconds).
RENEW_S = 0.5
#: A lone kernel load's share of the link with nothing beside it (H200: 0.85-0.89 for MLA rows, 0.90-0.96 for MHA):
#: the speed a measured one is compared with to tell how much the forward pass slows the kernel.
IDLE_SHARE = 0.87
#: The most room (:meth:`ForwardWatch.room`) a verdict gives the copy engine's loads.
MAX_ROOM = 8.0
#: While the verdict stays memory-bound, a timing whose room differs from the room of the last decision by this factor
#: or more moves :attr:`ForwardWatch.generation` too (``auto``'s memoised picks were decided at the old room).
ROOM_STEP = 1.5
#: A timing faster than this share of the link is dropped (the host time taken off covered more than the load).
MAX_SHARE = 1.1
#: Lone loads smaller than this are not timed: the launch's fixed microseconds would dominate (36 us at 55 GB/s).
MIN_TIMED_BYTES = 2 << 20


class ForwardWatch:
    """The last verdict on the forward pass beside the loads, from timed lone kernel loads.

    :param link_gbps: the host link's speed (the calibration's), GB/s.
    :param now: clock in seconds (tests pass a fake one).
    :param event: makes a timing event (default ``torch.cuda.Event(enable_timing=True)``; tests pass fakes with
        ``record(stream)``, ``query()`` and ``elapsed_time(other)``).
    :param stream: the current stream of a CUDA device index (default ``torch.cuda.current_stream``).
    :param min_room: the least room a memory-bound verdict gives (``auto`` passes ``forward="memory"``'s fixed room:
        on the H200 the measured slowdown of a burst's lone first load understated that of the rest of the burst,
        and the fixed room moved fp8 and MHA bursts faster than the measured one in the same runs).
    """

    def __init__(self, link_gbps: float, now: Callable[[], float] = time.perf_counter,
                 event: Callable[[], Any] | None = None, stream: Callable[[int], Any] | None = None,
                 min_room: float = 1.0) -> None:
        self.link_gbps = link_gbps
        self.min_room = min(MAX_ROOM, max(1.0, min_room))
        self._now = now
        self._event = event
        self._stream = stream
        self._pending: tuple[Any, Any, int, float] | None = None
        self._timing = False  # a thread is recording a timing (claimed under the lock)
        self._events: tuple[Any, Any] | None = None  # made once: one timing at a time
        self._verdict = False
        self._at = float("-inf")  # when the last timing landed
        self._generation = 0
        self._decided_room = 1.0  # the room when the generation last moved
        self._lock = threading.Lock()
        #: Timings that landed, those dropped as impossible, and the last landed one's share of the link (for tests,
        #: benchmarks and ``explain``).
        self.timings = 0
        self.dropped = 0
        self.last_share: float | None = None

    @property
    def generation(self) -> int:
        """Moves whenever the verdict changes, or the room of a memory-bound one moves by :data:`ROOM_STEP` or more
        (``auto`` decides its memoised picks again then); a finished timing lands first."""
        self._land()
        return self._generation

    def memory_bound(self) -> bool:
        """The verdict standing after the last timing that landed (``False`` before any; a timing between
        :data:`SLOW_SHARE` and :data:`FAST_SHARE` keeps the one before)."""
        self._land()
        return self._verdict

    def room(self) -> float:
        """How many times its transfer time at link speed the host may take to submit a load to the copy engine
        (``auto``'s ``room``): 1 beside compute; beside memory-bound work, by how much it slowed the last timed kernel
        load (:data:`IDLE_SHARE` over its share of the link, at least ``min_room``, at most :data:`MAX_ROOM`: a
        kernel slowed 4x leaves the copy engine the better route while the host feeds it at a quarter of the link's
        pace)."""
        if not self.memory_bound() or self.last_share is None:
            return 1.0
        return self._room_of(self.last_share)

    def _room_of(self, share: float) -> float:
        return min(MAX_ROOM, max(self.min_room, IDLE_SHARE / max(share, 1e-6)))

    def due(self, nbytes: int) -> bool:
        """Whether a lone load of ``nbytes`` should be timed (and so go to the kernel): large enough, no timing pending,
        and the verdict compute or :data:`RENEW_S` old."""
        self._land()
        return nbytes >= MIN_TIMED_BYTES and self._pending is None and (
            not self._verdict or self._now() - self._at >= RENEW_S)

    def timed(self, launch: Callable[[], Any], nbytes: int, device_index: int) -> Any:
        """Run ``launch`` (which queues a load of ``nbytes`` on the current stream of CUDA device ``device_index``)
        between two timing events on that stream; its result (``False``: it queued nothing, nothing is timed).  While
        another timing is pending or being made (another thread), ``launch`` just runs (the events are in use): the
        events are claimed under the lock, and a pending timing is read before it is released (:meth:`_land`)."""
        with self._lock:
            free = self._pending is None and not self._timing
            if free:
                self._timing = True
        if not free:
            return launch()
        try:
            if self._event is None or self._stream is None:
                import torch

                self._event = self._event or (lambda: torch.cuda.Event(enable_timing=True))
                self._stream = self._stream or torch.cuda.current_stream
            stream = self._stream(device_index)
            if self._events is None:
                self._events = (self._event(), self._event())
            start, end = self._events
            start.record(stream)
            t0 = self._now()
            result = launch()
            host_ms = (self._now() - t0) * 1e3
            end.record(stream)
            if result is not False:
                with self._lock:
                    self._pending = (start, end, nbytes, host_ms)
            return result
        finally:
            self._timing = False

    def _land(self) -> None:
        """Turn a finished timing into the verdict (nothing when none is pending or it has not finished)."""
        if self._pending is None:
            return
        with self._lock:
            pending = self._pending
            if pending is None or not pending[1].query():
                return
            start, end, nbytes, host_ms = pending
            ms = start.elapsed_time(end) - host_ms  # read before the events are released to the next timing
            self._pending = None
            share = nbytes / ms / (self.link_gbps * 1e6) if ms > 0 else float("inf")
            if share > MAX_SHARE:
                self.dropped += 1  # more host time taken off than the load took: no measure of it
                return
            self.timings += 1
            self.last_share = share
            verdict = share < SLOW_SHARE or (self._verdict and share < FAST_SHARE)
            room = self._room_of(share) if verdict else 1.0
            if verdict != self._verdict or max(room / self._decided_room, self._decided_room / room) >= ROOM_STEP:
                self._generation += 1  # a new verdict, or the room of a memory-bound one moved by ROOM_STEP or more
                self._decided_room = room
            self._verdict, self._at = verdict, self._now()

"""What the forward pass beside ``auto``'s loads is bound by, read from the speed of the kernel's lone loads.

Beside a model's GEMMs (a prefill) an SM kernel's load runs at its idle speed (H200: 0.85-0.96 of memcpy for a
lone load of one layer); beside memory-bound kernels (decode steps, whose attention reads the KV cache) it keeps
only 0.12-0.48 while the copy engine keeps most of its speed (docs/performance.md, twelfth run).  With
``forward="watch"``, ``auto`` times a lone kernel load now and then (two CUDA events on its stream) and
:class:`ForwardWatch` turns the timings into a verdict: a load under :data:`SLOW_SHARE` of the link marks the
forward pass memory-bound.  A verdict holds until a new timing replaces it; once it is :data:`RENEW_S` old, the
next lone load goes to the kernel again to take one.  Loads too small to time reliably (under
:data:`MIN_TIMED_BYTES`) are never timed.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["ForwardWatch", "SLOW_SHARE", "RENEW_S", "MIN_TIMED_BYTES"]

#: A timed lone kernel load under this share of the link's speed marks the forward pass memory-bound (H200: 0.85-0.96
#: beside nothing or a GEMM, 0.12-0.48 beside a memory-bound reduction).
SLOW_SHARE = 0.6
#: Seconds after which a verdict is renewed by timing the next lone load through the kernel (in a memory-bound
#: stretch that one load runs at the kernel's slow speed: one per this many seconds).
RENEW_S = 0.5
#: Lone loads smaller than this are not timed: the launch's fixed microseconds would dominate (36 us at 55 GB/s).
MIN_TIMED_BYTES = 2 << 20


class ForwardWatch:
    """The last verdict on the forward pass beside the loads, from timed lone kernel loads.

    :param link_gbps: the host link's speed (the calibration's), GB/s.
    :param now: clock in seconds (tests pass a fake one).
    :param event: makes a timing event (default ``torch.cuda.Event(enable_timing=True)``; tests pass fakes with
        ``record(stream)``, ``query()`` and ``elapsed_time(other)``).
    :param stream: the current stream of a CUDA device index (default ``torch.cuda.current_stream``).
    """

    def __init__(self, link_gbps: float, now: Callable[[], float] = time.perf_counter,
                 event: Callable[[], Any] | None = None, stream: Callable[[int], Any] | None = None) -> None:
        self.link_gbps = link_gbps
        self._now = now
        self._event = event
        self._stream = stream
        self._pending: tuple[Any, Any, int] | None = None
        self._verdict = False
        self._at = float("-inf")  # when the last timing landed
        self._generation = 0
        #: Timings taken, and the last one's share of the link (for tests, benchmarks and ``explain``).
        self.timings = 0
        self.last_share: float | None = None

    @property
    def generation(self) -> int:
        """Moves whenever the verdict changes (``auto`` decides its memoised picks again then); a finished timing lands
        first."""
        if self._pending is not None:
            self._land()
        return self._generation

    def memory_bound(self) -> bool:
        """The verdict of the last timing that landed (``False`` before any)."""
        if self._pending is not None:
            self._land()
        return self._verdict

    def due(self, nbytes: int) -> bool:
        """Whether a lone load of ``nbytes`` should go to the kernel and be timed: large enough, no timing pending,
        and none landed within :data:`RENEW_S`."""
        if self._pending is not None:
            self._land()
        return nbytes >= MIN_TIMED_BYTES and self._pending is None and self._now() - self._at >= RENEW_S

    def timed(self, launch: Callable[[], Any], nbytes: int, device_index: int) -> Any:
        """Run ``launch`` (which queues a load of ``nbytes`` on the current stream of CUDA device ``device_index``)
        between two timing events on that stream; its result (``False``: it queued nothing, nothing is timed)."""
        if self._event is None or self._stream is None:
            import torch

            self._event = self._event or (lambda: torch.cuda.Event(enable_timing=True))
            self._stream = self._stream or torch.cuda.current_stream
        stream = self._stream(device_index)
        start, end = self._event(), self._event()
        start.record(stream)
        result = launch()
        end.record(stream)
        if result is not False:
            self._pending = (start, end, nbytes)
        return result

    def _land(self) -> None:
        assert self._pending is not None
        start, end, nbytes = self._pending
        if not end.query():
            return
        self._pending = None
        ms = start.elapsed_time(end)
        share = nbytes / max(ms, 1e-6) / (self.link_gbps * 1e6)
        self.timings += 1
        self.last_share = share
        verdict = share < SLOW_SHARE
        if verdict != self._verdict:
            self._generation += 1
        self._verdict, self._at = verdict, self._now()

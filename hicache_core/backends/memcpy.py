"""Submitting many raw-pointer copies: ``memmove`` on CPU, the CUDA runtime's batched copy on GPUs."""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Callable

import torch

from ..kernel_support import current_device_index, current_stream_handle
from .cudart import MAX_PER_CALL as _ONE_CALL
from .cudart import BatchSubmitError, runtime, runtime_unavailable_reason, schedule_calls
from .pace import MAX_BACKLOG_US, MIN_OPS, HostPace, WaitLog
from .pitched import Pitched, expand

__all__ = ["BatchCopier", "QueueClock", "DRAIN_BYTES_PER_US", "CALL_US", "DESC_US", "PITCHED_DESC_US", "BURST_GAP_US",
           "TIGHT_GAP_US"]

logger = logging.getLogger(__name__)

#: Faster than the copy engine drains host-link copies on any GPU we measured (H200: ~55 GB/s each
#: way), so work queued at this rate is a lower bound on how long the engine stays busy.
DRAIN_BYTES_PER_US = 64e3
#: Upper bounds on the host time of one ``cudaMemcpyBatchAsync`` call and per descriptor (H200 host:
#: ~6.7 us and ~0.45 us; per pitched operation ~2.7 us), with room for slower hosts.
CALL_US, DESC_US, PITCHED_DESC_US = 15.0, 1.0, 5.0
#: A submission starting within this long of the previous one's end on the same stream belongs to a
#: burst (one load per layer back to back, as a forward pass issues them) while the copies queued
#: before it may still run, or within :data:`TIGHT_GAP_US` whatever the queue holds.
BURST_GAP_US = 100.0
#: A gap this short is a caller issuing calls back to back (a loop of loads), not one waiting for
#: the last call's copies: the copy engine cannot have drained more than the host submits meanwhile.
#: The gap a copier sees includes whatever its caller does between two submissions: ``auto``'s lane
#: around ``direct``'s.  At 20 us, on a host whose submissions outlast their copies (H100 host,
#: reused-index MLA bursts, ~95 us per 64-descriptor call), ``auto``'s bursts crossed it: about 59 of
#: 61 submissions per burst went in four small runtime calls instead of one, ~20 us more host time
#: each, and the bursts moved 0.71 of memcpy where ``direct``'s own (8 of 61 split) moved 0.90.
#: :meth:`QueueClock.lone` reads it too: such a burst's loads are not lone ones either.
TIGHT_GAP_US = 50.0
_NEVER = float("-inf")
#: Streams a clock holds before it forgets the quiet ones (an entry idle past every gap answers as a stream never seen).
MAX_CLOCK_STREAMS = 64


class QueueClock:
    """Per stream: a lower bound on when the copy engine finishes the copies this copier queued, and
    when the last submission ended.

    A submission starts with small runtime calls (so an idle engine starts within microseconds)
    only when the engine may be idle and the call is not part of a burst; otherwise it goes in the
    fewest calls (~6.7 us of host time each): the engine still has queued work to cover them, or, in a
    burst of per-layer loads, saving the host three calls per layer matters more than how soon one
    layer's first block starts.  A call that follows the previous one closely is part of a burst only
    while that one's copies may still be queued (or when it follows within :data:`TIGHT_GAP_US`): a
    caller that waited for the copies (one load, then a synchronisation, then the next) finds the
    engine idle and gets the small calls.  A heuristic: it sees only this copier's submissions (one
    pool), and concurrent submitters on one stream may race on it harmlessly.
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self._until: dict[int, float] = {}
        self._last_end: dict[int, float] = {}

    def eager(self, stream: int, cost_us: float, burstable: bool = True) -> bool:
        """Whether a submission costing ``cost_us`` of host time should start with small calls.
        ``burstable``: it fits one runtime call, so following a burst it may skip them; a larger one
        would keep an idle engine waiting for its first full call."""
        now = self.now()
        gap_us = (now - self._last_end.get(stream, _NEVER)) * 1e6
        left_us = (self._until.get(stream, 0.0) - now) * 1e6
        if burstable and gap_us < BURST_GAP_US and (left_us > 0.0 or gap_us < TIGHT_GAP_US):
            return False
        return left_us <= cost_us

    def idle(self, stream: int, now: float | None = None) -> bool:
        """Whether the copies queued on ``stream`` through this clock are certainly done by ``now`` (default:
        the clock's now; their estimated end, at a drain rate above the link's, has passed)."""
        return self._until.get(stream, 0.0) <= (self.now() if now is None else now)

    def lone(self, stream: int, now: float) -> bool:
        """Whether a submission at ``now`` is a lone one: :meth:`idle`, and not issued within
        :data:`TIGHT_GAP_US` of the previous one's end (a loop of calls whose host time outlasts their copies
        is a burst all the same)."""
        return (self._until.get(stream, 0.0) <= now  # idle(), inlined: a lone load's launch waits on this
                and (now - self._last_end.get(stream, _NEVER)) * 1e6 >= TIGHT_GAP_US)

    def backlog_us(self, stream: int, now: float) -> float:
        """Microseconds of queued copies on ``stream`` still to drain at ``now`` (a lower bound, 0 when idle)."""
        left = (self._until.get(stream, 0.0) - now) * 1e6
        return left if left > 0.0 else 0.0

    def queued(self, stream: int, nbytes: int, since: float) -> None:
        """``nbytes`` were queued on ``stream`` by a submission that started at ``since`` and ends now.  On every call
        of a burst (twice through ``auto``'s lane): written for its host time (no ``max()`` call, the dicts read
        once; a third less on a CPU)."""
        now = self.now()
        last, until = self._last_end, self._until
        if stream not in last and len(last) >= MAX_CLOCK_STREAMS:
            self._forget_quiet(now)
        queued_until = until.get(stream, 0.0)
        until[stream] = (queued_until if queued_until > since else since) + nbytes / DRAIN_BYTES_PER_US * 1e-6
        last[stream] = now

    def _forget_quiet(self, now: float) -> None:
        """Drops the streams whose entries no longer change any answer (idle, and quiet for longer than any gap
        the clock compares): a caller that makes a stream per call does not grow the clock without bound."""
        quiet = max(BURST_GAP_US, TIGHT_GAP_US) * 1e-6
        # a snapshot taken in one C call: another thread's queued() may add a stream meanwhile, and iterating the
        # live dict in Python bytecode would then raise "dictionary changed size during iteration"
        for stream in [s for s, end in list(self._last_end.items())
                       if now - end > quiet and self._until.get(s, 0.0) <= now]:
            self._last_end.pop(stream, None)
            self._until.pop(stream, None)


class BatchCopier:
    """Copies ``lens[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` (raw addresses in int64 tensors).

    On CUDA the copies are enqueued on the pool device's current stream
    without host synchronisation (host memory must be pinned for that), in one
    ``cudaMemcpyBatchAsync`` per call (see :mod:`.cudart`).  On the CPU they
    run immediately (``memmove``).  Callers guarantee every range is in bounds.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.index is not None or self.device.type != "cuda":
            self._index = self.device.index or 0
        else:  # "cuda" alone: the device current when the pool is built, as torch resolves it
            self._index = torch.cuda.current_device()
        self.clock = QueueClock()
        #: The host's recent submission speed, by direction (index: ``to_host``), from this copier's own plain
        #: submissions that planned their descriptors in the call (a new index pair or layer: a serving loop's
        #: fresh batches), and from those that reused a plan (:attr:`warm_paces`: indices reused call after call).
        #: ``auto`` reads them.
        self.paces = (HostPace(), HostPace())
        self.warm_paces = (HostPace(warm=True), HostPace(warm=True))
        #: Waits on the GPU within callers' calls (a plan reading GPU-resident indices back), left out of the samples.
        self.waits = WaitLog(lambda: self.clock.now())
        self._pitched_refused = False
        self._legacy_mark: tuple[torch.cuda.Event, torch.cuda.Stream] | None = None

    @staticmethod
    def unavailable_on_cuda() -> str | None:
        """``None`` when CUDA copies can be submitted here, else why not."""
        return runtime_unavailable_reason()

    def stream(self) -> int:
        """The ``cudaStream_t`` of the pool device's current stream (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        return current_stream_handle(self._index)

    def pitched_support(self) -> bool:
        """Whether pitched copies go to the copy engine in one call here (``cudaMemcpy3DBatchAsync``);
        the CPU runs them row by row, so they hold there too."""
        if self.device.type != "cuda":
            return True
        try:
            return runtime().has_batch3d
        except RuntimeError:
            return False

    def copy(self, dsts: torch.Tensor, srcs: torch.Tensor, lens: torch.Tensor, stream: int | None = None,
             nbytes: int | None = None, to_host: bool | None = None, since: float | None = None,
             warm: bool = False) -> None:
        """Copy every range; ``dsts``/``srcs``/``lens`` are contiguous CPU int64 tensors of one length
        (``nbytes``: their total, when the caller knows it).  ``to_host``: the direction, whose
        :attr:`paces` entry (:attr:`warm_paces` where ``warm``: the caller reused its descriptors, no planning
        in the call) samples the host time from ``since`` (the clock's time when the caller's call began;
        default: now) to the end of the submission, less the time the caller's thread waited on the GPU meanwhile
        (:attr:`waits`; ``None``: not sampled)."""
        n = int(dsts.numel())
        if n == 0:
            return
        if self.device.type != "cuda":
            for dst, src, k in zip(dsts.tolist(), srcs.tolist(), lens.tolist()):
                ctypes.memmove(dst, src, k)
            return
        rt = runtime()
        nbytes = int(lens.sum()) if nbytes is None else nbytes
        if n < MIN_OPS or to_host is None:
            self._submit(stream, n, DESC_US, nbytes, lambda s, eager: rt.copy_batch(dsts, srcs, lens, s, eager))
            return
        # sampled for the host's pace (.pace): the submission's host time, unless it starts behind a deep queue
        s = self.stream() if stream is None else stream
        now = self.clock.now()
        t0 = now if since is None else since
        measured = self.clock.backlog_us(s, now) <= MAX_BACKLOG_US
        eager = self._submit(s, n, DESC_US, nbytes, lambda s, eager: rt.copy_batch(dsts, srcs, lens, s, eager))
        if measured:
            pace = (self.warm_paces if warm else self.paces)[to_host]
            waited = self.waits.take(t0)
            pace.record((self.clock.now() - t0 - waited) * 1e6, n, schedule_calls(n, eager))

    def copy_pitched(self, p: Pitched, ops: Callable[[], torch.Tensor], *, to_host: bool, stream: int | None = None,
                     nbytes: int | None = None) -> None:
        """Run the pitched copies ``p`` in one direction; ``ops`` gives their packed operation array
        (:func:`.pitched.ops_tensor`, memoised by the caller), ``nbytes`` their total when known.
        Row by row on the CPU and where the runtime lacks or refuses ``cudaMemcpy3DBatchAsync``."""
        if p.count == 0:
            return
        if self.device.type == "cuda":
            rt = runtime()
            if rt.has_batch3d and not self._pitched_refused:
                try:
                    self._submit(stream, p.count, PITCHED_DESC_US, p.nbytes if nbytes is None else nbytes,
                                 lambda s, eager: rt.copy_3d_batch(ops(), s, eager))
                    return
                except BatchSubmitError as exc:
                    if exc.submitted:
                        raise
                    # refused before anything was queued (a driver or memory kind the version check does
                    # not foresee): the same rows go as plain descriptors, now and from here on
                    self._pitched_refused = True
                    logger.warning("hicache copy engine: cudaMemcpy3DBatchAsync refused pitched copies on %s (%s); "
                                   "using plain descriptors", self.device, exc)
        host, dev, lens = expand(p)
        dst, src = (host, dev) if to_host else (dev, host)
        self.copy(dst, src, lens, stream)

    def _submit(self, stream: int | None, ops: int, op_us: float, nbytes: int,
                enqueue: Callable[[int, bool], None]) -> bool:
        """``enqueue(stream, eager)`` on the pool's device, ``eager`` as :class:`QueueClock` advises for
        ``ops`` operations of ~``op_us`` host time each, and record the ``nbytes`` queued; returns ``eager``."""
        s = self.stream() if stream is None else stream
        since = self.clock.now()
        eager = self.clock.eager(s, CALL_US + ops * op_us, burstable=ops <= _ONE_CALL)
        def submit() -> None:
            enqueue(s, eager)
            if s == 0:
                self._mark_legacy()

        self._on_device(submit)
        self.clock.queued(s, nbytes, since)
        return eager

    def _mark_legacy(self) -> None:
        """After copies submitted for the legacy default stream (handle 0): the batch API refuses that stream, so
        :mod:`.cudart` queues them on ``cudaStreamPerThread``, a blocking stream.  Work queued on the legacy stream
        later waits for them, but ``cudaStreamSynchronize(0)`` (``torch.cuda.current_stream().synchronize()``) and a
        query of the legacy stream need not: an event recorded on the legacy stream now is an operation there that
        waits for them, so both cover the copies."""
        mark = self._legacy_mark
        if mark is None:
            mark = self._legacy_mark = (torch.cuda.Event(), torch.cuda.default_stream(self._index))
        mark[0].record(mark[1])

    def _on_device(self, fn: Callable[[], None]) -> None:
        if current_device_index() != self._index:
            with torch.cuda.device(self._index):
                fn()
        else:
            fn()

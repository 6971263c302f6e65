"""How fast this host submits copy-engine descriptors, measured on a pool's own submissions.

The host's speed drifts by up to 2x over seconds (docs/performance.md), so a fixed per-descriptor cost
either wastes the copy engine while the host is fast or starves it while the host is slow.  Each
:class:`~.memcpy.BatchCopier` keeps a :class:`HostPace` per direction: the host time of ``direct``'s
recent calls that submit plain descriptors only (the whole call: a new index pair's plan too, so a
serving loop's fresh indices count), per descriptor, once the runtime's per-call cost is taken off; and
another per direction for the calls that reused a plan (no planning in the call: indices reused call after
call).  ``auto`` reads them to tell whether the host keeps up with the copy engine now (:func:`.auto_rules.fed`),
judging a new index pair at the pace of planning calls and a reused one at that of reused plans.  A
measure older than :data:`STALE_S` (:data:`WARM_STALE_S` for calls that reused a plan) no longer counts.

Only submissions that measure the host are sampled: CUDA ones of at least :data:`MIN_OPS`
descriptors that start with little copy work queued before them (:data:`MAX_BACKLOG_US`; behind a
deep queue the runtime call may wait for room in the stream's queue, which measures the engine).  Time the call
spent blocked on the GPU is left out of its sample (:class:`WaitLog`): reading GPU-resident indices back waits for
the work queued on the stream before the call (a forward pass's, milliseconds), which no copy of the call could
overtake and which says nothing of how fast the host submits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, TypeVar

__all__ = ["HostPace", "WINDOW", "MIN_SAMPLES", "MIN_OPS", "MAX_BACKLOG_US", "REDECIDE", "MODEL_CALL_US", "STALE_S",
           "WARM_STALE_S", "WaitLog"]

_T = TypeVar("_T")

#: Samples kept, the most recent; the estimate is their median, so a few stalled submissions (the thread
#: descheduled mid-call) do not move it.
WINDOW = 15
#: Samples needed before there is an estimate.  The first submissions after the host idled (a load after a
#: synchronise, the first call of a burst) can take 2-6x the steady pace (traced on an H200:
#: ``benchmarks/pace_trace.py``); with three samples one such call moved the median, and the decision made from it
#: held until the measure aged, as the route it picked sends no more samples.  The median of seven outlasts three.
MIN_SAMPLES = 7
#: Submissions of fewer descriptors are not sampled (the per-call cost dominates them).
MIN_OPS = 32
#: A submission that starts behind more queued copies than this (microseconds at the drain rate of
#: :class:`~.memcpy.QueueClock`) is not sampled.
MAX_BACKLOG_US = 2000.0
#: Relative move of the estimate that starts a new :attr:`HostPace.generation` (``auto`` decides again).
REDECIDE = 0.15
#: Host time of one runtime call taken off each sample, microseconds (the shipped calibration's
#: ``call_us``: ``hicache calibrate`` does not measure it).
MODEL_CALL_US = 6.0
#: Seconds after its last sample that a measure stops counting (the host's speed drifts within seconds).
STALE_S = 1.0
#: The same for the measures of calls that reused a plan (``warm`` paces).  A measure stops getting samples once
#: ``auto`` sends the calls to the kernel, so one slow stretch of the host holds the kernel until the measure ages;
#: measuring again costs a few copy-engine calls of a reused plan (cheap, unlike a new batch's planning).  On an
#: H200 (docs/perf/runs.md, 2026-12-02: 16 paired probe cells in two runs) 0.25 s instead of 1 s moved ``auto``'s
#: gap to the better route on reused-index bursts by a median +1.75 points where the copy engine was the better
#: route (7 of 8 cells) and -0.15 where the kernel was (a weak effect: one of the two runs alone is level); the
#: planning measures keep 1 s (re-measuring a new batch's planning is not cheap).
WARM_STALE_S = 0.25
_FLOOR_US = 0.01
_RECOMPUTE_EVERY = 4


class HostPace:
    """Recent host time per copy-engine descriptor of one copier's submissions.

    :attr:`desc_us` is the median of the last :data:`WINDOW` samples (``None`` before
    :data:`MIN_SAMPLES`); :attr:`generation` grows each time it moves by more than :data:`REDECIDE`
    (relative) from its value at the last change, so a caller that memoises decisions made from it
    knows when to make them again.  Samples may come from several threads: a lost update only delays
    the estimate.
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter, warm: bool = False) -> None:
        self.now = now
        #: Seconds after its last sample that this measure stops counting: :data:`WARM_STALE_S` for a measure of
        #: calls that reused a plan (``warm``), else :data:`STALE_S`.
        self.stale_s = WARM_STALE_S if warm else STALE_S
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._since_recompute = 0
        self.desc_us: float | None = None
        self.generation = 0
        self._anchor: float | None = None
        #: When this measure goes :meth:`stale` (and an estimate :meth:`aged`): its last sample's time plus
        #: :attr:`stale_s` (minus infinity before any sample).  Written by :meth:`record` alone, so another thread's
        #: :meth:`reset` never leaves it out of step; a plain attribute, for callers that check it on every call
        #: (``aged()`` is ``desc_us is not None and now > ages_at``).
        self.ages_at = float("-inf")

    def reset(self) -> None:
        """Forget the samples (a new measure starts); a new generation where an estimate is dropped (decisions made
        from it are made again)."""
        if self.desc_us is not None:
            self.generation += 1
        self._samples.clear()
        self._since_recompute = 0
        self.desc_us = self._anchor = None

    def stale(self) -> bool:
        """Whether the last sample is older than :attr:`stale_s` (or there is none)."""
        return self.now() > self.ages_at

    def aged(self) -> bool:
        """Whether there is an estimate and it is :meth:`stale` (:meth:`reset` it to measure afresh)."""
        return self.desc_us is not None and self.now() > self.ages_at

    def fresh(self) -> float | None:
        """:attr:`desc_us` if its last sample is at most :attr:`stale_s` old, else ``None``."""
        return self.desc_us if self.now() <= self.ages_at else None

    def record(self, host_us: float, ops: int, calls: int) -> None:
        """A submission of ``ops`` descriptors in ``calls`` runtime calls took ``host_us`` of host time.

        A sample that comes after the measure went :meth:`stale` (more than :attr:`stale_s` after the previous
        sample) starts a new one (:meth:`reset`): the samples before such a gap never make an estimate, also where
        there were too few of them to make one then.  Only the gap between samples counts: samples that come closer
        together than :attr:`stale_s` stay in the window however old the first of them is."""
        now = self.now()
        if self._samples and now > self.ages_at:
            self.reset()
        self.ages_at = now + self.stale_s
        self._samples.append(max(_FLOOR_US, (host_us - calls * MODEL_CALL_US) / ops))
        n = len(self._samples)
        if n < MIN_SAMPLES:
            return
        self._since_recompute += 1
        if self.desc_us is not None and self._since_recompute < _RECOMPUTE_EVERY:
            return
        self._since_recompute = 0
        ordered = sorted(self._samples)  # one snapshot: another thread's reset() may empty the window meanwhile
        if not ordered:
            return
        self.desc_us = est = ordered[len(ordered) // 2]
        anchor = self._anchor
        if anchor is None or abs(est - anchor) > REDECIDE * anchor:
            self._anchor = est
            self.generation += 1

    def samples(self) -> list[float]:
        """The samples kept (microseconds per descriptor), oldest first."""
        return list(self._samples)


#: Waits a :class:`WaitLog` keeps per thread until a sample takes them (a call reads a GPU tensor back at most a few
#: times; waits of calls that were never sampled are dropped from the oldest).
_WAITS_KEPT = 8


class WaitLog:
    """Host time spent blocked on the GPU within a copier's calls, per thread, kept apart from the host's own work.

    A plan that reads GPU-resident indices back (:class:`~.plans.Plan`) waits for the work queued on the stream
    before the call; :meth:`timed` runs such a wait and logs when it began and how long it took.  The copier's
    sample of the call (:meth:`~.memcpy.BatchCopier.copy`) takes off the waits logged in its thread since the call
    began (:meth:`take`).  Per thread: a pool's backup and load threads each see their own waits only.

    :param now: the copier's clock (seconds), the one its callers' call starts are read from.
    """

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self._local = threading.local()

    def _log(self) -> deque[tuple[float, float]]:
        log = getattr(self._local, "log", None)
        if log is None:
            log = self._local.log = deque(maxlen=_WAITS_KEPT)
        return log

    def timed(self, wait: Callable[[], _T]) -> _T:
        """``wait()``, logged as a wait of this thread (also when it raises)."""
        began = self.now()
        try:
            return wait()
        finally:
            self._log().append((began, self.now() - began))

    def take(self, since: float) -> float:
        """Seconds this thread waited from ``since`` on (waits that began then or later); forgets every wait logged
        so far in this thread, those before ``since`` too (a call that was not sampled)."""
        log = self._log()
        if not log:
            return 0.0
        waited = sum(length for began, length in log if began >= since)  # this thread's own log: no other writer
        log.clear()
        return waited

"""Measuring the host again as soon as it speeds up, from the kernel route's own calls (``auto``'s ``reprobe`` option).

Where ``auto`` gives a burst of one-layer loads with reused indices to the kernel because its measure of the host
(:class:`~.pace.HostPace` of calls that reused a plan) is too slow for the copy engine, that measure gets no more
samples until it ages (:data:`~.pace.WARM_STALE_S`): a host that speeds up meanwhile keeps the kernel although the
copy engine would now be faster.  The kernel route's calls measure the host too: their own host time per call moves
with the host's speed.  On an H100 host that switched between a fast and a slow state (fp8 656 B rows, reused-index
bursts, docs/performance.md), ``auto``'s kernel calls took 11-15 us each where ``direct``'s took ~50 us per layer, and
16-22 us where ``direct``'s took 78-98; in the bursts after a fast kernel burst the copy engine was the faster route.

:class:`Reprobe` is armed when ``auto`` picks the kernel for such a burst by a measure that judged the host too slow.
It keeps a :class:`~.pace.HostPace` of the kernel route's host time per call; its estimate once :data:`~.pace.WINDOW`
calls came after the decision is the reference, the host's slow state.  When a later estimate falls more than
:data:`DROP` below that reference, the host sped up: the measure that judged the burst is reset (a new generation:
``auto`` decides again, and with no measure its next decision sends calls to the copy engine to measure the host
afresh).  Once per arming.
"""

from __future__ import annotations

import time
from typing import Callable

from .pace import REDECIDE, WINDOW, HostPace

__all__ = ["Reprobe", "DROP"]

#: Relative fall of the kernel route's host time per call, from its reference after the decision, that counts as the
#: host having sped up (the host's two states above: 0.7x; the estimate is the median of the last
#: :data:`~.pace.WINDOW` calls, so a few fast calls do not move it).
DROP = REDECIDE


class Reprobe:
    """The kernel route's host time per call, watched for a host that sped up (see the module docstring).

    Not thread-safe beyond what :class:`~.pace.HostPace` is: a lost update delays a re-probe, never moves a byte.
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        #: The kernel route's host time per call (microseconds; a measure of reused-plan pace: it ages as fast).
        self.kernel = HostPace(now=now, warm=True)
        #: The measure a re-probe resets; ``None`` while not armed.
        self.target: HostPace | None = None
        #: The kernel's estimate once :data:`~.pace.WINDOW` calls came after the decision (``None`` before).
        self.ref: float | None = None
        #: Re-probes started (for tests and benchmarks).
        self.triggers = 0
        self._calls = 0

    def arm(self, target: HostPace) -> None:
        """``auto`` gave a reused pair's loads to the kernel because ``target`` judged the host too slow: watch the
        kernel's calls from here, and reset ``target`` once they show a faster host."""
        self.kernel.reset()
        self.target, self.ref, self._calls = target, None, 0

    def disarm(self) -> None:
        """``auto`` decides a load again: nothing to watch until the next :meth:`arm`."""
        self.target = None

    def record(self, host_us: float) -> None:
        """A one-layer load the kernel route served took ``host_us`` of host time."""
        target = self.target
        if target is None:
            return
        kernel = self.kernel
        kernel.record(host_us, 1, 0)
        self._calls += 1
        est = kernel.desc_us
        if est is None:
            return
        ref = self.ref
        if ref is None:
            if self._calls >= WINDOW:
                self.ref = est
            return
        if est < ref * (1.0 - DROP):
            self.target = None
            self.triggers += 1
            target.reset()

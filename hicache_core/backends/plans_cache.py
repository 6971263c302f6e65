"""The plan memo of the ``direct`` backend: :class:`PlanCache`, the last :data:`MEMO_SLOTS` plans of one pool and its
early reads of device index tensors.

Part of the copy plans whose public face is :mod:`hicache_core.backends.plans` (every name here is importable from
there too).
"""

from __future__ import annotations

import threading
import weakref
from typing import cast

import torch

from ..binding import PoolBinding
from ..kernel_support import index_memos
from ..validate import pair_where, tensor_version
from .pace import WaitLog
from .plans_early import EarlyRead
from . import plans_plan
from .plans_plan import Plan

__all__ = ["PlanCache", "MEMO_SLOTS"]

#: Plans kept per pool (an engine's backup and load threads each hold one pair).
MEMO_SLOTS = 8


class PlanCache:
    """The last :data:`MEMO_SLOTS` plans of one pool, keyed by index tensors, versions and stream.

    ``waits``: the copier's :class:`~.pace.WaitLog`, where the plans made here log their waits on the GPU."""

    def __init__(self, binding: PoolBinding, staging: str, staging_bytes: int, pitched: bool = False,
                 waits: WaitLog | None = None) -> None:
        # a proxy, also in the plans made here: the cache lives in the binding's scratch, and a strong reference
        # back would keep a dropped pool's buffers alive until the garbage collector runs
        self.binding = cast(PoolBinding, weakref.proxy(binding))
        self.staging, self.staging_bytes = staging, staging_bytes
        self.pitched = pitched
        self.waits = waits
        #: Whether plans outlive their call: not on a pool that checks and copies every call afresh (``validate=
        #: "full"``/``"strict"``: its index memos are off), where a write torch does not count (NumPy, ``.data``)
        #: would leave a memoised plan moving the old rows.  There a plan serves the call that made it only (``auto``
        #: sizes it while deciding, ``direct`` submits it): it is keyed by the pool's check of that call.
        self.memoise = index_memos(binding)[0].enabled
        self._slots: list[tuple[torch.Tensor, int, torch.Tensor, int, int, tuple, tuple, object, Plan]] = []
        #: Early reads of device index tensors (:meth:`read_early`), newest first, at most :data:`MEMO_SLOTS`.
        self._early: list[EarlyRead] = []
        self._lock = threading.Lock()

    def read_early(self, device_indices: torch.Tensor, stream: int) -> EarlyRead | None:
        """Start reading ``device_indices`` back on the current stream (handle ``stream``) for a plan made later on it
        (:class:`EarlyRead`), where they live on the pool's CUDA device, have a version counter and have no early read
        on that stream yet; the read, else ``None``."""
        if not (isinstance(device_indices, torch.Tensor) and device_indices.device == self.binding.device
                and plans_plan.defer_device_read(self.binding) and tensor_version(device_indices) is not None):
            return None
        if self.early_of(device_indices, stream) is not None:
            return None
        early = EarlyRead(device_indices, stream)
        with self._lock:  # a new list each time: readers iterate a snapshot without the lock
            self._early = [early, *self._early][:MEMO_SLOTS]
        return early

    def early_of(self, device_indices: torch.Tensor, stream: int) -> EarlyRead | None:
        """The early read of ``device_indices`` as they are now, made on ``stream``, else ``None``."""
        for early in self._early:
            if early.of(device_indices, stream):
                return early
        return None

    def get(self, host_indices: torch.Tensor, device_indices: torch.Tensor, stream: int) -> Plan:
        plan = self.peek(host_indices, device_indices, stream)
        if plan is not None:
            return plan
        # read before the plan copies the values: a write landing meanwhile leaves the plan unmemoised under them
        hv, dv = tensor_version(host_indices), tensor_version(device_indices)
        where = pair_where(host_indices, device_indices)
        early = self.early_of(device_indices, stream) if self._early else None
        plan = Plan(self.binding, host_indices, device_indices, self.staging, self.staging_bytes, self.pitched,
                    early=early, stream=stream, waits=self.waits)
        if early is not None and plan._early is early:
            with self._lock:  # taken: the plan holds it now
                self._early = [e for e in self._early if e is not early]
        call = None if self.memoise else self.binding.checked
        if hv is not None and dv is not None and (self.memoise or call is not None):
            with self._lock:  # a new list each time: readers iterate a snapshot without the lock
                # the storages are held with the slot: a .data swap's freed storage cannot give its address to
                # another one while the slot compares addresses
                held = (host_indices.untyped_storage(), device_indices.untyped_storage())
                self._slots = [(host_indices, hv, device_indices, dv, stream, where, held, call, plan),
                               *self._slots][:MEMO_SLOTS]
        return plan

    def peek(self, host_indices: torch.Tensor, device_indices: torch.Tensor, stream: int) -> Plan | None:
        """The memoised plan of these index tensors (the same objects, unchanged: version counters, and addresses and
        lengths, which a ``.data`` swap changes) on ``stream``, else ``None`` (builds nothing)."""
        for h, hv0, d, dv0, s, where, _, call, plan in self._slots:  # identity first: anything else finds nothing
            if h is host_indices and d is device_indices and s == stream:
                if call is not None and call is not self.binding.checked:
                    return None  # made in an earlier call of a pool that checks every call: not reused
                return plan if h._version == hv0 and d._version == dv0 and pair_where(h, d) == where else None
        return None

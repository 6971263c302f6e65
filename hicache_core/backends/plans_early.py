"""Early reads of the ``direct`` backend's copy plans: a device index tensor's values started on their way to the host
before the work a plan made later would wait for (:class:`EarlyRead`).

Part of the copy plans whose public face is :mod:`hicache_core.backends.plans` (importable from there too).
"""

from __future__ import annotations

import torch

from ..validate import tensor_version, tensor_where

__all__ = ["EarlyRead"]


class EarlyRead:
    """A device index tensor's values on their way to the host, started before the work that a plan made later would
    otherwise wait for.

    Made at an index pair's first call (``auto``'s ``prefetch`` option), before that call queues any transfer: an own
    ``int64`` copy on the device (what a staged route indexes with) and an asynchronous copy of it into pinned host
    memory, both on the current stream, and an event recorded behind them.  A :class:`~hicache_core.backends.plans.Plan`
    made later for the same tensor (the same object, its version counter unchanged) takes both: reading the values
    then waits for that event only, not for the loads queued on the stream since (H200, beside a memory-bound kernel: a
    read behind a burst's queued kernel loads took 20-38 ms).  Only a plan on the stream the read was made on takes it
    (as an :class:`~hicache_core.kernel_support.IndexMemo` copy is reused): the device copy is ordered on that stream
    alone.

    :param stream: the handle of the current stream (the plans' key:
        :meth:`~hicache_core.backends.plans.PlanCache.get`)."""

    __slots__ = ("source", "version", "where", "storage", "stream", "dev", "host", "event")

    def __init__(self, device_indices: torch.Tensor, stream: int) -> None:
        self.source = device_indices
        self.version = tensor_version(device_indices)
        # a .data swap keeps the object and its version: its address, length and dtype tell (the storage is held,
        # so no other one takes its address meanwhile)
        self.where = tensor_where(device_indices)
        self.storage = device_indices.untyped_storage()
        self.stream = stream
        self.dev = device_indices.to(torch.int64, copy=True)
        # pinned, so the copy is queued without waiting for the stream; read only after the event below
        self.host = self.dev.to("cpu", non_blocking=True)
        self.event: torch.cuda.Event | None = None
        if self.dev.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.dev.device))

    def of(self, device_indices: torch.Tensor, stream: int) -> bool:
        """Whether this read is of ``device_indices`` as they are now (the same object, unchanged since), made on
        ``stream``."""
        return device_indices is self.source and stream == self.stream and self.version is not None and \
            tensor_version(device_indices) == self.version and \
            tensor_where(device_indices) == self.where

    def ready(self) -> bool:
        """Whether the values have reached the host (reading them now waits for nothing)."""
        return self.event is None or self.event.query()

    def values(self) -> torch.Tensor:
        """The values on the host, once they are there (waits for this read's event, nothing queued after it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host

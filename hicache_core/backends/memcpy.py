"""Submitting many raw-pointer copies: ``memmove`` on CPU, the CUDA runtime's batched copy on GPUs."""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

from .cudart import runtime, runtime_unavailable_reason
from .pitched import Pitched, expand

__all__ = ["BatchCopier"]

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

    @staticmethod
    def unavailable_on_cuda() -> str | None:
        """``None`` when CUDA copies can be submitted here, else why not."""
        return runtime_unavailable_reason()

    def stream(self) -> int:
        """The ``cudaStream_t`` of the pool device's current stream (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.current_stream(self._index).cuda_stream)

    def pitched_support(self) -> bool:
        """Whether pitched copies go to the copy engine in one call here (``cudaMemcpy3DBatchAsync``);
        the CPU runs them row by row, so they hold there too."""
        if self.device.type != "cuda":
            return True
        try:
            return runtime().has_batch3d
        except RuntimeError:
            return False

    def copy(self, dsts: torch.Tensor, srcs: torch.Tensor, lens: torch.Tensor, stream: int | None = None) -> None:
        """Copy every range; ``dsts``/``srcs``/``lens`` are contiguous CPU int64 tensors of one length."""
        if dsts.numel() == 0:
            return
        if self.device.type != "cuda":
            for dst, src, n in zip(dsts.tolist(), srcs.tolist(), lens.tolist()):
                ctypes.memmove(dst, src, n)
            return
        rt = runtime()
        self._on_device(lambda: rt.copy_batch(dsts, srcs, lens, self.stream() if stream is None else stream))

    def copy_pitched(self, p: Pitched, ops: Callable[[], torch.Tensor], *, to_host: bool, stream: int | None = None) -> None:
        """Run the pitched copies ``p`` in one direction; ``ops`` gives their packed operation array
        (:func:`.pitched.ops_tensor`, memoised by the caller).  Row by row on the CPU and where the
        runtime lacks ``cudaMemcpy3DBatchAsync``."""
        if p.count == 0:
            return
        if self.device.type == "cuda":
            rt = runtime()
            if rt.has_batch3d:
                self._on_device(lambda: rt.copy_3d_batch(ops(), self.stream() if stream is None else stream))
                return
        host, dev, lens = expand(p)
        dst, src = (host, dev) if to_host else (dev, host)
        self.copy(dst, src, lens, stream)

    def _on_device(self, fn: Callable[[], None]) -> None:
        if torch.cuda.current_device() != self._index:
            with torch.cuda.device(self._index):
                fn()
        else:
            fn()

"""Submitting many raw-pointer copies: ``memmove`` on CPU, the CUDA runtime on GPUs."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

__all__ = ["BatchCopier"]

_CUDA_STREAM_PER_THREAD = 2  # cudaStreamPerThread

logger = logging.getLogger(__name__)


def _load_runtime() -> Any:
    try:
        from cuda.bindings import runtime as rt  # type: ignore[import-not-found]
    except ImportError:
        return None
    return rt


class BatchCopier:
    """Copies ``lens[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` (raw addresses).

    On CUDA the copies are enqueued on the current stream without host
    synchronisation (host memory must be pinned for that): one
    ``cudaMemcpyBatchAsync`` per call where the runtime has it (CUDA >= 12.8
    through ``cuda-bindings``; on the legacy default stream, which that API
    refuses, the batch goes to the per-thread default stream, which is ordered
    with it), else one ``cudaMemcpyAsync`` per run.  On the
    CPU they run immediately (``memmove``).  Callers guarantee every range is in
    bounds.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._rt = _load_runtime() if self.device.type == "cuda" else None
        self._batch = self._rt is not None and hasattr(self._rt, "cudaMemcpyBatchAsync")
        self._attrs: Any = None

    @staticmethod
    def available_on_cuda() -> bool:
        """Whether CUDA copies can be submitted here (``cuda-bindings`` importable)."""
        return _load_runtime() is not None

    def copy(self, dsts: torch.Tensor, srcs: torch.Tensor, lens: torch.Tensor, *, to_host: bool) -> None:
        if self.device.type != "cuda":
            for dst, src, n in zip(dsts.tolist(), srcs.tolist(), lens.tolist()):
                ctypes.memmove(dst, src, n)
            return
        if self._rt is None:
            raise RuntimeError("the direct backend on CUDA needs cuda-bindings (pip install cuda-bindings)")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        d, s, n = dsts.tolist(), srcs.tolist(), lens.tolist()
        if self._batch and len(d) > 1:
            # The batch API refuses the legacy NULL stream.  The per-thread default
            # stream is a blocking stream, so it stays ordered with legacy-stream work.
            stream = stream or _CUDA_STREAM_PER_THREAD
            try:
                self._submit_batch(d, s, n, stream)
                return
            except Exception as exc:  # older driver / bindings: fall back once and remember
                logger.warning("cudaMemcpyBatchAsync unavailable (%s); using cudaMemcpyAsync per run", exc)
                self._batch = False
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDefault
        for dst, src, size in zip(d, s, n):
            (err,) = self._rt.cudaMemcpyAsync(dst, src, size, kind, stream)
            if int(err) != 0:
                raise RuntimeError(f"cudaMemcpyAsync failed: {err}")

    def _submit_batch(self, d: list[int], s: list[int], n: list[int], stream: int) -> None:
        rt: Any = self._rt
        if self._attrs is None:
            attr = rt.cudaMemcpyAttributes()
            attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            self._attrs = attr
        res = rt.cudaMemcpyBatchAsync(d, s, n, len(d), [self._attrs], [0], 1, stream)
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"cudaMemcpyBatchAsync returned {err}")

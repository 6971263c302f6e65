"""Submitting many raw-pointer copies: ``memmove`` on CPU, the CUDA runtime on GPUs."""

from __future__ import annotations

import ctypes
import logging

import torch

__all__ = ["BatchCopier"]

logger = logging.getLogger(__name__)


class BatchCopier:
    """Copies ``lens[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` (raw addresses).

    On CUDA the copies are enqueued on the current stream without host
    synchronisation (host memory must be pinned for that), one
    ``cudaMemcpyAsync`` per run through ``cuda-bindings``; on the CPU they run
    immediately.  Callers guarantee every range is in bounds.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._rt = None
        if self.device.type == "cuda":
            try:
                from cuda.bindings import runtime as rt  # type: ignore[import-not-found]

                self._rt = rt
            except ImportError:
                logger.info("cuda-bindings not installed: direct copies fall back to torch copy_ per run")

    def copy(self, dsts: torch.Tensor, srcs: torch.Tensor, lens: torch.Tensor, *, to_host: bool) -> None:
        if self.device.type != "cuda":
            for dst, src, n in zip(dsts.tolist(), srcs.tolist(), lens.tolist()):
                ctypes.memmove(dst, src, n)
            return
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self._rt is not None:
            kind = self._rt.cudaMemcpyKind.cudaMemcpyDefault
            for dst, src, n in zip(dsts.tolist(), srcs.tolist(), lens.tolist()):
                (err,) = self._rt.cudaMemcpyAsync(dst, src, n, kind, stream)
                if int(err) != 0:
                    raise RuntimeError(f"cudaMemcpyAsync failed: {err}")
            return
        raise RuntimeError("the direct backend on CUDA needs cuda-bindings (pip install cuda-bindings)")

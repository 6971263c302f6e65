"""``direct``: the copy engine, over coalesced runs or through a short device-side relayout.

Runs are derived from the layout's addressing alone, so any layout with
declared strides is served.  Two routes, picked per call from the byte sizes
the copy engine would see:

* **plain**: one copy per maximal run that is contiguous on both sides
  (adjacent rows merged), straight between device rows and host slots.
* **staged**: when whole host pages are contiguous blocks much larger than the
  plain runs, and the plain runs are small (e.g. one 1152-byte row per token in
  a token-major host layout, or the split parts of a row) or so many that
  submitting them costs the host (one run per layer and page of separately
  allocated device layers), the rows are relaid on the device into a bounded
  staging buffer holding those pages' host image (D2D at HBM speed, one short
  kernel launch per segment group and chunk), and the copy engine moves whole
  page blocks; loads run the other way.  See :mod:`.staging`.

Descriptor arrays are int64 tensors built with vectorised torch arithmetic
and handed to ``cudaMemcpyBatchAsync`` in one call (:mod:`.cudart`); nothing
is converted element by element.  Everything derived from one pair of index
tensors is memoised per pool (:class:`~.plans.PlanCache`), so the per-layer
calls of a load burst cost one memo lookup and one runtime call each.  Host
indices are read on the CPU (device-resident ones therefore wait, once per new
pair, for the work queued before the call).  Device indices on the pool's GPU
are read back only when a plain route needs them (or ``auto`` staging needs the
plain runs to decide): a staged route indexes with them on the device (its
relayout kernel masks rows outside the device buffers,
so with ``validate="shapes"`` an out-of-range row moves nothing and its host
slot receives undefined bytes; ``validate="full"`` checks values first).  On
CPU pools every copy is a ``memmove``.

``submit="worker"`` takes calls whose index tensors live on the GPU off the
calling thread: a worker thread reads the values and submits the copies, while
the caller's stream is gated so that its later work still runs after them
(:mod:`.gate`).  The call returns in microseconds instead of waiting for the
work queued before it; an error found by the worker (an index out of range,
say) moves nothing and is raised by the next such call as
:class:`~hicache_core.errors.DeferredTransferError`.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from ..binding import PoolBinding
from ..errors import ConfigError
from ..layout import Layout
from ..spec import PoolSpec
from ..strategy import DirectionalStrategy
from .gate import CudaGate, SubmitWorker, driver_unavailable_reason
from .memcpy import BatchCopier
from .plans import PlanCache, Submission, coalesce
from .staging import DEFAULT_STAGING_BYTES, StagingBuffers

__all__ = ["DirectStrategy", "coalesce", "ENV_STAGING", "ENV_STAGING_BYTES", "ENV_PITCHED", "STAGING_MODES",
           "PITCHED_MODES", "ENV_SUBMIT", "SUBMIT_MODES"]

#: ``auto`` (default: staged where it gives the copy engine larger blocks, see
#: :meth:`.plans.Plan._staged`), ``always`` (wherever whole pages allow it) or ``never``.
ENV_STAGING = "HICACHE_DIRECT_STAGING"
#: Bytes of device staging per stream (default 512 MiB, two halves); larger calls go in chunks.
ENV_STAGING_BYTES = "HICACHE_STAGING_BYTES"
STAGING_MODES = ("auto", "always", "never")
#: ``auto`` (default: pitched copies across evenly spaced layers of one device allocation, where the
#: CUDA runtime and driver are 13.x: ``cudaMemcpy3DBatchAsync``) or ``never`` (one plain descriptor
#: per block and layer).
ENV_PITCHED = "HICACHE_DIRECT_PITCHED"
PITCHED_MODES = ("auto", "never")
#: ``inline`` (default: the calling thread submits every copy, reading GPU-resident index values back
#: first) or ``worker`` (calls with an index tensor on the pool's GPU are submitted by a worker thread
#: behind a stream gate; see :mod:`.gate`).
ENV_SUBMIT = "HICACHE_DIRECT_SUBMIT"
SUBMIT_MODES = ("inline", "worker")


class DirectStrategy(DirectionalStrategy):
    """Copy-engine transfers (``memmove`` on CPU).

    :param staging: ``auto``, ``always`` or ``never`` (default: ``$HICACHE_DIRECT_STAGING`` or ``auto``).
    :param staging_bytes: device staging budget per stream, in bytes.
    :param pitched: ``auto`` or ``never`` (default: ``$HICACHE_DIRECT_PITCHED`` or ``auto``): whether
        all-layer transfers may move a block across evenly spaced layers as one pitched copy.
    :param submit: ``inline`` or ``worker`` (default: ``$HICACHE_DIRECT_SUBMIT`` or ``inline``): who
        submits calls whose index tensors are on the GPU (see the module docstring).
    """

    def __init__(self, staging: str | None = None, staging_bytes: int | None = None, pitched: str | None = None,
                 submit: str | None = None) -> None:
        self.staging = _mode("staging", staging, ENV_STAGING, STAGING_MODES, "auto")
        self.pitched = _mode("pitched", pitched, ENV_PITCHED, PITCHED_MODES, "auto")
        self.submit = _mode("submit", submit, ENV_SUBMIT, SUBMIT_MODES, "inline")
        if staging_bytes is None:
            raw = os.environ.get(ENV_STAGING_BYTES, "").strip()
            try:
                staging_bytes = int(raw) if raw else DEFAULT_STAGING_BYTES
            except ValueError:
                raise ConfigError(f"{ENV_STAGING_BYTES}={raw!r}: give a byte count, e.g. 134217728") from None
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 1:
            raise ConfigError(f"direct staging_bytes={staging_bytes!r}: give a positive byte count")
        self.staging_bytes = staging_bytes

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        if spec.device.type == "cuda":
            why = BatchCopier.unavailable_on_cuda()
            return None if why is None else f"direct on CUDA: {why}"
        if spec.device.type != "cpu":
            return f"direct serves CUDA and CPU pools, not {spec.device.type}"
        return None

    def prepare(self, binding: PoolBinding) -> None:
        copier = BatchCopier(binding.device)
        binding.scratch["direct.copier"] = copier
        binding.scratch["direct.plans"] = PlanCache(binding, self.staging, self.staging_bytes,
                                                    self.pitched == "auto" and copier.pitched_support())
        binding.scratch["direct.staging"] = StagingBuffers(binding.device)
        if self.submit == "worker" and binding.device.type == "cuda":
            why = driver_unavailable_reason()
            if why is not None:
                raise ConfigError(f"direct submit='worker' on {binding.device}: {why}; use submit='inline'")
            binding.scratch["direct.worker"] = SubmitWorker(CudaGate(binding.device),
                                                            f"hicache-submit-{binding.device}")

    def submission(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                   layer: int | None) -> Submission:
        """What a transfer of these indices would submit (memoised); ``auto`` reads its block sizes."""
        copier: BatchCopier = binding.scratch["direct.copier"]
        return self._submission(binding, host_indices, device_indices, layer, copier.stream())

    @staticmethod
    def _submission(binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                    layer: int | None, stream: int) -> Submission:
        plans: PlanCache = binding.scratch["direct.plans"]
        return plans.get(host_indices, device_indices, stream).submission(layer)

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        worker: SubmitWorker | None = binding.scratch.get("direct.worker")
        if worker is not None and (host_indices.device == binding.device or device_indices.device == binding.device):
            copier: BatchCopier = binding.scratch["direct.copier"]
            plans: PlanCache = binding.scratch["direct.plans"]

            def job(wait_for_caller: Callable[[], None]) -> None:
                stream = copier.stream()  # the worker's stream
                if not plans.cached(host_indices, device_indices, stream):
                    wait_for_caller()  # the plan reads index values: wait here, not on the caller's thread
                self._transfer(binding, host_indices, device_indices, layer, to_host, stream)
            worker.submit(copier.torch_stream(), job)
            return
        if worker is not None:
            worker.raise_pending()
        copier = binding.scratch["direct.copier"]
        self._transfer(binding, host_indices, device_indices, layer, to_host, copier.stream())

    def _transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                  layer: int | None, to_host: bool, stream: int) -> None:
        copier: BatchCopier = binding.scratch["direct.copier"]
        sub = self._submission(binding, host_indices, device_indices, layer, stream)
        if sub.staged is None:
            if sub.pitched is not None:
                copier.copy_pitched(sub.pitched, lambda: sub.pitched_ops(to_host), to_host=to_host, stream=stream,
                                    nbytes=sub.pitched_nbytes)
            dst, src = (sub.host, sub.dev) if to_host else (sub.dev, sub.host)
            copier.copy(dst, src, sub.lens, stream, sub.plain_nbytes)
            return
        sub.staged.run(binding, copier, binding.scratch["direct.staging"], stream, to_host=to_host)


def _mode(name: str, value: str | None, env: str, modes: tuple[str, ...], default: str) -> str:
    mode = value if value is not None else (os.environ.get(env, default).strip().lower() or default)
    if mode not in modes:
        raise ConfigError(f"direct {name}={mode!r} (or {env}): use one of {', '.join(modes)}")
    return mode

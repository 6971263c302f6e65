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
pair, for the work queued before the call; the host's measured pace leaves
that wait out, :class:`~.pace.WaitLog`).  Device indices on the pool's GPU
are read back only when a plain route needs them (or ``auto`` staging needs the
plain runs to decide): a staged route indexes with them on the device (its
relayout kernel masks rows outside the device buffers,
so with ``validate="shapes"`` an out-of-range row reads nothing and its host
slot receives zeros; ``validate="full"`` checks values first).  On
CPU pools every copy is a ``memmove``.

Some calls are a poor fit for the copy engine whatever the route: a one-layer load
of a token-major host layout is one row per token.  The first time a CUDA pool
submits hundreds of blocks averaging under 4 KiB it logs a warning naming the
call and pointing to ``auto``, which serves such calls with the layout's kernel.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..binding import PoolBinding
from ..errors import ConfigError
from ..layout import Layout
from ..replay import Lane
from ..spec import PoolSpec
from ..strategy import DirectionalStrategy
from .memcpy import BatchCopier
from .plans import PlanCache, Submission, coalesce, warn_small_blocks
from .relayout import relayout_mode
from .staging import DEFAULT_STAGING_BYTES, StagingBuffers

__all__ = ["DirectStrategy", "coalesce", "ENV_STAGING", "ENV_STAGING_BYTES", "ENV_PITCHED", "STAGING_MODES",
           "PITCHED_MODES"]

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


class DirectStrategy(DirectionalStrategy):
    """Copy-engine transfers (``memmove`` on CPU).

    :param staging: ``auto``, ``always`` or ``never`` (default: ``$HICACHE_DIRECT_STAGING`` or ``auto``).
    :param staging_bytes: device staging budget per stream, in bytes.
    :param pitched: ``auto`` or ``never`` (default: ``$HICACHE_DIRECT_PITCHED`` or ``auto``): whether
        all-layer transfers may move a block across evenly spaced layers as one pitched copy.
    """

    def __init__(self, staging: str | None = None, staging_bytes: int | None = None, pitched: str | None = None) -> None:
        mode = staging if staging is not None else (os.environ.get(ENV_STAGING, "auto").strip().lower() or "auto")
        if mode not in STAGING_MODES:
            raise ConfigError(f"direct staging={mode!r} (or {ENV_STAGING}): use one of {', '.join(STAGING_MODES)}")
        self.staging = mode
        if mode != "never":  # a bad $HICACHE_STAGED_RELAYOUT fails here, with the other settings, not mid-transfer
            relayout_mode()
        pmode = pitched if pitched is not None else (os.environ.get(ENV_PITCHED, "auto").strip().lower() or "auto")
        if pmode not in PITCHED_MODES:
            raise ConfigError(f"direct pitched={pmode!r} (or {ENV_PITCHED}): use one of {', '.join(PITCHED_MODES)}")
        self.pitched = pmode
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
                                                    self.pitched == "auto" and copier.pitched_support(),
                                                    waits=copier.waits)
        binding.scratch["direct.staging"] = StagingBuffers(binding.device)

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
                 layer: int | None, *, to_host: bool, since: float | None = None) -> None:
        """Submit the call; ``since``: the copier clock's time when the caller's call began, where a caller (``auto``)
        did part of the call's work, such as planning this pair, before handing it on (default: now)."""
        copier: BatchCopier = binding.scratch["direct.copier"]
        if since is None:
            since = copier.clock.now()  # the host's pace counts the whole call (a new pair's or layer's plan too)
        stream = copier.stream()
        sub = self._submission(binding, host_indices, device_indices, layer, stream)
        if not any(sub.served):  # once per submission: a pool moving tiny blocks is told about auto
            warn_small_blocks(binding, sub, layer)
        self._run(binding, copier, sub, stream, to_host, since, warm=sub.served[to_host])
        sub.served[to_host] = True

    def lane(self, binding: PoolBinding, to_host: bool) -> Lane:
        """The fast path of a repeated call (see :class:`~hicache_core.strategy.Strategy`): the submission a
        transfer of this direction made for these index tensors (the same objects, unchanged) and layer on the
        current stream, submitted again; ``False`` (nothing submitted) when there is none.

        Two more arguments, which the lane's ``takes_since`` attribute announces (a wrapper of the plain
        three-argument kind is called without them): ``since``, a time of the copier's clock
        (``binding.scratch["direct.copier"].clock``) when the caller's call began, where a strategy wrapping this one
        (``auto``) spent host time before it, so that the host's measured pace holds that time as it holds a planning
        call's (default: the lane's own start); ``stream``, the current stream's handle on the pool's device where the
        caller has read it already (default: read here)."""
        plans: PlanCache = binding.scratch["direct.plans"]
        copier: BatchCopier = binding.scratch["direct.copier"]
        run = self._run

        now = copier.clock.now

        def lane(layer: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 since: float | None = None, stream: int | None = None) -> bool:
            if since is None:
                since = now()
            if stream is None:
                stream = copier.stream()
            plan = plans.peek(host_indices, device_indices, stream)
            sub = None if plan is None else plan.peek(layer)
            if sub is None or not sub.served[to_host]:
                return False
            run(binding, copier, sub, stream, to_host, since, warm=True)
            return True

        setattr(lane, "takes_since", True)  # what a caller checks before passing since and stream (auto's lane)
        return lane

    @staticmethod
    def _run(binding: PoolBinding, copier: BatchCopier, sub: Submission, stream: int, to_host: bool,
             since: float | None = None, warm: bool = False) -> None:
        """Submit ``sub`` in one direction on ``stream``; plain descriptors alone are sampled for the host's pace
        (:attr:`.memcpy.BatchCopier.paces`, or its ``warm_paces`` where ``warm``: ``sub`` served this direction
        before, so the call planned nothing), from ``since``."""
        if sub.staged is None:
            if sub.pitched is not None:
                copier.copy_pitched(sub.pitched, lambda: sub.pitched_ops(to_host), to_host=to_host, stream=stream,
                                    nbytes=sub.pitched_nbytes)
            dst, src = (sub.host, sub.dev) if to_host else (sub.dev, sub.host)
            copier.copy(dst, src, sub.lens, stream, sub.plain_nbytes, to_host=None if sub.pitched is not None else to_host,
                        since=since, warm=warm)
            return
        sub.staged.run(binding, copier, binding.scratch["direct.staging"], stream, to_host=to_host)

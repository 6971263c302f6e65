"""``example.engine``: a vendor io_backend.  Here the "engine" is a CPU stand-in (torch gather/scatter).

A real engine would take the pointer tables built in ``prepare`` and submit
DMA descriptors on the current stream; this one serves CPU pools only, so it
runs anywhere the conformance kit runs.

What a vendor backend must do that the pool does not: keep *device-resident*
index values in range (the pool checks CPU indices, and device-resident ones
only with ``validate="full"``), without a host synchronisation.  Rows with an
out-of-range slot are redirected onto the first in-range row of the batch with
that row's own bytes (a duplicate identical write), or, when no row is in range,
write the destination's own bytes back: nothing outside the batch changes.
"""

from __future__ import annotations

import torch

from hicache_core import DirectionalStrategy, Layout, PoolBinding, PoolSpec

__all__ = ["EngineStrategy"]


def _scatter_in_range(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for every ``i`` whose indices are both in range; no host sync."""
    ok = (dst_idx >= 0) & (dst_idx < dst.shape[0]) & (src_idx >= 0) & (src_idx < src.shape[0])
    first = torch.argmax(ok.to(torch.int8))  # first in-range row (0 when none)
    di = torch.where(ok, dst_idx, dst_idx[first]).clamp(0, dst.shape[0] - 1)
    si = torch.where(ok, src_idx, src_idx[first]).clamp(0, src.shape[0] - 1)
    dst.index_put_((di,), torch.where(ok.any(), src[si], dst[di]))


class EngineStrategy(DirectionalStrategy):
    """Vendor strategy for ``example_packed``; ``strategy_options`` arrive as keywords (none are used)."""

    #: The rejection the conformance kit may see (its pools live on the GPU where there is one): a skip, not a failure.
    conformance_rejects = (r"^example\.engine is a CPU stand-in for a vendor engine",)

    def __init__(self, **options: object) -> None:
        self.options = options

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        if spec.device.type != "cpu":
            return f"example.engine is a CPU stand-in for a vendor engine; the pool is on {spec.device}"
        return None

    def prepare(self, binding: PoolBinding) -> None:
        views = []
        for seg in binding.segments:
            a = seg.segment.addressing
            flat = seg.host_flat
            for i in range(len(seg.device_layers)):
                start = flat.storage_offset() + seg.host_layers[i] * a.layer + a.offset
                # [S, width] view of this layer's slots (rows are ``token`` bytes apart)
                host = flat.as_strided((binding.spec.capacity, seg.width), (a.token, 1), start)
                views.append((seg.device_layers[i], host, seg.device_rows[i]))
        binding.scratch["example.engine"] = views

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        h, d = host_indices.long(), device_indices.long()
        for dev_layer, host, dev in binding.scratch["example.engine"]:
            if layer is None or dev_layer == layer:
                if to_host:
                    _scatter_in_range(host, h, dev, d)
                else:
                    _scatter_in_range(dev, d, host, h)

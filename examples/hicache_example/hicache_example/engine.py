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


def _in_range(dst_idx: torch.Tensor, dst_n: int, src_idx: torch.Tensor,
              src_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(any, dst, src)``: the pairs to copy, every out-of-range pair replaced by the batch's first in-range pair
    (``any`` is False where none is in range: the caller writes the destination's own bytes back); no host sync."""
    ok = (dst_idx >= 0) & (dst_idx < dst_n) & (src_idx >= 0) & (src_idx < src_n)
    first = torch.argmax(ok.to(torch.int8))  # first in-range pair (0 when none)
    di = torch.where(ok, dst_idx, dst_idx[first]).clamp(0, dst_n - 1)
    si = torch.where(ok, src_idx, src_idx[first]).clamp(0, src_n - 1)
    return ok.any(), di, si


class EngineStrategy(DirectionalStrategy):
    """Vendor strategy; ``strategy_options`` arrive as keywords (none are used).  Registered for ``example_packed``,
    it serves any layout (it reads each segment's ``host_view``): register it with ``layouts=(ANY_LAYOUT,)`` to
    serve every installed one."""

    #: The rejection the conformance kit may see (its pools live on the GPU where there is one): a skip, not a failure.
    conformance_rejects = (r"^example\.engine is a CPU stand-in for a vendor engine",)

    def __init__(self, **options: object) -> None:
        self.options = options

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        if spec.device.type != "cpu":
            return f"example.engine is a CPU stand-in for a vendor engine; the pool is on {spec.device}"
        return None

    def prepare(self, binding: PoolBinding) -> None:
        # Per (segment, entry): the device layer, the host layer's slots as the layout lays them out
        # (``host_view[host layer]``: [pages, page_size, chunks, chunk_bytes], any page, token and chunk strides, so
        # this serves every layout, layer- or page-major) and the device rows [N, width].
        views = []
        for seg in binding.segments:
            for i, dev_layer in enumerate(seg.device_layers):
                views.append((dev_layer, seg.host_view[seg.host_layers[i]], seg.device_rows[i]))
        binding.scratch["example.engine"] = views

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        ps, slots = binding.spec.page_size, binding.spec.capacity
        h, d = host_indices.long(), device_indices.long()
        for dev_layer, host, dev in binding.scratch["example.engine"]:
            if layer is not None and dev_layer != layer:
                continue
            if to_host:
                ok, hi, di = _in_range(h, slots, d, dev.shape[0])
                at = (hi // ps, hi % ps)  # a slot's page and its token in the page
                host.index_put_(at, torch.where(ok, dev[di].view(-1, *host.shape[2:]), host[at]))
            else:
                ok, di, hi = _in_range(d, dev.shape[0], h, slots)
                rows = host[hi // ps, hi % ps].reshape(len(hi), -1)
                dev.index_put_((di,), torch.where(ok, rows, dev[di]))

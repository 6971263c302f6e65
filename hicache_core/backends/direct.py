"""``direct``: copy-engine copies over coalesced contiguous runs.

Runs are derived from the layout's addressing alone, so any layout with
declared strides is served.  Adjacent rows that are contiguous on both sides
are merged into one copy; the structure of the runs is computed once per
segment and call, then shifted per layer.  On CUDA the copies are submitted in
one batch (``cudaMemcpyBatchAsync``) when the runtime offers it, else one
``copy_`` per run; on the CPU each run is a ``memmove``.  Index tensors are
moved to the CPU (device-resident indices therefore synchronise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..binding import BoundSegment, PoolBinding
from ..errors import IndexRangeError
from ..layout import Layout
from ..spec import PoolSpec
from ..strategy import DirectionalStrategy
from .common import as_long, selected
from .memcpy import BatchCopier

__all__ = ["DirectStrategy", "coalesce"]


def coalesce(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge equal-size copies ``src[k] -> dst[k]`` (byte offsets, in order) into maximal runs.

    Returns ``(dst_starts, src_starts, lengths)``.
    """
    if dst.numel() == 0:
        return dst, src, dst
    brk = torch.ones_like(dst, dtype=torch.bool)
    brk[1:] = (dst[1:] - dst[:-1] != nbytes) | (src[1:] - src[:-1] != nbytes)
    starts = brk.nonzero().squeeze(1)
    counts = torch.diff(starts, append=torch.tensor([dst.numel()]))
    return dst[starts], src[starts], counts * nbytes


@dataclass(frozen=True)
class _Entry:
    host_base: int  # address of the segment's host layer slot (offset included)
    dev_base: int  # address of device row 0
    dev_stride: int


def _storage_base(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _check_bounds(binding: PoolBinding, h: torch.Tensor, d: torch.Tensor) -> None:
    if h.numel() == 0:
        return
    rows = binding.device_rows
    if int(h.min()) < 0 or int(h.max()) >= binding.spec.capacity or int(d.min()) < 0 or int(d.max()) >= rows:
        raise IndexRangeError(
            f"direct: host_indices must lie in 0..{binding.spec.capacity - 1} and device_indices in 0..{rows - 1}; "
            "nothing was copied"
        )


class DirectStrategy(DirectionalStrategy):
    """Copy-engine transfers; plain ``memmove`` on CPU."""

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        if spec.device.type == "cuda" and not BatchCopier.available_on_cuda():
            return "direct on CUDA submits copies through cuda-bindings, which is not installed (pip install cuda-bindings)"
        if spec.device.type not in ("cuda", "cpu"):
            return f"direct serves CUDA and CPU pools, not {spec.device.type}"
        return None

    def prepare(self, binding: PoolBinding) -> None:
        table = {}
        for seg in binding.segments:
            a = seg.segment.addressing
            hbase = seg.host_flat.data_ptr() + a.offset
            table[id(seg)] = [
                _Entry(hbase + seg.host_layers[e] * a.layer, seg.dev_ptrs[e], seg.dev_strides[e])
                for e in range(len(seg.device_layers))
            ]
        binding.scratch["direct.entries"] = table
        binding.scratch["direct.copier"] = BatchCopier(binding.device)

    def _runs(
        self, seg: BoundSegment, h: torch.Tensor, d: torch.Tensor, stride: int, ps: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = seg.segment.addressing
        nch = a.chunks(seg.width)
        chunk = torch.arange(nch, dtype=torch.int64)
        host = ((h // ps) * a.page + (h % ps) * a.token).unsqueeze(1) + chunk * (a.chunk_stride or a.chunk_bytes)
        dev = (d * stride).unsqueeze(1) + chunk * a.chunk_bytes
        return coalesce(host.reshape(-1), dev.reshape(-1), a.chunk_bytes)

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        h = as_long(host_indices, "cpu")
        d = as_long(device_indices, "cpu")
        _check_bounds(binding, h, d)  # indices are on the CPU now: never copy to unchecked addresses
        ps = binding.spec.page_size
        entries = binding.scratch["direct.entries"]
        copier: BatchCopier = binding.scratch["direct.copier"]
        dsts, srcs, lens = [], [], []
        cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for seg, e in selected(binding, layer):
            ent = entries[id(seg)][e]
            key = (id(seg), ent.dev_stride)
            if key not in cache:
                cache[key] = self._runs(seg, h, d, ent.dev_stride, ps)
            hr, dr, n = cache[key]
            host_ptrs, dev_ptrs = hr + ent.host_base, dr + ent.dev_base
            dsts.append(host_ptrs if to_host else dev_ptrs)
            srcs.append(dev_ptrs if to_host else host_ptrs)
            lens.append(n)
        if dsts:
            copier.copy(torch.cat(dsts), torch.cat(srcs), torch.cat(lens), to_host=to_host)


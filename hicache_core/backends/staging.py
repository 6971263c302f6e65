"""The staged route of ``direct``: device-side relayout into host page images, whole-page copies.

For a transfer of whole host pages, every segment's bytes of one page (for the
host layers the call touches) lie in a few contiguous blocks of the host
buffer; in page-major layouts often one block of megabytes.  The staged route
keeps a device buffer holding those blocks for a chunk of pages, laid out
exactly as in host memory (the "page image", from the lowest to the highest
byte touched), so that:

* backup: per owned layer, the device rows are gathered into the image with
  two short torch kernels (gather, strided copy) at HBM speed; then the copy
  engine moves each page's blocks to the host in one batch;
* load: the copy engine moves the blocks into the image; per layer the rows
  are scattered from it to the device rows.

Everything is enqueued on one stream, chunk after chunk, so the staging
buffer (bounded by ``staging_bytes``) is reused safely.  The route exists only
when the host indices are whole, aligned pages (as the allocator hands them
out); otherwise ``direct`` uses plain runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..binding import BoundSegment, PoolBinding

if TYPE_CHECKING:
    from .memcpy import BatchCopier

__all__ = ["StagedRoute", "StagingBuffers", "page_image", "DEFAULT_STAGING_BYTES"]

#: Device staging per stream.  256 MiB holds the whole all-layer image of 4096 MLA
#: tokens (61 x 576 bf16 = 288 MB) in two chunks.
DEFAULT_STAGING_BYTES = 256 << 20


def page_image(seg: BoundSegment, host_layers: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged contiguous blocks ``(starts, lengths)`` of one page of ``seg`` over ``host_layers``.

    Offsets are relative to the page's base address in the host buffer (the
    segment's offset included), sorted.
    """
    a = seg.segment.addressing
    nch = a.chunks(seg.width)
    h = torch.tensor(host_layers, dtype=torch.int64).view(-1, 1, 1) * a.layer
    t = torch.arange(page_size, dtype=torch.int64).view(1, -1, 1) * a.token
    c = torch.arange(nch, dtype=torch.int64).view(1, 1, -1) * (a.chunk_stride or a.chunk_bytes)
    starts = (a.offset + h + t + c).reshape(-1).sort().values
    brk = torch.ones_like(starts, dtype=torch.bool)
    brk[1:] = starts[1:] - starts[:-1] != a.chunk_bytes
    first = brk.nonzero().squeeze(1)
    counts = torch.diff(first, append=torch.tensor([starts.numel()]))
    return starts[first], counts * a.chunk_bytes


@dataclass(frozen=True)
class _Image:
    """One segment's part of the staging buffer: ``span`` bytes per page, from ``lo``."""

    seg: BoundSegment
    entries: tuple[int, ...]
    starts: torch.Tensor  # block offsets relative to the page base
    lens: torch.Tensor
    lo: int
    span: int


class StagedRoute:
    """A staged transfer of whole pages, chunked to fit the staging budget."""

    def __init__(self, binding: PoolBinding, pages: torch.Tensor, d_dev: Callable[[], torch.Tensor],
                 images: list[_Image], staging_bytes: int) -> None:
        self.binding = binding
        self.pages = pages
        self._d_dev = d_dev
        self.images = images
        per_page = sum(im.span for im in images)
        self.chunk_pages = max(1, min(int(pages.numel()), staging_bytes // per_page))
        self.chunk_bytes = self.chunk_pages * per_page
        self.count = int(pages.numel()) * sum(int(im.lens.numel()) for im in images)
        self.nbytes = int(pages.numel()) * sum(int(im.lens.sum()) for im in images)
        # host addresses and image offsets of every block, page-major; per chunk a slice
        host, rel, lens = [], [], []
        region = 0
        for im in images:
            a = im.seg.segment.addressing
            base = im.seg.host_flat.data_ptr()
            host.append((base + pages.unsqueeze(1) * a.page + im.starts.unsqueeze(0)))
            k = torch.arange(pages.numel(), dtype=torch.int64).unsqueeze(1) % self.chunk_pages
            rel.append(region + k * im.span + (im.starts - im.lo).unsqueeze(0))
            lens.append(im.lens.unsqueeze(0).expand(pages.numel(), -1))
            region += self.chunk_pages * im.span
        self._host = torch.cat(host, 1).contiguous()
        self._rel = torch.cat(rel, 1).contiguous()
        self._lens = torch.cat(lens, 1).contiguous()

    @classmethod
    def build(cls, binding: PoolBinding, h: torch.Tensor, d_dev: Callable[[], torch.Tensor], layer: int | None,
              staging_bytes: int) -> StagedRoute | None:
        """The staged route for host slots ``h`` (CPU int64), or ``None`` when they are not whole aligned pages."""
        ps = binding.spec.page_size
        groups = h.view(-1, ps)
        pages = groups[:, 0] // ps
        if not bool((groups == (pages * ps).unsqueeze(1) + torch.arange(ps, dtype=torch.int64)).all()):
            return None
        images = []
        for seg in binding.segments:
            entries = tuple(seg.entries(layer))
            if not entries:
                continue
            starts, lens = page_image(seg, [seg.host_layers[e] for e in entries], ps)
            lo = int(starts[0])
            span = int(starts[-1] + lens[-1]) - lo
            images.append(_Image(seg, entries, starts, lens, lo, span))
        if not images:
            return None
        return cls(binding, pages, d_dev, images, staging_bytes)

    def run(self, binding: PoolBinding, copier: BatchCopier, staging: torch.Tensor, stream: int, *, to_host: bool) -> None:
        """Enqueue the whole transfer, chunk by chunk, on the current stream."""
        ps = binding.spec.page_size
        n = int(self.pages.numel())
        base = staging.data_ptr()
        d_dev = self._d_dev()
        for p0 in range(0, n, self.chunk_pages):
            p1 = min(n, p0 + self.chunk_pages)
            rows = d_dev[p0 * ps : p1 * ps]
            host = self._host[p0:p1].reshape(-1)
            img = (self._rel[p0:p1] + base).reshape(-1)
            lens = self._lens[p0:p1].reshape(-1)
            if to_host:
                self._relayout(staging, rows, p1 - p0, to_image=True)
                copier.copy(host, img, lens, stream)
            else:
                copier.copy(img, host, lens, stream)
                self._relayout(staging, rows, p1 - p0, to_image=False)

    def _relayout(self, staging: torch.Tensor, rows: torch.Tensor, npages: int, *, to_image: bool) -> None:
        ps = self.binding.spec.page_size
        region = 0
        for im in self.images:
            a = im.seg.segment.addressing
            nch, cb = a.chunks(im.seg.width), a.chunk_bytes
            for e in im.entries:
                start = staging.storage_offset() + region + a.offset + im.seg.host_layers[e] * a.layer - im.lo
                view = staging.as_strided((npages, ps, nch, cb), (im.span, a.token, a.chunk_stride or cb, 1), start)
                dev = im.seg.device_rows[e]
                if to_image:
                    view.copy_(dev[rows].view(npages, ps, nch, cb))
                else:
                    dev[rows] = view.reshape(npages * ps, im.seg.width)
            region += self.chunk_pages * im.span


class StagingBuffers:
    """One staging buffer per stream of a pool, grown on demand (never shared across streams)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, stream: int, nbytes: int) -> torch.Tensor:
        with self._lock:
            buf = self._buffers.get(stream)
            if buf is None or buf.numel() < nbytes:
                buf = self._buffers[stream] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return buf

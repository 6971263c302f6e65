"""The staged route of ``direct``: device-side relayout into host page images, whole-page copies.

For a transfer of whole host pages, every segment's bytes of one page (for the
host layers the call touches) lie in a few contiguous blocks of the host
buffer; in page-major layouts often one block of megabytes.  The staged route
keeps a device buffer holding those blocks for a chunk of pages, laid out
exactly as in host memory (the "page image", from the lowest to the highest
byte touched), so that:

* backup: the device rows of every owned layer are gathered into the image at
  HBM speed; then the copy engine moves each page's blocks to the host in one
  batch;
* load: the copy engine moves the blocks into the image; then the rows are
  scattered from it to the device rows.

The relayout (gather or scatter) is one Triton kernel launch per segment group
per chunk (:mod:`.relayout`: segments whose rows split into chunks of one
width share a launch that covers every layer entry), with per-entry tables
built once per pool and layer selection.  The torch relayout (an index_select
and a strided copy, or an index_copy_, per layer entry and chunk) is the
fallback: on the CPU unless ``TRITON_INTERPRET=1`` is set and the kernel is
asked for, where Triton does not import, or when the caller asks for it
(``relayout="torch"`` or ``$HICACHE_STAGED_RELAYOUT``, see
:func:`.relayout.resolve_relayout`).  Chunks are sized to the launches they
cost the host (:data:`LAUNCH_US`, :data:`BYTES_PER_LAUNCH`).

On CUDA the staging buffer (``staging_bytes``) is split in two halves and
the relayout runs on a side stream, so the relayout of one chunk overlaps the
copy-engine transfer of the previous one; events order every reuse of a half,
and the caller's stream waits for the side stream before anything after the
transfer runs.  On the CPU the chunks run one after the other.  The route exists only
when the host indices are whole, aligned pages (as the allocator hands them
out); otherwise ``direct`` uses plain runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..binding import BoundSegment, PoolBinding
from .relayout import KernelRelayout, kernel_relayout, resolve_relayout

if TYPE_CHECKING:
    from .memcpy import BatchCopier

__all__ = ["StagedRoute", "StagingBuffers", "page_image", "DEFAULT_STAGING_BYTES"]

#: Device staging per stream (two halves): at most 512 MiB.
DEFAULT_STAGING_BYTES = 512 << 20
#: Host time of one relayout launch and bytes per chunk it should cover.  A chunk costs
#: :attr:`StagedRoute.launches_per_chunk` launches: one kernel per segment group with the kernel
#: relayout, two torch ops per layer entry with the torch one.  A torch launch measured ~10 us on an
#: H200 host (the kernel launch is counted alike until measured), so a chunk must carry >= ~1 MB
#: per launch for the host to stay ahead of a 55 GB/s link (else it is host-bound: 64 MiB chunks of
#: an 80-layer MHA backup into a token-major host layout ran at 0.30 of memcpy, torch relayout).
LAUNCH_US = 10.0
BYTES_PER_LAUNCH = 1 << 20


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
    """A staged transfer of whole pages, chunked to fit the staging budget.

    :param relayout: ``auto``, ``kernel`` or ``torch`` (``None``: ``$HICACHE_STAGED_RELAYOUT`` or
        ``auto``); see :func:`.relayout.resolve_relayout`.  :attr:`relayout` holds the one used.
    """

    def __init__(self, binding: PoolBinding, pages: torch.Tensor, d_dev: Callable[[], torch.Tensor],
                 images: list[_Image], staging_bytes: int, *, relayout: str | None = None) -> None:
        self.binding = binding
        self.pages = pages
        self._d_dev = d_dev
        self.images = images
        self.relayout = resolve_relayout(binding.device, relayout)
        self._kernel: KernelRelayout | None = None
        if self.relayout == "kernel":
            self._kernel = kernel_relayout(binding, images)
            self.launches_per_chunk = self._kernel.launches
        else:
            self.launches_per_chunk = 2 * sum(len(im.entries) for im in images)
        per_page = sum(im.span for im in images)
        want = max(staging_bytes // 4, self.launches_per_chunk * BYTES_PER_LAUNCH)  # per half: a quarter of the budget, more if the launches need it
        self.chunk_pages = max(1, min(int(pages.numel()), min(want, staging_bytes // 2) // per_page))
        self.chunk_bytes = self.chunk_pages * per_page
        self.count = int(pages.numel()) * sum(int(im.lens.numel()) for im in images)
        self.chunks = -(-int(pages.numel()) // self.chunk_pages)
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
              staging_bytes: int, *, relayout: str | None = None) -> StagedRoute | None:
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
        return cls(binding, pages, d_dev, images, staging_bytes, relayout=relayout)

    def _chunk(self, p0: int, p1: int, base: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host addresses, image addresses (image at ``base``) and lengths of pages ``p0:p1``."""
        return (self._host[p0:p1].reshape(-1), (self._rel[p0:p1] + base).reshape(-1), self._lens[p0:p1].reshape(-1))

    def run(self, binding: PoolBinding, copier: BatchCopier, buffers: StagingBuffers, stream: int, *, to_host: bool) -> None:
        """Enqueue the whole transfer, chunk by chunk, ordered after the current stream's work."""
        with buffers.run_lock(stream):
            if binding.device.type != "cuda":
                self._run_serial(copier, buffers.get(stream, self.chunk_bytes), to_host=to_host)
            else:
                self._run_pipelined(copier, buffers, stream, to_host=to_host)

    def _run_serial(self, copier: BatchCopier, staging: torch.Tensor, *, to_host: bool) -> None:
        ps = self.binding.spec.page_size
        n = int(self.pages.numel())
        d_dev = self._d_dev()
        for p0 in range(0, n, self.chunk_pages):
            p1 = min(n, p0 + self.chunk_pages)
            host, img, lens = self._chunk(p0, p1, staging.data_ptr())
            rows = d_dev[p0 * ps : p1 * ps]
            if to_host:
                self._relayout(staging, rows, p1 - p0, to_image=True)
                copier.copy(host, img, lens)
            else:
                copier.copy(img, host, lens)
                self._relayout(staging, rows, p1 - p0, to_image=False)

    def _run_pipelined(self, copier: BatchCopier, buffers: StagingBuffers, stream: int, *, to_host: bool) -> None:
        ps = self.binding.spec.page_size
        n = int(self.pages.numel())
        device = self.binding.device
        main = torch.cuda.current_stream(device)
        side = buffers.side_stream(stream)
        staging = buffers.get(stream, 2 * self.chunk_bytes)
        halves = (staging[: self.chunk_bytes], staging[self.chunk_bytes : 2 * self.chunk_bytes])
        d_dev = self._d_dev()
        d_dev.record_stream(side)
        staging.record_stream(side)
        free: list[torch.cuda.Event | None] = [None, None]
        side.wait_stream(main)  # rows written (backup) or indices made (load) by earlier work
        for k, p0 in enumerate(range(0, n, self.chunk_pages)):
            p1 = min(n, p0 + self.chunk_pages)
            half = halves[k % 2]
            host, img, lens = self._chunk(p0, p1, half.data_ptr())
            rows = d_dev[p0 * ps : p1 * ps]
            if to_host:
                with torch.cuda.stream(side):
                    ev = free[k % 2]
                    if ev is not None:
                        side.wait_event(ev)  # the copy engine has read this half
                    self._relayout(half, rows, p1 - p0, to_image=True)
                    ready = side.record_event()
                main.wait_event(ready)
                copier.copy(host, img, lens, stream)
                free[k % 2] = main.record_event()
            else:
                ev = free[k % 2]
                if ev is not None:
                    main.wait_event(ev)  # the scatter has read this half
                copier.copy(img, host, lens, stream)
                landed = main.record_event()
                with torch.cuda.stream(side):
                    side.wait_event(landed)
                    self._relayout(half, rows, p1 - p0, to_image=False)
                    free[k % 2] = side.record_event()
        main.wait_stream(side)

    def _relayout(self, staging: torch.Tensor, rows: torch.Tensor, npages: int, *, to_image: bool) -> None:
        """Gather ``rows`` (``npages`` pages) into the chunk image at ``staging``, or scatter them from it."""
        if self._kernel is not None and self._kernel.run(staging, rows, npages, self.chunk_pages, to_image=to_image):
            return
        self._relayout_torch(staging, rows, npages, to_image=to_image)

    def _relayout_torch(self, staging: torch.Tensor, rows: torch.Tensor, npages: int, *, to_image: bool) -> None:
        """Two torch ops per layer entry (the fallback, and the reference of the kernel's tests)."""
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
                    view.copy_(torch.index_select(dev, 0, rows).view(npages, ps, nch, cb))
                else:
                    dev.index_copy_(0, rows, view.reshape(npages * ps, im.seg.width))
            region += self.chunk_pages * im.span


class StagingBuffers:
    """One staging buffer and one side stream per caller stream of a pool, grown on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[int, torch.Tensor] = {}
        self._sides: dict[int, torch.cuda.Stream] = {}
        self._runs: dict[int, threading.Lock] = {}
        self._lock = threading.RLock()  # get() takes side_stream() under it

    def run_lock(self, stream: int) -> threading.Lock:
        """Held for the whole enqueueing of one staged transfer: two threads on one caller stream
        would otherwise fill the same staging half on the same side stream."""
        with self._lock:
            lock = self._runs.get(stream)
            if lock is None:
                lock = self._runs[stream] = threading.Lock()
            return lock

    def side_stream(self, stream: int) -> torch.cuda.Stream:
        """The relayout stream paired with the caller's stream ``stream``."""
        with self._lock:
            side = self._sides.get(stream)
            if side is None:
                side = self._sides[stream] = torch.cuda.Stream(self.device)
            return side

    def get(self, stream: int, nbytes: int) -> torch.Tensor:
        with self._lock:
            buf = self._buffers.get(stream)
            if buf is None or buf.numel() < nbytes:
                if buf is not None and self.device.type == "cuda":
                    buf.record_stream(self.side_stream(stream))  # a pending relayout may still read it
                buf = self._buffers[stream] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return buf

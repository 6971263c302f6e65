"""The staged route of ``direct``: device-side relayout into host page images, whole-page copies.

For a transfer of whole host pages, every segment's bytes of one page (for the
host layers the call touches) lie in a few contiguous blocks of the host
buffer; in page-major layouts often one block of megabytes.  The staged route
keeps a device buffer holding those blocks for a chunk of pages (the "page
image"): laid out as in host memory from the lowest to the highest byte touched,
or, where the blocks have gaps between them (one block per layer of a
layer-major host layout) and every layer entry's rows of a page lie in one
block, packed back to back.  Then:

* backup: the device rows of every owned layer are gathered into the image at
  HBM speed; then the copy engine moves each page's blocks to the host (a
  page's equal, evenly spaced blocks as one pitched copy where the runtime
  takes them);
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

import logging
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from ..binding import BoundSegment, PoolBinding
from .cudart import BatchSubmitError
from .pitched import MAX_PITCH, MIN_HEIGHT, OPERAND_PTR, PITCHED_OP_US, Pitched, ops_tensor
from .relayout import KernelRelayout, kernel_relayout, resolve_relayout

if TYPE_CHECKING:
    from .memcpy import BatchCopier

logger = logging.getLogger(__name__)

__all__ = ["StagedRoute", "StagingBuffers", "page_image", "page_images", "DEFAULT_STAGING_BYTES"]

#: Device staging per stream (two halves): at most 512 MiB.  A chunk holds at least one page, so a smaller budget is
#: exceeded by up to two page images; a page whose two images would need more than this and the budget, the route
#: leaves to plain runs (:meth:`StagedRoute.build`).
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
    """One segment's part of the staging buffer: ``span`` bytes per page.

    Block ``b`` of a page (host offset ``starts[b]`` from the page base, ``lens[b]`` bytes) lies at
    ``rel[b]`` in the page's span: ``starts - lo`` when the image mirrors the host bytes from the
    lowest to the highest one touched, or packed back to back (``compact``) when the host blocks have
    gaps between them (one block per layer of a layer-major host layout) and each entry's rows of a
    page lie in one block.  ``pitched`` is ``(width, host step, image step)`` when the page's blocks are
    equal and evenly spaced on both sides (one pitched copy per page), else ``None``.
    """

    seg: BoundSegment
    entries: tuple[int, ...]
    starts: torch.Tensor  # block offsets relative to the page base
    lens: torch.Tensor
    lo: int
    span: int
    rel: torch.Tensor  # block offsets in the page's span
    offsets: dict[int, int]  # entry -> offset of its first row in the page's span
    compact: bool = False
    pitched: tuple[int, int, int] | None = None

    def entry_offset(self, e: int) -> int:
        """Offset in a page's span of entry ``e``'s first row."""
        return self.offsets[e]

    @classmethod
    def build(cls, seg: BoundSegment, entries: tuple[int, ...], page_size: int, pitched: bool) -> _Image:
        starts, lens = page_image(seg, [seg.host_layers[e] for e in entries], page_size)
        lo = int(starts[0])
        span = int(starts[-1] + lens[-1]) - lo
        rel, compact = starts - lo, False
        total = int(lens.sum())
        if total < span and _rows_within_blocks(seg, entries, starts, lens, page_size):
            rel, span, compact = torch.cumsum(lens, 0) - lens, total, True
        a = seg.segment.addressing
        first = a.offset + torch.tensor([seg.host_layers[e] for e in entries], dtype=torch.int64) * a.layer
        b = torch.searchsorted(starts, first, right=True) - 1  # the block holding each entry's first row
        offsets = dict(zip(entries, (rel[b] + first - starts[b]).tolist()))
        return cls(seg, entries, starts, lens, lo, span, rel, offsets, compact,
                   _pitch(starts, lens, rel) if pitched else None)


def page_images(binding: PoolBinding, layer: int | None, pitched: bool) -> list[_Image]:
    """The page images of every segment with entries in ``layer`` (``None``: all layers); they depend
    on the pool and the layer selection only, so they are built once per pool (kept in its scratch)."""
    memo: dict[tuple[int | None, bool], list[_Image]] = binding.scratch.setdefault("staging.images", {})
    key = (layer, pitched)
    hit = memo.get(key)
    if hit is None:
        ps = binding.spec.page_size
        hit = memo[key] = [_Image.build(seg, entries, ps, pitched) for seg in binding.segments
                           if (entries := tuple(seg.entries(layer)))]
    return hit


def _rows_within_blocks(seg: BoundSegment, entries: tuple[int, ...], starts: torch.Tensor, lens: torch.Tensor,
                        page_size: int) -> bool:
    """Whether every entry's rows of one page lie within a single block of the page image (so
    packing the blocks back to back keeps each entry's rows at their host strides)."""
    a = seg.segment.addressing
    nch = a.chunks(seg.width)
    extent = (page_size - 1) * a.token + (nch - 1) * (a.chunk_stride or a.chunk_bytes) + a.chunk_bytes
    first = a.offset + torch.tensor([seg.host_layers[e] for e in entries], dtype=torch.int64) * a.layer
    b = torch.searchsorted(starts, first, right=True) - 1
    return bool((b >= 0).all()) and bool((first + extent <= starts[b] + lens[b]).all())


def _pitch(starts: torch.Tensor, lens: torch.Tensor, rel: torch.Tensor) -> tuple[int, int, int] | None:
    """``(width, host step, image step)`` when the blocks are equal and evenly spaced on both sides."""
    if starts.numel() < MIN_HEIGHT or bool((lens != lens[0]).any()):
        return None
    width, hs, rs = int(lens[0]), starts[1:] - starts[:-1], rel[1:] - rel[:-1]
    h, r = int(hs[0]), int(rs[0])
    if bool((hs != h).any()) or bool((rs != r).any()) or not (width <= h <= MAX_PITCH and width <= r <= MAX_PITCH):
        return None
    return width, h, r


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
        self._check_rows: Callable[[], object] | None = None
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
        n = int(pages.numel())
        self.blocks = n * sum(int(im.lens.numel()) for im in images)
        self.chunks = -(-n // self.chunk_pages)
        self.nbytes = n * sum(int(im.lens.sum()) for im in images)
        # host addresses and image offsets of every block, page-major (per chunk a slice); the blocks
        # of a pitched image are one pitched copy per page
        host, rel, lens = [], [], []
        p_host, p_rel, p_shape = [], [], []
        region = 0
        k = torch.arange(n, dtype=torch.int64) % self.chunk_pages
        for im in images:
            a = im.seg.segment.addressing
            page_base = im.seg.host_flat.data_ptr() + pages * a.page
            at = region + k * im.span
            if im.pitched is not None:
                p_host.append(page_base + int(im.starts[0]))
                p_rel.append(at + int(im.rel[0]))
                p_shape.append((im.pitched[0], int(im.starts.numel()), im.pitched[1], im.pitched[2]))
            else:
                host.append(page_base.unsqueeze(1) + im.starts.unsqueeze(0))
                rel.append(at.unsqueeze(1) + im.rel.unsqueeze(0))
                lens.append(im.lens.unsqueeze(0).expand(n, -1))
            region += self.chunk_pages * im.span
        empty = torch.empty((n, 0), dtype=torch.int64)
        self._host = torch.cat(host, 1).contiguous() if host else empty
        self._rel = torch.cat(rel, 1).contiguous() if rel else empty
        self._lens = torch.cat(lens, 1).contiguous() if lens else empty
        self._p_host = torch.stack(p_host, 1).contiguous() if p_host else empty
        self._p_rel = torch.stack(p_rel, 1).contiguous() if p_rel else empty
        # width, height, host pitch, image pitch of each pitched image
        self._p_shape = torch.tensor(p_shape, dtype=torch.int64).view(-1, 4)
        self._p_bytes = int((self._p_shape[:, 0] * self._p_shape[:, 1]).sum())  # per page
        self._ops: dict[bool, torch.Tensor] = {}
        #: copy-engine operations per transfer: plain descriptors plus one pitched copy per page and pitched image
        self.count = int(self._host.numel()) + int(self._p_host.numel())

    @classmethod
    def build(cls, binding: PoolBinding, h: torch.Tensor, d_dev: Callable[[], torch.Tensor], layer: int | None,
              staging_bytes: int, *, relayout: str | None = None, pitched: bool = False,
              check_rows: Callable[[], object] | None = None) -> StagedRoute | None:
        """The staged route for host slots ``h`` (CPU int64), or ``None`` when they are not whole aligned pages.

        ``pitched``: whether the copy engine takes pitched copies here (then a page's equal, evenly
        spaced blocks of one segment go as one pitched copy).  ``check_rows``: reads and range-checks
        the device rows (raising if one is out of range) where their values were not checked on the
        host; it runs before any torch relayout, whose index ops must not see a bad row.
        """
        ps = binding.spec.page_size
        if h.numel() % ps:
            return None  # not whole pages (a pool's checks refuse such indices first; a caller below them gets None)
        groups = h.view(-1, ps)
        pages = groups[:, 0] // ps
        if not bool((groups == (pages * ps).unsqueeze(1) + torch.arange(ps, dtype=torch.int64)).all()):
            return None
        images = page_images(binding, layer, pitched)
        if not images:
            return None
        per_page = sum(im.span for im in images)
        if 2 * per_page > max(staging_bytes, DEFAULT_STAGING_BYTES):
            # a chunk holds at least one page (two halves on CUDA); a page image mirrors the host from the lowest to
            # the highest byte touched, which for rows not packable per block can span most of the pool: such
            # images are not staged at all rather than outgrow both the budget and the default
            logger.debug("direct: a page image of %d B would need more than the staging budget of %d B twice over: "
                         "plain runs", per_page, max(staging_bytes, DEFAULT_STAGING_BYTES))
            return None
        route = cls(binding, pages, d_dev, images, staging_bytes, relayout=relayout)
        route._check_rows = check_rows
        return route

    def host_us(self, submit_us: float, call_us: float) -> float:
        """Estimated host time to enqueue the whole transfer (see :meth:`.plans.Submission.host_us`)."""
        from .cudart import batch_calls

        def calls(per_page: int) -> int:  # one runtime call (or a few) per chunk of pages
            pages = int(self.pages.numel())
            last = pages - (self.chunks - 1) * self.chunk_pages
            return (self.chunks - 1) * batch_calls(self.chunk_pages * per_page) + batch_calls(last * per_page)

        plain, pitched = int(self._host.shape[1]), int(self._p_host.shape[1])
        return (int(self._host.numel()) * submit_us + (calls(plain) * call_us if plain else 0.0)
                + int(self._p_host.numel()) * PITCHED_OP_US + (calls(pitched) * call_us if pitched else 0.0)
                + self.chunks * self.launches_per_chunk * LAUNCH_US)

    def _copy(self, copier: BatchCopier, p0: int, p1: int, base: int, stream: int | None, *, to_host: bool) -> None:
        """Enqueue the copy-engine part of pages ``p0:p1`` with the chunk image at ``base``."""
        if self._host.shape[1]:
            host, img = self._host[p0:p1].reshape(-1), (self._rel[p0:p1] + base).reshape(-1)
            lens = self._lens[p0:p1].reshape(-1)
            if to_host:
                copier.copy(host, img, lens, stream)
            else:
                copier.copy(img, host, lens, stream)
        if self._p_host.shape[1]:
            m = p1 - p0
            shape = self._p_shape.repeat(m, 1)
            p = Pitched(self._p_host[p0:p1].reshape(-1), (self._p_rel[p0:p1] + base).reshape(-1),
                        shape[:, 0], shape[:, 1], shape[:, 2], shape[:, 3])
            copier.copy_pitched(p, lambda: self._chunk_ops(p0, p1, base, to_host), to_host=to_host, stream=stream,
                                nbytes=m * self._p_bytes)

    def _chunk_ops(self, p0: int, p1: int, base: int, to_host: bool) -> torch.Tensor:
        """The packed pitched operations of pages ``p0:p1`` with the chunk image at ``base``: rows of an
        array built once per direction with image offsets, the image's pointer word shifted by ``base``."""
        ops = self._ops.get(to_host)
        if ops is None:
            shape = self._p_shape.repeat(int(self.pages.numel()), 1)
            everything = Pitched(self._p_host.reshape(-1), self._p_rel.reshape(-1), shape[:, 0], shape[:, 1],
                                 shape[:, 2], shape[:, 3])
            ops = self._ops[to_host] = ops_tensor(everything, to_host=to_host)
        n = int(self._p_host.shape[1])
        chunk = ops[p0 * n : p1 * n].clone()
        chunk[:, OPERAND_PTR[not to_host]] += base  # the image is the source of a backup, the destination of a load
        return chunk

    def run(self, binding: PoolBinding, copier: BatchCopier, buffers: StagingBuffers, stream: int, *, to_host: bool) -> None:
        """Enqueue the whole transfer, chunk by chunk, ordered after the current stream's work.

        :raises BatchSubmitError: a chunk's copy-engine call failed; the chunks before it stay queued (their pages
            move), which the error says, with :attr:`~.cudart.BatchSubmitError.submitted` counting their copies."""
        if self._check_rows is not None and self._kernel is None:
            self._check_rows()  # the torch relayout's index ops must not see a bad row: check before anything moves
            self._check_rows = None
        at = [0, 0]  # the chunk under way: its first page and the page after it
        try:
            with buffers.running(stream):
                if binding.device.type != "cuda":
                    self._run_serial(copier, buffers.get(stream, self.chunk_bytes), at, to_host=to_host)
                else:
                    self._run_pipelined(copier, buffers, stream, at, to_host=to_host)
        except BatchSubmitError as exc:
            done, n = at[0], int(self.pages.numel())
            if done == 0:
                raise  # the first chunk's: the error's own count is the transfer's
            before = int(self._host[:done].numel() + self._p_host[:done].numel())
            raise BatchSubmitError(
                f"{exc}; this staged {'backup' if to_host else 'load'} of {n} pages had queued its chunks before the "
                f"failing one whole (pages 0-{done - 1} in the call's order, {before} copies: they stay queued and "
                f"move); pages {done}-{at[1] - 1} (the failing chunk) may be moved in part, the rest not",
                before + exc.submitted) from exc

    def _run_serial(self, copier: BatchCopier, staging: torch.Tensor, at: list[int], *, to_host: bool) -> None:
        """The chunks one after another (CPU); ``at``: set to the chunk under way (:meth:`run`)."""
        ps = self.binding.spec.page_size
        n = int(self.pages.numel())
        d_dev = self._d_dev()
        for p0 in range(0, n, self.chunk_pages):
            p1 = min(n, p0 + self.chunk_pages)
            at[:] = p0, p1
            rows = d_dev[p0 * ps : p1 * ps]
            if to_host:
                self._relayout(staging, rows, p1 - p0, to_image=True)
                self._copy(copier, p0, p1, staging.data_ptr(), None, to_host=True)
            else:
                self._copy(copier, p0, p1, staging.data_ptr(), None, to_host=False)
                self._relayout(staging, rows, p1 - p0, to_image=False)

    def _run_pipelined(self, copier: BatchCopier, buffers: StagingBuffers, stream: int, at: list[int], *,
                       to_host: bool) -> None:
        """The chunks of a CUDA transfer, pipelined on a side stream; ``at``: set to the chunk under way (:meth:`run`)."""
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
        try:
            self._pipeline(copier, stream, main, side, halves, d_dev, free, n, ps, at, to_host)
        finally:  # also when a chunk fails: nothing after the call may overtake what the side stream queued
            main.wait_stream(side)

    def _pipeline(self, copier: BatchCopier, stream: int, main: torch.cuda.Stream, side: torch.cuda.Stream,
                  halves: tuple[torch.Tensor, torch.Tensor], d_dev: torch.Tensor, free: list[torch.cuda.Event | None],
                  n: int, ps: int, at: list[int], to_host: bool) -> None:
        """The chunks of a CUDA transfer, the relayout of one beside the copy of the other (:meth:`run`); ``at``: set
        to the chunk under way."""
        for k, p0 in enumerate(range(0, n, self.chunk_pages)):
            p1 = min(n, p0 + self.chunk_pages)
            at[:] = p0, p1
            half = halves[k % 2]
            rows = d_dev[p0 * ps : p1 * ps]
            if to_host:
                with torch.cuda.stream(side):
                    ev = free[k % 2]
                    if ev is not None:
                        side.wait_event(ev)  # the copy engine has read this half
                    self._relayout(half, rows, p1 - p0, to_image=True)
                    ready = side.record_event()
                main.wait_event(ready)
                self._copy(copier, p0, p1, half.data_ptr(), stream, to_host=True)
                free[k % 2] = main.record_event()
            else:
                ev = free[k % 2]
                if ev is not None:
                    main.wait_event(ev)  # the scatter has read this half
                self._copy(copier, p0, p1, half.data_ptr(), stream, to_host=False)
                landed = main.record_event()
                with torch.cuda.stream(side):
                    side.wait_event(landed)
                    self._relayout(half, rows, p1 - p0, to_image=False)
                    free[k % 2] = side.record_event()

    def _relayout(self, staging: torch.Tensor, rows: torch.Tensor, npages: int, *, to_image: bool) -> None:
        """Gather ``rows`` (``npages`` pages) into the chunk image at ``staging``, or scatter them from it."""
        if self._kernel is not None and self._kernel.run(staging, rows, npages, self.chunk_pages, to_image=to_image):
            return
        if self._check_rows is not None:
            # the kernel masks bad rows, torch's index ops would fault on them (a staging half misaligned
            # for the kernel: not expected, both halves are multiples of its access word apart)
            self._check_rows()
            self._check_rows = None
        self._relayout_torch(staging, rows, npages, to_image=to_image)

    def _relayout_torch(self, staging: torch.Tensor, rows: torch.Tensor, npages: int, *, to_image: bool) -> None:
        """Two torch ops per layer entry (the fallback, and the reference of the kernel's tests)."""
        ps = self.binding.spec.page_size
        region = 0
        for im in self.images:
            a = im.seg.segment.addressing
            nch, cb = a.chunks(im.seg.width), a.chunk_bytes
            for e in im.entries:
                start = staging.storage_offset() + region + im.entry_offset(e)
                view = staging.as_strided((npages, ps, nch, cb), (im.span, a.token, a.chunk_stride or cb, 1), start)
                dev = im.seg.device_rows[e]
                if to_image:
                    view.copy_(torch.index_select(dev, 0, rows).view(npages, ps, nch, cb))
                else:
                    dev.index_copy_(0, rows, view.reshape(npages * ps, im.seg.width))
            region += self.chunk_pages * im.span


#: Caller streams whose staging a pool keeps at once; the least recently used one beyond them gives its buffer back.
MAX_STAGING_STREAMS = 4


@dataclass
class _StreamStaging:
    """What one caller stream of a pool stages with: its run lock, its relayout stream and its buffer."""

    lock: threading.Lock
    side: torch.cuda.Stream | None = None
    buffer: torch.Tensor | None = None


class StagingBuffers:
    """One staging buffer and one side stream per caller stream of a pool, grown on demand.

    At most :data:`MAX_STAGING_STREAMS` caller streams keep theirs (a server that makes a stream per request would
    otherwise hold a staging buffer of up to the budget for every stream it ever used): a new stream's first staged
    transfer releases the least recently used stream's buffer once no transfer of that stream is being enqueued (the
    caching allocator reuses the memory only after the work queued on it has run, :meth:`torch.Tensor.record_stream`).
    """

    def __init__(self, device: torch.device, max_streams: int = MAX_STAGING_STREAMS) -> None:
        self.device = device
        self.max_streams = max(1, max_streams)
        self._streams: OrderedDict[int, _StreamStaging] = OrderedDict()
        self._lock = threading.RLock()

    def streams(self) -> list[int]:
        """The caller streams that hold staging now, least recently used first."""
        with self._lock:
            return list(self._streams)

    def _entry(self, stream: int) -> _StreamStaging:
        with self._lock:
            entry = self._streams.get(stream)
            if entry is None:
                entry = self._streams[stream] = _StreamStaging(threading.Lock())
                self._evict(keep=stream)
            else:
                self._streams.move_to_end(stream)
            return entry

    def _evict(self, keep: int) -> None:
        """Release the least recently used streams' staging beyond :attr:`max_streams`, skipping any stream whose
        transfer is being enqueued (its lock held: it still fills its buffer)."""
        for stream in list(self._streams):
            if len(self._streams) <= self.max_streams:
                return
            entry = self._streams[stream]
            if stream == keep or not entry.lock.acquire(blocking=False):
                continue
            try:
                if entry.buffer is not None and entry.side is not None:
                    entry.buffer.record_stream(entry.side)  # a relayout queued on the side stream may still use it
                del self._streams[stream]
            finally:
                entry.lock.release()
            logger.debug("direct staging on %s: released the buffer of caller stream %#x (least recently used of "
                         "more than %d)", self.device, stream, self.max_streams)

    @contextmanager
    def running(self, stream: int) -> Iterator[None]:
        """Held for the whole enqueueing of one staged transfer on caller stream ``stream``: two threads on one caller
        stream would otherwise fill the same staging half on the same side stream.  The stream's staging cannot be
        released meanwhile (a lock taken from an entry released before it was acquired is given back and taken
        again from the stream's new entry)."""
        while True:
            entry = self._entry(stream)
            entry.lock.acquire()
            with self._lock:
                current = self._streams.get(stream) is entry
            if current:
                break
            entry.lock.release()
        try:
            yield
        finally:
            entry.lock.release()

    def side_stream(self, stream: int) -> torch.cuda.Stream:
        """The relayout stream paired with the caller's stream ``stream``."""
        with self._lock:
            entry = self._entry(stream)
            if entry.side is None:
                entry.side = torch.cuda.Stream(self.device)
            return entry.side

    def get(self, stream: int, nbytes: int) -> torch.Tensor:
        """The staging buffer of caller stream ``stream``, at least ``nbytes`` long (a shorter one is replaced)."""
        with self._lock:
            entry = self._entry(stream)
            buf = entry.buffer
            if buf is None or buf.numel() < nbytes:
                if buf is not None and self.device.type == "cuda":
                    buf.record_stream(self.side_stream(stream))  # a pending relayout may still read it
                buf = entry.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return buf

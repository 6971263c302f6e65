"""Copy plans of the ``direct`` backend: descriptor arrays per pair of index tensors, memoised.

A :class:`Plan` holds everything one ``(host_indices, device_indices)`` pair
needs: the indices on the CPU (range-checked once; device indices on the
pool's GPU only once a route needs their values), the coalesced runs of
every segment, and a :class:`Submission` per layer selection, built on first
use.  A :class:`PlanCache` keeps the last few plans of a pool; a hit needs the
same tensor objects with unchanged version counters on the same stream, so
the per-layer calls of a batch share one plan.  Tensors changed behind torch's
back (a NumPy view) are not seen: pass new tensors then.  Tensors without a
version counter (inference mode) are never memoised.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from ..binding import BoundSegment, PoolBinding
from ..errors import IndexRangeError
from ..kernel_support import index_memos
from ..validate import IndexFacts, index_bounds, page_starts, pair_where, tensor_version, tensor_where
from .common import as_long
from .memcpy import CALL_US, DESC_US
from .pace import WaitLog
from .pitched import MAX_PITCH, MIN_HEIGHT, PITCHED_OP_US, Pitched, group_bases, ops_tensor

if TYPE_CHECKING:
    from .staging import StagedRoute, _Image

__all__ = ["coalesce", "Submission", "Plan", "PlanCache", "EarlyRead", "MEMO_SLOTS", "WARN_MEAN_BLOCK", "WARN_BLOCKS"]

logger = logging.getLogger(__name__)

#: Plans kept per pool (an engine's backup and load threads each hold one pair).
MEMO_SLOTS = 8
#: ``auto`` staging: stage when plain runs average below this many bytes ...
STAGE_BELOW = 64 * 1024
#: ... and staging makes the copy engine's blocks at least this many times larger.
STAGE_GAIN = 2
#: ``auto`` staging also stages larger plain runs where submitting them would cost the host at least
#: this many microseconds (``memcpy.DESC_US`` per descriptor, ``memcpy.CALL_US`` per runtime call):
#: a 61-layer backup of separately allocated device layers into a page-major host layout (a page's
#: layers contiguous) is 3904 descriptors of 73.7 KB plain, 64 of 4.5 MB staged.
STAGE_HOST_US = 300.0


#: A CUDA pool warns once when a transfer's copy-engine blocks average below this many bytes over at
#: least :data:`WARN_BLOCKS` blocks: the copy engine moves such blocks at a few percent of the link
#: (H200: 0.02-0.08 of memcpy for one-layer loads of a token-major host layout, 1152-byte rows),
#: where ``auto`` picks the layout's kernel.
WARN_MEAN_BLOCK = 4096
WARN_BLOCKS = 256
#: :func:`coalesce` merges up to this many copies in Python, more with vectorised torch operations.
SMALL_COALESCE = 512


def warn_small_blocks(binding: PoolBinding, sub: Submission, layer: int | None) -> bool:
    """Log, once per pool, that ``sub`` (a transfer of ``layer``; ``None``: all layers) is a poor fit
    for the copy engine (:data:`WARN_MEAN_BLOCK`); returns whether it warned.  CPU pools never warn
    (their copies are ``memmove``)."""
    if binding.device.type != "cuda" or binding.scratch.get("direct.warned_small"):
        return False
    blocks, mean = sub.blocks, sub.mean_block
    if blocks < WARN_BLOCKS or mean >= WARN_MEAN_BLOCK:
        return False
    binding.scratch["direct.warned_small"] = True
    what = "all layers" if layer is None else f"layer {layer}"
    logger.warning(
        "hicache direct: a transfer of %s in layout %r goes to the copy engine as %d blocks of %.0f bytes on "
        "average; the copy engine moves blocks this small at a few percent of the link. io_backend='auto' "
        "serves such calls with the layout's kernel ('hicache explain' shows what it picks); this is logged "
        "once per pool", what, binding.layout.name, blocks, mean)
    return True


def coalesce(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge equal-size copies ``src[k] -> dst[k]`` (byte offsets, in order) into maximal runs.

    Returns ``(dst_starts, src_starts, lengths)``.
    """
    n = dst.numel()
    if n == 0:
        return dst, src, dst
    if n <= SMALL_COALESCE:  # a page-level plan: a loop over Python ints beats a dozen small torch ops
        d, s = dst.tolist(), src.tolist()
        first = [0] + [i for i in range(1, n) if d[i] - d[i - 1] != nbytes or s[i] - s[i - 1] != nbytes]
        if len(first) == n:  # nothing merges (random pages): the copies as they are
            return dst.clone(), src.clone(), torch.full((n,), nbytes, dtype=torch.int64)
        lens = [(e - b) * nbytes for b, e in zip(first, first[1:] + [n])]
        at = torch.tensor(first, dtype=torch.int64)
        return dst[at], src[at], torch.tensor(lens, dtype=torch.int64)
    brk = torch.ones_like(dst, dtype=torch.bool)
    brk[1:] = (dst[1:] - dst[:-1] != nbytes) | (src[1:] - src[:-1] != nbytes)
    starts = brk.nonzero().squeeze(1)
    counts = torch.diff(starts, append=torch.tensor([n]))
    return dst[starts], src[starts], counts * nbytes


@dataclass
class Submission:
    """What one transfer submits: plain runs (``host``/``dev``/``lens``) plus pitched copies of the
    same block across evenly spaced layers (``pitched``), or a staged route."""

    host: torch.Tensor
    dev: torch.Tensor
    lens: torch.Tensor
    staged: StagedRoute | None = None
    pitched: Pitched | None = None
    #: ``lens.sum()`` where the builder knows it (a plan counts it from its tables: no reduction per submission)
    known_nbytes: int | None = None

    def __post_init__(self) -> None:
        # derived once: a Submission is not changed after it is built (plans memoise it)
        self._ops: dict[bool, torch.Tensor] = {}
        #: By ``to_host``: whether a transfer of that direction submitted it (the pool checked its indices
        #: for that direction then), which ``direct``'s lane requires; before any, it is new (see warn_small_blocks).
        self.served = [False, False]
        if self.known_nbytes is not None:
            self.plain_nbytes = self.known_nbytes
        else:
            self.plain_nbytes = int(self.lens.sum()) if self.lens.numel() else 0
        self.pitched_nbytes = self.pitched.nbytes if self.pitched is not None else 0

    def pitched_ops(self, to_host: bool) -> torch.Tensor:
        """The ``cudaMemcpy3DBatchOp`` array of :attr:`pitched` for one direction (built once)."""
        assert self.pitched is not None
        ops = self._ops.get(to_host)
        if ops is None:
            ops = self._ops[to_host] = ops_tensor(self.pitched, to_host=to_host)
        return ops

    @property
    def pitched_count(self) -> int:
        return self.pitched.count if self.pitched is not None else 0

    @property
    def count(self) -> int:
        """Copy-engine operations per transfer (plain descriptors plus pitched operations)."""
        if self.staged is not None:
            return self.staged.count
        return int(self.lens.numel()) + self.pitched_count

    @property
    def nbytes(self) -> int:
        """Bytes the copy engine moves per transfer."""
        if self.staged is not None:
            return self.staged.nbytes
        return self.plain_nbytes + self.pitched_nbytes

    def host_us(self, submit_us: float, call_us: float = 0.0) -> float:
        """Estimated host time to submit this transfer: ``submit_us`` per copy-engine descriptor,
        ``call_us`` per runtime call (:func:`.cudart.batch_calls`, per staging chunk of pages), and
        the relayout launches of a staged route."""
        from .cudart import batch_calls

        if self.staged is not None:
            return self.staged.host_us(submit_us, call_us)
        n, k = int(self.lens.numel()), self.pitched_count
        return n * submit_us + batch_calls(n) * call_us + k * PITCHED_OP_US + batch_calls(k) * call_us

    @property
    def smallest_block(self) -> int:
        """Bytes of the smallest copy-engine descriptor (small blocks cost the copy engine most,
        and small host-to-device ones cost the host too)."""
        if self.staged is not None:
            return min(int(im.lens.min()) for im in self.staged.images) if self.staged.images else 0
        mins = [int(t.min()) for t in (self.lens, self.pitched.width if self.pitched is not None else self.lens)
                if t.numel()]
        return min(mins) if mins else 0

    @property
    def blocks(self) -> int:
        """Contiguous blocks the copy engine moves (a pitched operation moves one per row)."""
        if self.staged is not None:
            return self.staged.blocks
        return int(self.lens.numel()) + (int(self.pitched.height.sum()) if self.pitched is not None else 0)

    @property
    def mean_block(self) -> float:
        """Mean bytes per contiguous block (what decides copy-engine efficiency)."""
        return self.nbytes / self.blocks if self.blocks else 0.0


def _host_base(seg: BoundSegment, e: int) -> int:
    a = seg.segment.addressing
    return seg.host_flat.data_ptr() + a.offset + seg.host_layers[e] * a.layer


def _bases(binding: PoolBinding, si: int, seg: BoundSegment,
           stride: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
    """Host and device base addresses of the entries of segment ``si`` with device stride ``stride``,
    and entry -> row; they depend on the pool alone, so they are built once per pool."""
    memo = binding.scratch.setdefault("direct.bases", {})
    hit = memo.get((si, stride))
    if hit is None:
        group = [e for e in range(len(seg.device_layers)) if seg.dev_strides[e] == stride]
        hit = memo[(si, stride)] = (torch.tensor([_host_base(seg, e) for e in group], dtype=torch.int64),
                                    torch.tensor([seg.dev_ptrs[e] for e in group], dtype=torch.int64),
                                    {e: i for i, e in enumerate(group)})
    return hit


def _storages(binding: PoolBinding, si: int, seg: BoundSegment, stride: int) -> list[int]:
    """Per row of :func:`_bases`: the device allocation (torch storage) the entry's rows live in; built once per pool."""
    memo = binding.scratch.setdefault("direct.storages", {})
    hit = memo.get((si, stride))
    if hit is None:
        row = _bases(binding, si, seg, stride)[2]
        hit = memo[(si, stride)] = [0] * len(row)
        for e, r in row.items():
            hit[r] = seg.device_rows[e].untyped_storage().data_ptr()
    return hit


def defer_device_read(binding: PoolBinding) -> bool:
    """Whether a plan reads device indices living on the pool's device back only when a route needs
    their values: on CUDA, where the read waits for all work queued before the call."""
    return binding.device.type == "cuda"


def _page_sizes(images: list[_Image]) -> tuple[int, int]:
    """Bytes and blocks of one page over ``images`` (a staged route's per-page copy-engine work)."""
    return sum(int(im.lens.sum()) for im in images), sum(int(im.lens.numel()) for im in images)


def _runs_stay_in_page(seg: BoundSegment, page_size: int, num_pages: int) -> bool:
    """Whether no plain run of ``seg`` can continue from one host page into another: the bytes of one
    layer's rows of a page (from its first row to the end of its last) never end where the same
    layer's rows of another page begin (a whole number of page strides away)."""
    a = seg.segment.addressing
    extent = (page_size - 1) * a.token + (a.chunks(seg.width) - 1) * (a.chunk_stride or a.chunk_bytes) + a.chunk_bytes
    if a.page == 0:
        return False
    k, rest = divmod(extent, a.page)
    return rest != 0 or not 0 < abs(k) < num_pages


def _longest_run(seg: BoundSegment, page_size: int) -> int:
    """The longest plain run of ``seg`` where runs stay in their page (:func:`_runs_stay_in_page`):
    one layer's rows of one page where they are adjacent on the host, else one row."""
    a = seg.segment.addressing
    return page_size * seg.width if a.whole_row(seg.width) and a.token == seg.width else seg.width


def _layers_share_allocations(binding: PoolBinding) -> bool:
    """Whether some segment has layers in one device allocation (memoised per pool)."""
    hit = binding.scratch.get("direct.shared_allocations")
    if hit is None:
        hit = binding.scratch["direct.shared_allocations"] = any(
            len({r.untyped_storage().data_ptr() for r in seg.device_rows}) < len(seg.device_rows)
            for seg in binding.segments)
    return bool(hit)


def _layer_shape(binding: PoolBinding, layer: int, pitched: bool) -> tuple:
    """What ``auto`` staging's decision for a one-layer selection depends on besides the plan's indices: per
    segment with entries in ``layer``, its position, its entries' device strides (their plain runs: one table row
    each) and the block sizes of its page image.  Layers of one shape get one decision per plan (memoised per pool)."""
    memo = binding.scratch.setdefault("direct.layer_shapes", {})
    key = (layer, pitched)
    hit = memo.get(key)
    if hit is None:
        from .staging import page_images

        images = {id(im.seg): im for im in page_images(binding, layer, pitched)}
        parts = []
        for si, seg in enumerate(binding.segments):
            entries = seg.entries(layer)
            if entries:
                im = images.get(id(seg))
                parts.append((si, tuple(seg.dev_strides[e] for e in entries),
                              None if im is None else tuple(im.lens.tolist())))
        hit = memo[key] = tuple(parts)
    return hit


def _within(t: torch.Tensor, n: int) -> bool:
    """Whether every value of the non-empty ``t`` lies in ``0..n-1``."""
    lo, hi = index_bounds(t)
    return lo >= 0 and hi < n


def _page_runs(h: torch.Tensor, d: torch.Tensor, ps: int, facts: IndexFacts | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """See :attr:`Plan.page_runs` (``h``, ``d``: the plan's own int64 copies); ``facts``: what the pool's check of
    the tensors they were copied from saw of their shape (whole aligned host pages; device run starts or none)."""
    if ps == 1 or h.numel() == 0:
        return None
    hs: torch.Tensor | None
    if facts is not None and facts.host_starts is not None:
        hs = h.view(-1, ps)[:, 0]
    else:
        hs = page_starts(h, ps)
        if hs is None or bool((hs % ps).any()):
            return None
    if facts is not None and facts.device_read:
        ds = None if facts.device_starts is None else d.view(-1, ps)[:, 0]
    else:
        ds = page_starts(d, ps)
    if ds is None:
        return None
    return hs // ps, ds.contiguous()


class EarlyRead:
    """A device index tensor's values on their way to the host, started before the work that a plan made later would
    otherwise wait for.

    Made at an index pair's first call (``auto``'s ``prefetch`` option), before that call queues any transfer: an own
    ``int64`` copy on the device (what a staged route indexes with) and an asynchronous copy of it into pinned host
    memory, both on the current stream, and an event recorded behind them.  A :class:`Plan` made later for the same
    tensor (the same object, its version counter unchanged) takes both: reading the values then waits for that event
    only, not for the loads queued on the stream since (H200, beside a memory-bound kernel: a read behind a burst's
    queued kernel loads took 20-38 ms).  Only a plan on the stream the read was made on takes it (as an
    :class:`~hicache_core.kernel_support.IndexMemo` copy is reused): the device copy is ordered on that stream alone.

    :param stream: the handle of the current stream (the plans' key: :meth:`PlanCache.get`)."""

    __slots__ = ("source", "version", "where", "storage", "stream", "dev", "host", "event")

    def __init__(self, device_indices: torch.Tensor, stream: int) -> None:
        self.source = device_indices
        self.version = tensor_version(device_indices)
        # a .data swap keeps the object and its version: its address, length and dtype tell (the storage is held,
        # so no other one takes its address meanwhile)
        self.where = tensor_where(device_indices)
        self.storage = device_indices.untyped_storage()
        self.stream = stream
        self.dev = device_indices.to(torch.int64, copy=True)
        # pinned, so the copy is queued without waiting for the stream; read only after the event below
        self.host = self.dev.to("cpu", non_blocking=True)
        self.event: torch.cuda.Event | None = None
        if self.dev.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(self.dev.device))

    def of(self, device_indices: torch.Tensor, stream: int) -> bool:
        """Whether this read is of ``device_indices`` as they are now (the same object, unchanged since), made on
        ``stream``."""
        return device_indices is self.source and stream == self.stream and self.version is not None and \
            tensor_version(device_indices) == self.version and \
            tensor_where(device_indices) == self.where

    def ready(self) -> bool:
        """Whether the values have reached the host (reading them now waits for nothing)."""
        return self.event is None or self.event.query()

    def values(self) -> torch.Tensor:
        """The values on the host, once they are there (waits for this read's event, nothing queued after it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


class Plan:
    """Descriptor arrays for one pair of index tensors, per layer selection.

    ``waits``: where reading GPU-resident indices back waits for the work queued before the call, that wait is
    logged there (the copier's :class:`~.pace.WaitLog`), so that the host's measured pace leaves it out."""

    def __init__(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 staging: str, staging_bytes: int, pitched: bool = False, early: EarlyRead | None = None,
                 stream: int = 0, waits: WaitLog | None = None) -> None:
        self.binding = binding
        self._waits = waits
        self.pitched = pitched
        on_dev = isinstance(device_indices, torch.Tensor) and device_indices.device == binding.device
        # device-resident indices are read back (which waits for the work queued before this call)
        # only when a route needs their values on the host: plain runs do; a staged route indexes with
        # the device copy (its kernel relayout masks bad rows; the torch one reads and checks first)
        defer = on_dev and defer_device_read(binding)
        early = early if defer and early is not None and early.of(device_indices, stream) else None
        # the device copy the staged relayout indexes with (made on the caller's stream, or by an early read at the
        # pair's first call); its own copy: the values it indexes with are the values read or checked, even if the
        # caller later rewrites its tensor behind torch's version counter
        self._d_dev: torch.Tensor | None = (early.dev if early is not None else
                                            device_indices.to(torch.int64, copy=True) if on_dev else None)
        #: The early read the device indices' values come from (its event waited for, not the stream).
        self._early = early
        # where the host indices live on the device too, reading them waits for the stream anyway: the device
        # indices come back in that same wait (queued first, asynchronously), for a route that needs them
        self._d_early: torch.Tensor | None = None
        if defer and early is None and isinstance(host_indices, torch.Tensor) and host_indices.device == binding.device:
            assert self._d_dev is not None
            self._d_early = self._d_dev.to("cpu", non_blocking=True)
        # its own copy (as the device indices below): what the plan builds later, table by table, must come from
        # the values checked now, even if the caller rewrites its tensor behind torch's version counter
        self.h = self._to_host(host_indices, copy=True)  # waits for the stream where they live on the device
        # device indices off the pool's device (on the CPU): their own copy too, before the facts are asked
        d_off = None if defer or self._d_dev is not None else self._to_host(device_indices, copy=True)
        # what the pool's check in this call read of these very tensors (their ranges, page runs): not read again.
        # Asked after the copies above: a write landing before them moves a version counter and voids the facts, so
        # facts only ever describe the values copied
        checked = binding.checked
        self._facts = None if checked is None else checked.facts_of(host_indices, device_indices)
        if early is not None and self._facts is not None and self._facts.device_read:
            # the check read the values as they are now; the plan takes them as they were at the early read (equal
            # unless rewritten behind the version counter): the check's facts about them must not stand for those
            self._facts = IndexFacts(self._facts.host_starts, None, False)
        self._rows = binding.device_rows
        cap = binding.spec.capacity
        if self.h.numel() and (self._facts is None or self._facts.host_starts is None) and not _within(self.h, cap):
            raise IndexRangeError(f"direct: host_indices must lie in 0..{cap - 1}; nothing was copied")
        self._d: torch.Tensor | None = None
        if not defer:  # from its own copy (made above)
            self._read_d(d_off if d_off is not None else cast(torch.Tensor, self._d_dev))
        self.staging, self.staging_bytes = staging, staging_bytes
        self._page_runs: tuple[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # (value,) once computed
        self._tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, int], int]] = {}
        self._subs: dict[int | None, Submission] = {}
        #: :func:`_layer_shape` keys whose one-layer selections ``auto`` staging decided to leave plain
        self._plain_shapes: set[tuple] = set()
        self._lock = threading.Lock()

    def _to_host(self, t: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """``t`` as ``int64`` on the CPU (its own copy where ``copy``).  Where ``t`` lives on a GPU, the read waits for
        the work queued on that device's current stream: that wait runs first, logged apart (``waits``)."""
        if t.is_cuda and self._waits is not None:
            self._waits.timed(torch.cuda.current_stream(t.device).synchronize)
        return as_long(t, "cpu", copy=copy)

    def _read_d(self, device_indices: torch.Tensor) -> torch.Tensor:
        d = self._to_host(device_indices)
        if d.numel() and (self._facts is None or not self._facts.device_read) and not _within(d, self._rows):
            rng = f"in 0..{self._rows - 1}" if self._rows else "nowhere (the shortest device layer has no rows)"
            raise IndexRangeError(f"direct: device_indices must lie {rng}; nothing was copied")
        self._d = d
        return d

    @property
    def d(self) -> torch.Tensor:
        """The device indices on the CPU, range-checked (read from the device copy on first use)."""
        if self._d is None:
            assert self._d_dev is not None
            if self._early is not None:  # waits for the early read's event only
                early = self._early
                return self._read_d(early.values() if self._waits is None else self._waits.timed(early.values))
            # the early copy landed before the host indices were read (one stream, queued first)
            return self._read_d(self._d_early if self._d_early is not None else self._d_dev)
        return self._d

    @property
    def d_read(self) -> bool:
        """Whether the device indices' values have been read on the host."""
        return self._d is not None

    @property
    def d_dev(self) -> torch.Tensor:
        if self._d_dev is None:
            # through pinned memory, so the copy is enqueued on the current stream without waiting for it
            src = self.d.pin_memory() if self.binding.device.type == "cuda" else self.d
            self._d_dev = src.to(self.binding.device, non_blocking=True)
        return self._d_dev

    def peek(self, layer: int | None) -> Submission | None:
        """The submission of ``layer`` if one was built, else ``None`` (builds nothing)."""
        return self._subs.get(layer)

    def submission(self, layer: int | None) -> Submission:
        sub = self._subs.get(layer)
        if sub is None:
            with self._lock:
                sub = self._subs.get(layer)
                if sub is None:
                    sub = self._build(layer)
                    self._subs[layer] = sub
        return sub

    # -- plain runs -------------------------------------------------------------------
    @property
    def page_runs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(host page numbers, device start rows)`` when both index tensors are whole runs of
        ``page_size`` consecutive slots (host runs page-aligned), as allocators hand them out; else ``None``."""
        if self._page_runs is None:
            self._page_runs = (_page_runs(self.h, self.d, self.binding.spec.page_size, self._facts),)
        return self._page_runs[0]

    def _runs(self, seg: BoundSegment, stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Coalesced runs of ``seg`` for these indices, as offsets from the host layer slot and device row 0."""
        a = seg.segment.addressing
        ps = self.binding.spec.page_size
        whole_rows = a.whole_row(seg.width) and a.chunks(seg.width) * a.chunk_bytes == seg.width
        pages = self.page_runs if whole_rows and a.token == seg.width and stride == seg.width else None
        if pages is not None:
            # rows adjacent on both sides: each page is one block (what coalescing its rows would give),
            # computed from 1/page_size of the elements
            hp, dp = pages
            return coalesce(hp * a.page, dp * stride, ps * seg.width)
        chunk = torch.arange(a.chunks(seg.width), dtype=torch.int64)
        host = ((self.h // ps) * a.page + (self.h % ps) * a.token).unsqueeze(1) + chunk * (a.chunk_stride or a.chunk_bytes)
        dev = (self.d * stride).unsqueeze(1) + chunk * a.chunk_bytes
        return coalesce(host.reshape(-1), dev.reshape(-1), a.chunk_bytes)

    def _table(self, si: int, seg: BoundSegment,
               stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, int], int]:
        """Host and device addresses of every entry of ``seg`` with device stride ``stride``, one row per entry;
        the run lengths of a row, entry -> row, and the bytes of one row's runs."""
        key = (si, stride)
        table = self._tables.get(key)
        if table is None:
            hb, db, row = _bases(self.binding, si, seg, stride)
            hr, dr, n = self._runs(seg, stride)
            table = self._tables[key] = (hr.unsqueeze(0) + hb.unsqueeze(1), dr.unsqueeze(0) + db.unsqueeze(1), n, row,
                                         int(n.sum()))
        return table

    def _plain(self, layer: int | None) -> Submission:
        """Plain runs of ``layer`` (``None``: all): rows of the per-segment address tables, so a
        burst of per-layer calls builds the tables once and then only picks rows.  Where the
        selection spans evenly spaced layers, each run becomes one pitched copy over them."""
        hosts, devs, lens, pitched = [], [], [], []
        plain_bytes = 0  # the plain runs' bytes, counted from the tables (no reduction per submission)
        for si, seg in enumerate(self.binding.segments):
            entries = seg.entries(layer)
            for stride in sorted({seg.dev_strides[e] for e in entries}):
                hm, dm, n, row, row_bytes = self._table(si, seg, stride)
                rows = [row[e] for e in entries if seg.dev_strides[e] == stride]
                groups = self._pitch_groups(si, seg, stride, rows, n)
                if groups is None:
                    if len(rows) == hm.shape[0]:
                        hosts.append(hm.reshape(-1)); devs.append(dm.reshape(-1)); lens.append(n.repeat(len(rows)))
                    else:
                        for r in rows:
                            hosts.append(hm[r]); devs.append(dm[r]); lens.append(n)
                    plain_bytes += row_bytes * len(rows)
                    continue
                for g in groups:
                    if len(g) >= MIN_HEIGHT:
                        r0, r1 = g[0], g[1]
                        hp, dp = hm[r1, 0] - hm[r0, 0], dm[r1, 0] - dm[r0, 0]
                        k = n.numel()
                        pitched.append(Pitched(hm[r0], dm[r0], n, torch.full((k,), len(g), dtype=torch.int64),
                                               hp.expand(k).clone(), dp.expand(k).clone()))
                    else:
                        for r in g:
                            hosts.append(hm[r]); devs.append(dm[r]); lens.append(n)
                        plain_bytes += row_bytes * len(g)
        pitch = Pitched.cat(pitched) if pitched else None
        if not hosts:
            empty = torch.empty(0, dtype=torch.int64)
            return Submission(empty, empty, empty, pitched=pitch, known_nbytes=0)
        if len(hosts) == 1:
            return Submission(hosts[0], devs[0], lens[0], pitched=pitch, known_nbytes=plain_bytes)
        return Submission(torch.cat(hosts), torch.cat(devs), torch.cat(lens), pitched=pitch, known_nbytes=plain_bytes)

    def _pitch_groups(self, si: int, seg: BoundSegment, stride: int, rows: list[int],
                      n: torch.Tensor) -> list[list[int]] | None:
        """Table rows ``rows`` split into evenly spaced groups (pitched copies) and singletons, or
        ``None`` when no group has :data:`MIN_HEIGHT` rows (plain descriptors only)."""
        if not self.pitched or len(rows) < MIN_HEIGHT or n.numel() == 0:
            return None
        # rows of one pitched copy must lie in one device allocation: across separately allocated layers
        # the runtime takes a slow path (0.54 of memcpy, 5.1 ms of host time for a 61-layer backup)
        storage = _storages(self.binding, si, seg, stride)
        by_storage: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_storage.setdefault(storage[r], []).append(i)
        if max(len(part) for part in by_storage.values()) < MIN_HEIGHT:
            return None  # every layer its own allocation (SGLang's pools)
        hb, db, _ = _bases(self.binding, si, seg, stride)
        host, dev = hb[rows].tolist(), db[rows].tolist()
        groups = [[part[i] for i in g] for part in by_storage.values()
                  for g in group_bases([host[i] for i in part], [dev[i] for i in part], int(n.max()), MAX_PITCH)]
        if all(len(g) < MIN_HEIGHT for g in groups):
            return None
        return [[rows[i] for i in g] for g in groups]

    def _build(self, layer: int | None) -> Submission:
        if self.staging == "never" or self.h.numel() == 0:
            return self._plain(layer)
        shape = _layer_shape(self.binding, layer, self.pitched) if layer is not None and self.staging == "auto" else None
        if shape is not None and shape in self._plain_shapes:
            return self._plain(layer)  # another layer of this shape was left plain: so is this one (a burst's layers)
        # first without the plain runs (building them can cost more than the transfer's host time, and
        # device-resident indices would have to be read back for them)
        staged = self._staged_by_bound(layer)
        if staged is not None or self.staging == "always":  # "always" has tried its route already
            return staged or self._plain(layer)
        plain = self._plain(layer)
        staged = self._staged(layer, plain)
        if staged is None and shape is not None:
            self._plain_shapes.add(shape)
        return staged or plain

    def _staged_by_bound(self, layer: int | None) -> Submission | None:
        """The staged route, decided without the plain runs (nor the device indices' values), where it
        beats any plain runs these host indices could give; else ``None`` (then :meth:`_staged` decides).

        In ``auto`` no segment's plain run may cross from one page to another on the host
        (:func:`_runs_stay_in_page`): then none is longer than :func:`_longest_run`, which bounds
        the plain runs' number from below (and their mean size from above) for :meth:`_staged`'s rule.
        """
        from .cudart import batch_calls
        from .staging import page_images

        if self.staging == "auto":
            if self.pitched and _layers_share_allocations(self.binding):
                return None  # plain runs may go as pitched copies across layers (few operations, no SMs)
            images = page_images(self.binding, layer, self.pitched)
            spec = self.binding.spec
            if not images or not all(_runs_stay_in_page(im.seg, spec.page_size, spec.num_pages) for im in images):
                return None
            pages = self.h.numel() // spec.page_size
            fewest = sum(-(-pages * int(im.lens.sum()) // _longest_run(im.seg, spec.page_size)) for im in images)
            nbytes, blocks = (pages * n for n in _page_sizes(images))
            widest = nbytes / fewest  # the plain runs' mean size is at most this
            if nbytes < STAGE_GAIN * widest * blocks:
                return None  # the staged blocks are not large enough
            if widest >= STAGE_BELOW and fewest * DESC_US + batch_calls(fewest) * CALL_US < STAGE_HOST_US:
                return None
        return self._route(layer)

    def _route(self, layer: int | None) -> Submission | None:
        from .staging import StagedRoute

        route = StagedRoute.build(self.binding, self.h, lambda: self.d_dev, layer, self.staging_bytes,
                                  pitched=self.pitched, check_rows=None if self.d_read else (lambda: self.d))
        if route is None:
            return None
        empty = torch.empty(0, dtype=torch.int64)
        return Submission(empty, empty, empty, route)

    def _staged(self, layer: int | None, plain: Submission) -> Submission | None:
        """The staged route where it beats ``plain``, else ``None``.

        In ``auto`` the route must give the copy engine blocks at least :data:`STAGE_GAIN` times
        larger than the plain runs, and those runs must be small (below :data:`STAGE_BELOW`) or so
        many that submitting them costs the host :data:`STAGE_HOST_US` or more.  A route that only
        packs the same blocks (a layer-major host layout: one block per layer and page) is not
        taken: it cuts host time but moved 0.82-0.86 of memcpy against 0.93-0.98 for plain runs on
        the H200 (docs/performance.md).  In ``always``: wherever whole host pages allow it.  Where
        the device indices have not been read, the route reads and checks them before any torch
        relayout (its kernel relayout masks rows outside the device buffers instead).
        """
        from .staging import page_images

        if self.staging == "auto":
            if plain.count == 0 or (plain.mean_block >= STAGE_BELOW and plain.host_us(DESC_US, CALL_US) < STAGE_HOST_US):
                return None
            images = page_images(self.binding, layer, self.pitched)
            per_page = _page_sizes(images)
            if not images or per_page[0] < STAGE_GAIN * plain.mean_block * per_page[1]:
                return None  # the staged blocks (per page: bytes / blocks) are not large enough
        return self._route(layer)


class PlanCache:
    """The last :data:`MEMO_SLOTS` plans of one pool, keyed by index tensors, versions and stream.

    ``waits``: the copier's :class:`~.pace.WaitLog`, where the plans made here log their waits on the GPU."""

    def __init__(self, binding: PoolBinding, staging: str, staging_bytes: int, pitched: bool = False,
                 waits: WaitLog | None = None) -> None:
        # a proxy, also in the plans made here: the cache lives in the binding's scratch, and a strong reference
        # back would keep a dropped pool's buffers alive until the garbage collector runs
        self.binding = cast(PoolBinding, weakref.proxy(binding))
        self.staging, self.staging_bytes = staging, staging_bytes
        self.pitched = pitched
        self.waits = waits
        #: Whether plans outlive their call: not on a pool that checks and copies every call afresh (``validate=
        #: "full"``/``"strict"``: its index memos are off), where a write torch does not count (NumPy, ``.data``)
        #: would leave a memoised plan moving the old rows.  There a plan serves the call that made it only (``auto``
        #: sizes it while deciding, ``direct`` submits it): it is keyed by the pool's check of that call.
        self.memoise = index_memos(binding)[0].enabled
        self._slots: list[tuple[torch.Tensor, int, torch.Tensor, int, int, tuple, tuple, object, Plan]] = []
        #: Early reads of device index tensors (:meth:`read_early`), newest first, at most :data:`MEMO_SLOTS`.
        self._early: list[EarlyRead] = []
        self._lock = threading.Lock()

    def read_early(self, device_indices: torch.Tensor, stream: int) -> EarlyRead | None:
        """Start reading ``device_indices`` back on the current stream (handle ``stream``) for a plan made later on it
        (:class:`EarlyRead`), where they live on the pool's CUDA device, have a version counter and have no early read
        on that stream yet; the read, else ``None``."""
        if not (isinstance(device_indices, torch.Tensor) and device_indices.device == self.binding.device
                and defer_device_read(self.binding) and tensor_version(device_indices) is not None):
            return None
        if self.early_of(device_indices, stream) is not None:
            return None
        early = EarlyRead(device_indices, stream)
        with self._lock:  # a new list each time: readers iterate a snapshot without the lock
            self._early = [early, *self._early][:MEMO_SLOTS]
        return early

    def early_of(self, device_indices: torch.Tensor, stream: int) -> EarlyRead | None:
        """The early read of ``device_indices`` as they are now, made on ``stream``, else ``None``."""
        for early in self._early:
            if early.of(device_indices, stream):
                return early
        return None

    def get(self, host_indices: torch.Tensor, device_indices: torch.Tensor, stream: int) -> Plan:
        plan = self.peek(host_indices, device_indices, stream)
        if plan is not None:
            return plan
        # read before the plan copies the values: a write landing meanwhile leaves the plan unmemoised under them
        hv, dv = tensor_version(host_indices), tensor_version(device_indices)
        where = pair_where(host_indices, device_indices)
        early = self.early_of(device_indices, stream) if self._early else None
        plan = Plan(self.binding, host_indices, device_indices, self.staging, self.staging_bytes, self.pitched,
                    early=early, stream=stream, waits=self.waits)
        if early is not None and plan._early is early:
            with self._lock:  # taken: the plan holds it now
                self._early = [e for e in self._early if e is not early]
        call = None if self.memoise else self.binding.checked
        if hv is not None and dv is not None and (self.memoise or call is not None):
            with self._lock:  # a new list each time: readers iterate a snapshot without the lock
                # the storages are held with the slot: a .data swap's freed storage cannot give its address to
                # another one while the slot compares addresses
                held = (host_indices.untyped_storage(), device_indices.untyped_storage())
                self._slots = [(host_indices, hv, device_indices, dv, stream, where, held, call, plan),
                               *self._slots][:MEMO_SLOTS]
        return plan

    def peek(self, host_indices: torch.Tensor, device_indices: torch.Tensor, stream: int) -> Plan | None:
        """The memoised plan of these index tensors (the same objects, unchanged: version counters, and addresses and
        lengths, which a ``.data`` swap changes) on ``stream``, else ``None`` (builds nothing)."""
        for h, hv0, d, dv0, s, where, _, call, plan in self._slots:  # identity first: anything else finds nothing
            if h is host_indices and d is device_indices and s == stream:
                if call is not None and call is not self.binding.checked:
                    return None  # made in an earlier call of a pool that checks every call: not reused
                return plan if h._version == hv0 and d._version == dv0 and pair_where(h, d) == where else None
        return None

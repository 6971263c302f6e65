"""The copy plan of the ``direct`` backend: :class:`Plan`, the descriptor arrays of one pair of index tensors per layer
selection (its index copies, plain and pitched runs, and ``auto`` staging's choice of a staged route), and when a plan
reads GPU-resident device indices back (:func:`defer_device_read`).

Part of the copy plans whose public face is :mod:`hicache_core.backends.plans` (every name here is importable from
there too).  The helpers a plan uses are looked up here: a test that replaces ``coalesce``, ``_page_runs``,
``_within``, ``as_long``, ``defer_device_read`` or a ``STAGE_*`` threshold for plans patches it in this module
(:class:`~hicache_core.backends.plans_cache.PlanCache` looks up ``Plan`` in its own module, ``defer_device_read`` in
this one).
"""

from __future__ import annotations

import threading
from typing import cast

import torch

from ..binding import BoundSegment, PoolBinding
from ..errors import IndexRangeError
from ..validate import IndexFacts
from .common import as_long
from .memcpy import CALL_US, DESC_US
from .pace import WaitLog
from .pitched import MAX_PITCH, MIN_HEIGHT, Pitched, group_bases
from .plans_early import EarlyRead
from .plans_runs import (_bases, _layer_shape, _layers_share_allocations, _longest_run, _page_runs, _page_sizes,
                         _runs_stay_in_page, _storages, _within)
from .plans_submission import Submission, coalesce

__all__ = ["Plan", "defer_device_read", "STAGE_BELOW", "STAGE_GAIN", "STAGE_HOST_US"]

#: ``auto`` staging: stage when plain runs average below this many bytes ...
STAGE_BELOW = 64 * 1024
#: ... and staging makes the copy engine's blocks at least this many times larger.
STAGE_GAIN = 2
#: ``auto`` staging also stages larger plain runs where submitting them would cost the host at least
#: this many microseconds (``memcpy.DESC_US`` per descriptor, ``memcpy.CALL_US`` per runtime call):
#: a 61-layer backup of separately allocated device layers into a page-major host layout (a page's
#: layers contiguous) is 3904 descriptors of 73.7 KB plain, 64 of 4.5 MB staged.
STAGE_HOST_US = 300.0


def defer_device_read(binding: PoolBinding) -> bool:
    """Whether a plan reads device indices living on the pool's device back only when a route needs
    their values: on CUDA, where the read waits for all work queued before the call."""
    return binding.device.type == "cuda"


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

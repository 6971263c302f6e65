"""Device-side pieces of row-copy kernels: ``@triton.jit`` helpers a layout plugin composes its kernel from.

This module imports Triton; nothing in the core imports it.  A plugin's
``kernels`` module imports it, and a plugin's strategy imports that module on
first :meth:`prepare` (:class:`hicache_core.rowcopy.RowKernelStrategy` does),
so listing or resolving strategies never loads Triton.

Conventions (the launch values of :mod:`hicache_core.rowcopy`):

* every address is ``anchor + int64 offset`` in *words* (the anchor's dtype);
  device rows and pinned host memory alike (unified addressing);
* index positions ``0..n-1`` pair host slot ``host_idx[i]`` with device row
  ``dev_idx[i]``; a *tile* is ``TOKENS`` consecutive positions;
* an *entry* is one (segment, layer) pair of the tables ``dev_off``,
  ``dev_stride``, ``host_off``, ``host_page``, ``host_tok``; a launch moves
  the entries ``ents[0..n_ents-1]``;
* a work item is one (entry, tile); a persistent grid walks items with a
  grid-stride loop, so the launch holds at most its grid of programs.

Every access is masked: positions past ``n``, host slots outside
``0..capacity-1`` and device rows outside ``0..dev_rows-1`` move nothing, so a
bad index never reaches memory even when value validation was skipped.

A complete kernel built from these pieces is in docs/plugin-authoring.md.

Loads on Hopper-class GPUs may instead read host rows through a tensor
descriptor (TMA bulk copies, a few in flight per program): :func:`box_hits`, :func:`store_box_rows`, :func:`load_entry` and the complete kernel :data:`PAGED_TMA_LOAD`, which a
plugin whose host rows sit at ``page * page_stride + slot_in_page * token_stride``
(page stride a whole multiple of the token stride) re-exports as its ``TMA_LOAD_KERNEL`` (see :mod:`hicache_core.rowcopy_tma`).

Loads of layouts whose host page of one layer is one contiguous run of rows (host rows packed; device
rows packed, or each row a part of wider device rows) may instead copy whole pages as flat words: :func:`page_item`, :func:`load_piece`,
:func:`store_piece`, :func:`gather_page` (pages that are not runs), :func:`page_group`, :func:`group_runs` (small pages
several per work item, :func:`page_group_load`) and the complete kernel :data:`PAGE_LOAD`, which a plugin re-exports as its
``PAGE_LOAD_KERNEL`` (see :class:`hicache_core.rowcopy.RowKernelStrategy`).  Backups of such pages may go the
other way as flat words too: :func:`page_backup`, which a plugin's ``KERNEL`` runs where it declares ``PAGES``
(:mod:`hicache_core.rowcopy_pages`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["programs", "work_size", "work_item", "index_tile", "device_rows", "paged_rows", "move_rows", "tile_done",
           "let_next_begin", "await_previous",
           "box_hits", "store_box_rows", "load_entry", "PAGED_TMA_LOAD", "page_item", "page_bounds", "page_run",
           "load_piece", "store_piece", "gather_page", "page_load", "copy_words", "page_backup", "page_group", "group_runs",
           "page_group_load", "PAGE_LOAD"]


@triton.jit
def programs():
    """``(program id, programs)`` of a persistent launch, as int64 (item arithmetic never wraps)."""
    return tl.program_id(0).to(tl.int64), tl.num_programs(0).to(tl.int64)


@triton.jit
def work_size(n, n_ents, TOKENS: tl.constexpr):
    """``(tiles, items)`` of a launch over ``n`` positions and ``n_ents`` entries (int64)."""
    n_tiles = tl.cdiv(n.to(tl.int64), TOKENS)
    return n_tiles, n_tiles * n_ents.to(tl.int64)


@triton.jit
def work_item(item, ents, n_tiles, n_ents, ENTRIES_INNER: tl.constexpr):
    """``(entry, tile)`` of work item ``item``.

    ``ENTRIES_INNER``: consecutive items are the entries of one tile (programs
    fill a token's rows of every layer together: token-major host layouts);
    otherwise consecutive items are the tiles of one entry (layer-major).
    """
    if ENTRIES_INNER:
        tile = item // n_ents
        k = item - tile * n_ents
    else:
        k = item // n_tiles
        tile = item - k * n_tiles
    return tl.load(ents + k), tile


@triton.jit
def index_tile(host_idx, dev_idx, tile, n, capacity, dev_rows, TOKENS: tl.constexpr):
    """Host slots, device rows (int64) and the in-bounds mask of tile ``tile``."""
    t = tile * TOKENS + tl.arange(0, TOKENS)
    live = t < n
    h = tl.load(host_idx + t, mask=live, other=-1).to(tl.int64)
    d = tl.load(dev_idx + t, mask=live, other=-1).to(tl.int64)
    ok = live & (h >= 0) & (h < capacity) & (d >= 0) & (d < dev_rows)
    return h, d, ok


@triton.jit
def device_rows(dev_off, dev_stride, e, d):
    """Word offsets of device rows ``d`` of entry ``e``."""
    return tl.load(dev_off + e) + d * tl.load(dev_stride + e)


@triton.jit
def paged_rows(host_off, host_page, host_tok, e, h, page_size):
    """Word offsets of host slots ``h`` of entry ``e`` in a paged layout: page stride, then token stride.

    Kernels moving many rows pass ``page_size`` as the constexpr launch value ``PAGE_SIZE``: every thread computes
    the offsets of all its tile's rows, and with a runtime page size each is a 64-bit division (a software routine
    whose registers spilled), which held a page-major layout's backups of 656-byte rows to half the link; by a
    constant it is a shift (powers of two) or a multiply (other sizes: 64-bit, so those kernels still spill some)."""
    p = h // page_size
    return tl.load(host_off + e) + p * tl.load(host_page + e) + (h - p * page_size) * tl.load(host_tok + e)


@triton.jit
def move_rows(anchor, dev_row, host_row, ok, WIDTH: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
              TO_HOST: tl.constexpr):
    """Copy ``WIDTH`` words per row between ``dev_row[r]`` and ``host_row[r]`` where ``ok[r]``.

    ``TO_HOST``: device to host (backup), else host to device (load).  ``BLOCK``
    (a power of two) words per column step; every row base is a multiple of
    ``VEC`` words (the hint that lets Triton use wide accesses).
    """
    if VEC > 1:
        dev_row = tl.multiple_of(dev_row, VEC)
        host_row = tl.multiple_of(host_row, VEC)
    cols = tl.arange(0, BLOCK)
    for c0 in tl.static_range(0, WIDTH, BLOCK):
        c = c0 + cols
        m = ok[:, None] & (c < WIDTH)[None, :]
        dptr = anchor + dev_row[:, None] + c[None, :]
        hptr = anchor + host_row[:, None] + c[None, :]
        if TO_HOST:
            tl.store(hptr, tl.load(dptr, mask=m), mask=m)
        else:
            tl.store(dptr, tl.load(hptr, mask=m), mask=m)


@triton.jit
def tile_done(FENCE: tl.constexpr):
    """The end of a work item: with ``FENCE``, every thread waits until the GPU's memory system has taken the writes
    it issued (PTX ``fence.sc.gpu``, once per thread), so a program keeps at most one tile of writes in flight.

    A backup's writes to host memory are posted: unfenced, a program issues the next tile's while the link still
    drains the last, the queued writes fill the GPU's memory system, and a GEMM beside the backup waits on its
    own memory traffic.  Fenced per tile, 8 programs backed MLA and MHA rows up at the same ratio to memcpy
    (0.94) while the GEMM slowed +12-17% instead of +32-84% (H100, docs/perf/runs.md).  Off under Triton's
    interpreter, which has no inline PTX (the launch passes ``FENCE`` False on CPU)."""
    if FENCE:
        tl.inline_asm_elementwise("fence.sc.gpu;\n\tmov.u32 $0, $1;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def let_next_begin(item, n_items, nprog, PDL: tl.constexpr):
    """With ``PDL`` 2 (a launch of a call but its last), at the start of this program's last work item (``item`` of
    ``n_items``, ``nprog`` programs striding): the next launch on the stream, made as a programmatic dependent launch
    (Hopper's PDL, Triton's ``launch_pdl``), may begin once every program of this one has signalled or ended (PTX
    ``griddepcontrol.launch_dependents``), so its programs start while this launch's last items drain instead of
    after it ends.  A program with no items never signals (its end counts).  A call's last launch (``PDL`` 1) never
    signals: whatever follows the call on the stream starts after it ends, as after a plain launch.  sm_90 and
    later; the launch passes ``PDL`` 0 elsewhere."""
    if PDL >= 2:
        if item + nprog >= n_items:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n\tmov.u32 $0, $1;", "=r,r",
                                      [tl.program_id(0)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def await_previous(PDL: tl.constexpr):
    """With ``PDL`` 1 or 2, at the end of a program: wait until the launch this one depends on has completed and its
    writes are visible (PTX ``griddepcontrol.wait``; at once in a launch made without PDL, such as a call's first), so
    that a launch never completes before the one before it: whatever waits on the last launch of a call waits on all
    of them."""
    if PDL >= 1:
        tl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.u32 $0, $1;", "=r,r", [tl.program_id(0)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def box_hits(host_idx, dev_idx, tile, n, capacity, dev_rows, page_size, page_rows, TOKENS: tl.constexpr,
             FLAT: tl.constexpr):
    """:func:`index_tile` of tile ``tile``, plus ``r0`` (the descriptor row of the box's first host slot ``h0``:
    the tile's first slot, clamped into range) and ``hit``: the rows whose slot is the box's row (all of them
    when the tile is whole pages).

    ``FLAT``: slot ``s`` is row ``s``; else row ``page(s) * page_rows + slot_in_page(s)``,
    and a box's rows past ``h0``'s page are not hits.  Row arithmetic is
    32-bit (the host checks that rows fit): a 64-bit division in the
    pipelined loop costs the kernel dozens of spilled registers.
    """
    h, d, ok = index_tile(host_idx, dev_idx, tile, n, capacity, dev_rows, TOKENS)
    h0 = tl.minimum(tl.maximum(tl.load(host_idx + tile * TOKENS), 0), capacity - 1).to(tl.int32)
    i = tl.arange(0, TOKENS)
    hit = ok & (h == h0 + i)  # int32: within 256 slots of 2**31 a wrap only turns hits into misses (gathered)
    if FLAT:
        r0 = h0
    else:
        p0 = h0 // page_size
        r0 = p0 * page_rows + (h0 - p0 * page_size)
        hit = hit & (h0 - p0 * page_size + i < page_size)
    return h, d, ok, r0, hit


@triton.jit
def store_box_rows(anchor, desc, dev_row, hit, r0, C0: tl.constexpr, WIDTH: tl.constexpr, BOX: tl.constexpr):
    """Read columns ``C0 .. C0+BOX-1`` of descriptor rows ``r0 ..`` by one bulk copy and store those below
    ``WIDTH`` to the device rows where ``hit``.

    ``desc`` is 2-D, ``[rows, words]`` at the host token stride; its bounds
    (the layer's first to last slot) zero-fill whatever lies outside them, so a
    box never reads past its layer's span.  In a paged layer a box may read
    rows between two pages (other layers' rows): they are never hits.
    """
    c = C0 + tl.arange(0, BOX)
    x = desc.load([r0, C0])
    tl.store(anchor + dev_row[:, None] + c[None, :], x, mask=hit[:, None] & (c < WIDTH)[None, :])


@triton.jit
def load_entry(anchor, desc, tail, host_idx, dev_idx, n, dev_base, dev_stride, host_base, host_page, host_tok,
               page_size, capacity, dev_rows, WIDTH: tl.constexpr, BOX: tl.constexpr, TAIL: tl.constexpr,
               TOKENS: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr, FLAT: tl.constexpr):
    """Load one (segment, layer) entry: host rows by descriptor boxes, device rows by ordinary stores.

    The descriptor's rows are the host layer at its token stride: slot ``s``
    is row ``page(s) * (host_page / host_tok) + slot_in_page(s)`` (``s`` itself
    when slots are uniformly strided: ``FLAT``).  First pass (``STAGES`` boxes in flight
    per program): each tile's box starts at the row of its first position's
    slot and fills the rows it holds in that page (:func:`box_hits`).  Second
    pass, only when some row was not in its box (indices that are not whole
    pages): the same program gathers its tiles' other valid rows one by one.
    Positions failing :func:`index_tile`'s bounds move nothing.  ``page_size`` may be a runtime value or, as
    :data:`PAGED_TMA_LOAD` passes it, a constexpr (see :func:`paged_rows`).  ``BOX`` words
    per column step, ``TAIL`` (a power of two, 0: none) for the rest of a row,
    read through ``tail``.
    """
    pid, nprog = programs()
    n_tiles = tl.cdiv(n.to(tl.int64), TOKENS)
    page_rows = (host_page // host_tok).to(tl.int32)
    missed = tl.zeros((), tl.int32)
    for tile in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
        h, d, ok, r0, hit = box_hits(host_idx, dev_idx, tile, n, capacity, dev_rows, page_size, page_rows, TOKENS,
                                     FLAT)
        missed = tl.maximum(missed, tl.max((ok & ~hit).to(tl.int32), 0))
        dev_row = dev_base + d * dev_stride
        if VEC > 1:
            dev_row = tl.multiple_of(dev_row, VEC)
        for c0 in tl.static_range(0, WIDTH - WIDTH % BOX, BOX):
            store_box_rows(anchor, desc, dev_row, hit, r0, c0, WIDTH, BOX)
        if TAIL > 0:
            store_box_rows(anchor, tail, dev_row, hit, r0, WIDTH - WIDTH % BOX, WIDTH, TAIL)
    if missed > 0:  # indices that are not whole pages: this program's tiles again, gathering what no box held
        for tile in tl.range(pid, n_tiles, nprog, num_stages=1):
            h, d, ok, r0, hit = box_hits(host_idx, dev_idx, tile, n, capacity, dev_rows, page_size, page_rows,
                                         TOKENS, FLAT)
            miss = ok & ~hit
            if tl.max(miss.to(tl.int32), 0) > 0:
                p = h // page_size
                host_row = host_base + p * host_page + (h - p * page_size) * host_tok
                move_rows(anchor, dev_base + d * dev_stride, host_row, miss, WIDTH, BOX, VEC, False)


@triton.jit(do_not_specialize=["n"])
def PAGED_TMA_LOAD(anchor, host_desc, host_tail, host_desc_b, host_tail_b, host_idx, dev_idx, n, dev_base,
                   dev_stride, host_base, host_page, host_tok, dev_base_b, dev_stride_b, host_base_b, host_page_b,
                   host_tok_b, capacity, dev_rows, WIDTH: tl.constexpr, BOX: tl.constexpr,
                   TAIL: tl.constexpr, TOKENS: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
                   FLAT: tl.constexpr, ENTRIES: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """:func:`load_entry` of one entry, or of two (``ENTRIES == 2``: the ``_b`` values, e.g. MHA ``v`` after ``k``)."""
    load_entry(anchor, host_desc, host_tail, host_idx, dev_idx, n, dev_base, dev_stride, host_base, host_page,
               host_tok, PAGE_SIZE, capacity, dev_rows, WIDTH, BOX, TAIL, TOKENS, VEC, STAGES, FLAT)
    if ENTRIES == 2:
        load_entry(anchor, host_desc_b, host_tail_b, host_idx, dev_idx, n, dev_base_b, dev_stride_b, host_base_b,
                   host_page_b, host_tok_b, PAGE_SIZE, capacity, dev_rows, WIDTH, BOX, TAIL, TOKENS, VEC,
                   STAGES, FLAT)


@triton.jit
def page_item(item, ents, host_idx, dev_idx, n, page_size, capacity, dev_rows, per_ent, PARTS: tl.constexpr):
    """``(entry, page, part, h0, d0, inb)`` of work item ``item`` of :data:`PAGE_LOAD`: the page's first host
    slot and device row, and ``inb`` (int32 0/1): ``h0`` starts a host page, and the page's slots and rows
    ``h0 ..``, ``d0 ..`` are all in range (so the page's host span can be read)."""
    k = item // per_ent
    rest = item - k * per_ent
    pg = rest // PARTS
    j = rest - pg * PARTS
    p0 = pg * page_size
    h0 = tl.load(host_idx + p0).to(tl.int64)
    d0 = tl.load(dev_idx + p0).to(tl.int64)
    return tl.load(ents + k), pg, j, h0, d0, page_bounds(p0, h0, d0, n, page_size, capacity, dev_rows).to(tl.int32)


@triton.jit
def page_bounds(p0, h0, d0, n, page_size, capacity, dev_rows):
    """Whether the page at position ``p0`` (first host slot ``h0``, device row ``d0``; scalars or vectors) lies whole
    below ``n``, starts a host page, and its slots and rows ``h0 ..``, ``d0 ..`` are all in range.  No sums of index
    values: a garbage slot near 2**63 would wrap past the bounds."""
    return ((p0 < n - page_size + 1) & (h0 >= 0) & (h0 <= capacity - page_size) & (h0 % page_size == 0) & (d0 >= 0) &
            (d0 <= dev_rows - page_size))


@triton.jit
def page_run(host_idx, dev_idx, pg, n, page_size, h0, d0, inb, PAGE_TOKENS: tl.constexpr):
    """``inb`` (int32 0/1) where page ``pg``'s host slots and device rows are the runs ``h0 ..`` and ``d0 ..``
    (``PAGE_TOKENS``: a power of two, at least ``page_size``)."""
    i = tl.arange(0, PAGE_TOKENS)
    t = pg * page_size + i
    live = (i < page_size) & (t < n)
    hh = tl.load(host_idx + t, mask=live, other=-1).to(tl.int64)
    dd = tl.load(dev_idx + t, mask=live, other=-1).to(tl.int64)
    return tl.min(((hh == h0 + i) & (dd == d0 + i) | (i >= page_size)).to(tl.int32), 0) * inb


@triton.jit
def load_piece(anchor, src, on, OFF: tl.constexpr, SIZE: tl.constexpr, limit):
    """Words ``OFF .. OFF+SIZE-1`` (those below ``limit``) from ``anchor + src`` where ``on`` (int32 0/1)."""
    c = OFF + tl.arange(0, SIZE)
    return tl.load(anchor + src + c, mask=c < limit * on)


@triton.jit
def store_piece(anchor, dst, x, on, OFF: tl.constexpr, SIZE: tl.constexpr, limit, first, WIDTH: tl.constexpr,
                stride, STRIDED: tl.constexpr):
    """:func:`load_piece`'s words ``x`` to the device (same columns, where ``on``).

    Packed rows (not ``STRIDED``): to ``anchor + dst + OFF ..``.  ``STRIDED``: ``dst`` is the page's first
    device row and page word ``w = first + OFF + i`` goes to word ``w % WIDTH`` of row ``w // WIDTH``, rows
    ``stride`` words apart (a part of wider device rows, e.g. the latent of an MLA row).
    """
    c = OFF + tl.arange(0, SIZE)
    if STRIDED:
        w = first + c
        q = w // WIDTH
        at = q.to(tl.int64) * stride + (w - q * WIDTH)
    else:
        at = c
    tl.store(anchor + dst + at, x, mask=c < limit * on)


@triton.jit
def page_load(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
              capacity, dev_rows, page_size, WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
              PAGE_TOKENS: tl.constexpr, VEC: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr,
              R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr, R4: tl.constexpr, STAGES: tl.constexpr,
              STRIDED: tl.constexpr):
    """The body of :data:`PAGE_LOAD`, which passes its constexpr ``PAGE_SIZE`` as ``page_size`` (:func:`paged_rows`
    says why a constant).

    Load whole pages as flat words: host page ``h0 // page_size`` of entry ``e`` (``page_size * WIDTH``
    contiguous words at ``host_off + page * host_page``) to device rows ``d0 ..``, for every page whose host
    slots and device rows are runs.  Device rows are packed (``WIDTH`` words apart: the page is one run there
    too) or, ``STRIDED``, ``dev_stride`` words apart (``WIDTH`` words of each: one part of wider rows).

    A work item is one part of one page of one entry: ``PARTS`` parts of ``PART`` words (a power of two),
    the last one followed by the rest of the page in pieces ``R1``, ``R2``, ``R3`` (powers of two, 0:
    none) and ``R4`` (a power of two covering what is left, masked to the page).  Every piece is read
    before any is stored, so a program keeps a whole part in flight, and the read starts as soon as the
    page's first slot and row are known to be in range (:func:`page_item`); the check that the page is a
    run on both sides (:func:`page_run`, over ``PAGE_TOKENS`` positions) only gates the stores.  Pages that
    are not runs (device rows anywhere, or indices that are not whole pages) move nothing in that pass: the
    program then gathers their valid rows in tiles of ``TOKENS`` rows, as the row kernel would.  Positions
    failing :func:`index_tile`'s bounds move nothing; no bound is checked through a sum of index values.
    """
    pid, nprog = programs()
    per_ent = tl.cdiv(n.to(tl.int64), page_size) * PARTS
    n_items = per_ent * n_ents.to(tl.int64)
    missed = tl.zeros((), tl.int32)
    for item in tl.range(pid, n_items, nprog, num_stages=STAGES):
        e, pg, j, h0, d0, inb = page_item(item, ents, host_idx, dev_idx, n, page_size, capacity, dev_rows, per_ent,
                                          PARTS)
        tail = page_size * WIDTH - (PARTS - 1) * PART  # the page's words from the last part's start
        src = tl.load(host_off + e) + (h0 // page_size) * tl.load(host_page + e) + j * PART
        first = (j * PART).to(tl.int32)  # the part's first word in the page (STRIDED stores)
        if STRIDED:
            stride = tl.load(dev_stride + e)
            dst = tl.load(dev_off + e) + d0 * stride
        else:
            stride = WIDTH
            dst = tl.load(dev_off + e) + d0 * WIDTH + j * PART
        if VEC > 1:
            src = tl.multiple_of(src, VEC)
            dst = tl.multiple_of(dst, VEC)
        last = inb * (j == PARTS - 1).to(tl.int32)
        x = load_piece(anchor, src, inb, 0, PART, PART)
        if R1 > 0:
            x1 = load_piece(anchor, src, last, PART, R1, PART + R1)
        if R2 > 0:
            x2 = load_piece(anchor, src, last, PART + R1, R2, PART + R1 + R2)
        if R3 > 0:
            x3 = load_piece(anchor, src, last, PART + R1 + R2, R3, PART + R1 + R2 + R3)
        if R4 > 0:
            x4 = load_piece(anchor, src, last, PART + R1 + R2 + R3, R4, tail)
        run = page_run(host_idx, dev_idx, pg, n, page_size, h0, d0, inb, PAGE_TOKENS)
        missed = tl.maximum(missed, 1 - run)
        store_piece(anchor, dst, x, run, 0, PART, PART, first, WIDTH, stride, STRIDED)
        if R1 > 0:
            store_piece(anchor, dst, x1, run * last, PART, R1, PART + R1, first, WIDTH, stride, STRIDED)
        if R2 > 0:
            store_piece(anchor, dst, x2, run * last, PART + R1, R2, PART + R1 + R2, first, WIDTH, stride, STRIDED)
        if R3 > 0:
            store_piece(anchor, dst, x3, run * last, PART + R1 + R2, R3, PART + R1 + R2 + R3, first, WIDTH, stride,
                        STRIDED)
        if R4 > 0:
            store_piece(anchor, dst, x4, run * last, PART + R1 + R2 + R3, R4, tail, first, WIDTH, stride, STRIDED)
    if missed > 0:  # pages that were not runs: this program's first-part items again, gathering row by row
        for item in tl.range(pid, n_items, nprog, num_stages=1):
            e, pg, j, h0, d0, inb = page_item(item, ents, host_idx, dev_idx, n, page_size, capacity, dev_rows,
                                              per_ent, PARTS)
            run = page_run(host_idx, dev_idx, pg, n, page_size, h0, d0, inb, PAGE_TOKENS)
            if (1 - run) * (j == 0).to(tl.int32) > 0:  # one item per page gathers it: its first part's
                gather_page(anchor, host_idx, dev_idx, n, e, pg, dev_off, dev_stride, host_off, host_page, host_tok,
                            capacity, dev_rows, page_size, WIDTH, BLOCK, TOKENS, PAGE_TOKENS, VEC)


@triton.jit
def gather_page(anchor, host_idx, dev_idx, n, e, pg, dev_off, dev_stride, host_off, host_page, host_tok, capacity,
                dev_rows, page_size, WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
                PAGE_TOKENS: tl.constexpr, VEC: tl.constexpr, TO_HOST: tl.constexpr = False):
    """Page ``pg`` of entry ``e`` row by row, in tiles of ``TOKENS`` positions (the row kernel's): its valid pairs
    (positions below ``n``, slots and rows in range) move, the rest move nothing; to the device, or with ``TO_HOST``
    to the host.  ``PAGE_TOKENS``: at least ``page_size``."""
    for s0 in tl.range(0, PAGE_TOKENS, TOKENS):
        i = s0 + tl.arange(0, TOKENS)
        t = pg * page_size + i
        live = (i < page_size) & (t < n)
        h = tl.load(host_idx + t, mask=live, other=-1).to(tl.int64)
        d = tl.load(dev_idx + t, mask=live, other=-1).to(tl.int64)
        ok = live & (h >= 0) & (h < capacity) & (d >= 0) & (d < dev_rows)
        move_rows(anchor, device_rows(dev_off, dev_stride, e, d),
                  paged_rows(host_off, host_page, host_tok, e, h, page_size), ok, WIDTH, BLOCK, VEC, TO_HOST)


@triton.jit
def copy_words(anchor, dst, src, c0, total, CHUNK: tl.constexpr):
    """Words ``c0 .. c0+CHUNK-1`` (those below ``total``) from ``anchor + src`` to ``anchor + dst``."""
    c = c0 + tl.arange(0, CHUNK)
    m = c < total
    tl.store(anchor + dst + c, tl.load(anchor + src + c, mask=m), mask=m)


@triton.jit
def page_backup(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
                capacity, dev_rows, page_size: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                TOKENS: tl.constexpr, PAGE_TOKENS: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
                CHUNK: tl.constexpr):
    """Back up whole pages as flat words (device to host): a work item is one page of one entry; where its host
    slots and device rows are runs (:func:`page_run`, over ``PAGE_TOKENS`` positions, a power of two >= ``page_size``)
    and the entry's rows are packed on both sides (host token stride and device token stride ``WIDTH`` words), the
    page's ``page_size * WIDTH`` words go from device row ``d0`` to the host page's first word in steps of ``CHUNK``
    words (a power of two), so every host line but those at a page's ends is written whole (row by row, a row that
    ends mid-line leaves the line between two rows written in two halves); any other page is gathered row by row
    (:func:`gather_page`), its valid pairs alone.  ``page_size`` is a constexpr (the launch value ``PAGE_SIZE``)."""
    pid, nprog = programs()
    per_ent = tl.cdiv(n.to(tl.int64), page_size)
    n_items = per_ent * n_ents.to(tl.int64)
    for item in tl.range(pid, n_items, nprog, num_stages=STAGES):
        e, pg, _, h0, d0, inb = page_item(item, ents, host_idx, dev_idx, n, page_size, capacity, dev_rows, per_ent, 1)
        packed = ((tl.load(host_tok + e) == WIDTH) & (tl.load(dev_stride + e) == WIDTH)).to(tl.int32)
        run = page_run(host_idx, dev_idx, pg, n, page_size, h0, d0, inb * packed, PAGE_TOKENS)
        if run > 0:
            src = tl.load(dev_off + e) + d0 * WIDTH
            dst = tl.load(host_off + e) + (h0 // page_size) * tl.load(host_page + e)
            if VEC > 1:
                src = tl.multiple_of(src, VEC)
                dst = tl.multiple_of(dst, VEC)
            if page_size * WIDTH <= 8 * CHUNK:  # a few steps (a 64 x 656-byte page: 3): unrolled, as measured
                for c0 in tl.static_range(0, page_size * WIDTH, CHUNK):
                    copy_words(anchor, dst, src, c0, page_size * WIDTH, CHUNK)
            else:  # large pages of wide rows: a loop (unrolled, hundreds of steps would compile for minutes)
                for c0 in tl.range(0, page_size * WIDTH, CHUNK):
                    copy_words(anchor, dst, src, c0, page_size * WIDTH, CHUNK)
        else:
            gather_page(anchor, host_idx, dev_idx, n, e, pg, dev_off, dev_stride, host_off, host_page, host_tok,
                        capacity, dev_rows, page_size, WIDTH, BLOCK, TOKENS, PAGE_TOKENS, VEC, True)


@triton.jit
def page_group(item, ents, host_idx, dev_idx, n, n_pages, page_size, capacity, dev_rows, per_ent,
               GROUP: tl.constexpr):
    """``(entry, pages, h0, d0, inb, there)`` of work item ``item`` of a grouped page load: pages
    ``item % per_ent * GROUP ..`` (``GROUP`` of them, a vector) of one entry, each page's first host slot and device
    row, ``inb`` (int32 0/1, as :func:`page_item`'s) and ``there`` (the page exists: it starts below ``n``)."""
    k = item // per_ent
    pg = (item - k * per_ent) * GROUP + tl.arange(0, GROUP)
    p0 = pg * page_size
    there = pg < n_pages
    h0 = tl.load(host_idx + p0, mask=there, other=-1).to(tl.int64)
    d0 = tl.load(dev_idx + p0, mask=there, other=-1).to(tl.int64)
    inb = (there & page_bounds(p0, h0, d0, n, page_size, capacity, dev_rows)).to(tl.int32)
    return tl.load(ents + k), pg, h0, d0, inb, there


@triton.jit
def group_runs(host_idx, dev_idx, pg, n, page_size, h0, d0, inb, PAGE_TOKENS: tl.constexpr):
    """:func:`page_run` of every page of a group (vectors ``pg``, ``h0``, ``d0``, ``inb``)."""
    i = tl.arange(0, PAGE_TOKENS)[None, :]
    t = pg[:, None] * page_size + i
    live = (i < page_size) & (t < n)
    hh = tl.load(host_idx + t, mask=live, other=-1).to(tl.int64)
    dd = tl.load(dev_idx + t, mask=live, other=-1).to(tl.int64)
    return tl.min(((hh == h0[:, None] + i) & (dd == d0[:, None] + i) | (i >= page_size)).to(tl.int32), 1) * inb


@triton.jit
def page_group_load(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
                    capacity, dev_rows, page_size, WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
                    PAGE_TOKENS: tl.constexpr, VEC: tl.constexpr, PART: tl.constexpr, STAGES: tl.constexpr,
                    STRIDED: tl.constexpr, GROUP: tl.constexpr):
    """:func:`page_load` for small pages: a work item is ``GROUP`` consecutive pages of one entry, read as one
    ``[GROUP, PART]`` block (``PART``: a power of two of words covering a page, masked to it) before any is stored,
    so a program keeps ``GROUP`` pages in flight where one page alone would be a few hundred bytes.  A page moves
    where it is a run on both sides and in range; the others are gathered row by row afterwards
    (:func:`gather_page`), as in :func:`page_load`."""
    pid, nprog = programs()
    n_pages = tl.cdiv(n.to(tl.int64), page_size)
    per_ent = tl.cdiv(n_pages, GROUP)
    n_items = per_ent * n_ents.to(tl.int64)
    words = page_size * WIDTH
    c = tl.arange(0, PART)
    if STRIDED:
        q = c // WIDTH
        col = c - q * WIDTH
    missed = tl.zeros((), tl.int32)
    for item in tl.range(pid, n_items, nprog, num_stages=STAGES):
        e, pg, h0, d0, inb, there = page_group(item, ents, host_idx, dev_idx, n, n_pages, page_size, capacity,
                                               dev_rows, per_ent, GROUP)
        src = tl.load(host_off + e) + (h0 // page_size) * tl.load(host_page + e)
        if STRIDED:
            stride = tl.load(dev_stride + e)
            dst = tl.load(dev_off + e) + d0 * stride
            at = q.to(tl.int64) * stride + col
        else:
            dst = tl.load(dev_off + e) + d0 * WIDTH
            at = c
        if VEC > 1:
            src = tl.multiple_of(src, VEC)
            dst = tl.multiple_of(dst, VEC)
        x = tl.load(anchor + src[:, None] + c[None, :], mask=(c < words)[None, :] & (inb > 0)[:, None])
        run = group_runs(host_idx, dev_idx, pg, n, page_size, h0, d0, inb, PAGE_TOKENS)
        missed = tl.maximum(missed, tl.max((1 - run) * there.to(tl.int32), 0))
        tl.store(anchor + dst[:, None] + at[None, :], x, mask=(c < words)[None, :] & (run > 0)[:, None])
    if missed > 0:  # pages that were not runs: this program's items again, page by page
        for item in tl.range(pid, n_items, nprog, num_stages=1):
            k = item // per_ent
            for gi in range(0, GROUP):
                p = (item - k * per_ent) * GROUP + gi
                if p < n_pages:
                    e, p, _, h0, d0, inb = page_item(k * n_pages + p, ents, host_idx, dev_idx, n, page_size,
                                                     capacity, dev_rows, n_pages, 1)
                    if page_run(host_idx, dev_idx, p, n, page_size, h0, d0, inb, PAGE_TOKENS) == 0:
                        gather_page(anchor, host_idx, dev_idx, n, e, p, dev_off, dev_stride, host_off, host_page,
                                    host_tok, capacity, dev_rows, page_size, WIDTH, BLOCK, TOKENS, PAGE_TOKENS, VEC)


@triton.jit(do_not_specialize=["n", "n_ents"])
def PAGE_LOAD(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
              capacity, dev_rows, WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
              PAGE_TOKENS: tl.constexpr, VEC: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr,
              R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr, R4: tl.constexpr, STAGES: tl.constexpr,
              STRIDED: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr):
    """Load whole pages as flat words, the page size the constexpr ``PAGE_SIZE``: one page (or part of one) per
    work item (:func:`page_load`), or, ``GROUP`` > 1, ``GROUP`` small pages per work item
    (:func:`page_group_load`; ``PART`` then covers a page, ``PARTS`` is 1 and ``R1`` .. ``R4`` are 0)."""
    if GROUP > 1:
        page_group_load(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page,
                        host_tok, capacity, dev_rows, PAGE_SIZE, WIDTH, BLOCK, TOKENS, PAGE_TOKENS, VEC, PART, STAGES,
                        STRIDED, GROUP)
    else:
        page_load(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
                  capacity, dev_rows, PAGE_SIZE, WIDTH, BLOCK, TOKENS, PAGE_TOKENS, VEC, PART, PARTS, R1, R2, R3, R4,
                  STAGES, STRIDED)

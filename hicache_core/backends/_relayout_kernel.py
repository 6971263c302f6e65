"""The staged route's relayout kernel: device rows <-> staging page image, every entry of a group in one launch.

Imported only by :mod:`.relayout` when a kernel relayout actually runs (this
module imports Triton, which fixes interpreted or compiled mode when it
decorates the kernel; :mod:`.relayout` loads one copy per mode).

Addressing (words of the anchor's dtype, int64 offsets from ``anchor``, as in
:mod:`hicache_core.kernel_support`): for row ``i`` of the chunk, entry ``e``
(one row of ``table``) and row chunk ``c``::

    device: dev_off[e] + rows[i] * dev_stride[e] + c * CHUNK
    image:  img_base + chunk_pages * prefix[e] + img_off[e]
            + (i // page_size) * span[e] + (i % page_size) * token[e] + c * cstride[e]

Every access is masked: rows past ``n_rows``, device rows outside
``0..dev_len[e]-1`` and image chunks outside ``0..img_words-1`` move nothing, but a gather writes zeros to the
image slot of a device row out of range (so no stale bytes of an earlier transfer reach the host).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["relayout_kernel", "DYNAMIC_ARGS"]


@triton.jit(do_not_specialize=["n_rows", "n_tiles", "chunk_pages", "img_base", "img_words"])
def relayout_kernel(
    anchor,       # *word: origin of every address (device row 0 of the group's first entry)
    rows,         # *int [n_rows]: device row of each chunk row
    table,        # *int64 [n_ent, NCOL]: dev_off, dev_stride, dev_len, img_off, prefix, span, token, cstride, nch
    n_rows,       # rows of this chunk (pages * page_size)
    n_tiles,      # cdiv(n_rows, TOK)
    n_ent,        # entries of the group (rows of table)
    page_size,
    chunk_pages,  # pages per chunk (image regions are chunk_pages * prefix words in)
    img_base,     # image of this chunk: words from anchor
    img_words,    # image size (words): nothing outside 0..img_words-1 is touched
    NCOL: tl.constexpr,      # columns of table
    NCH: tl.constexpr,       # most row chunks of any entry (loop bound; entries with fewer mask the rest)
    CHUNK: tl.constexpr,     # words per row chunk
    TOK: tl.constexpr,       # rows per program
    BLOCK: tl.constexpr,     # words per column step (power of two)
    VEC: tl.constexpr,       # every row chunk's start is a multiple of VEC words (alignment hint)
    TO_IMAGE: tl.constexpr,  # True: device rows -> image (backup); False: image -> device rows (load)
):
    """One program per (row tile, entry): ``TOK`` rows of one entry, every chunk of each row."""
    pid = tl.program_id(0).to(tl.int64)
    e = pid // n_tiles
    tile = pid - e * n_tiles
    live_rows = tl.where(e < n_ent, n_rows, 0)  # a program past the last entry moves nothing
    e = tl.minimum(e, n_ent - 1)
    t = table + e * NCOL
    dev_off = tl.load(t)
    dev_stride = tl.load(t + 1)
    dev_len = tl.load(t + 2)
    img_off = tl.load(t + 3) + chunk_pages * tl.load(t + 4)
    span = tl.load(t + 5)
    token = tl.load(t + 6)
    cstride = tl.load(t + 7)
    nch = tl.load(t + 8)
    i = tile * TOK + tl.arange(0, TOK)
    live = i < live_rows
    d = tl.load(rows + i, mask=live, other=0).to(tl.int64)
    rel = img_off + (i // page_size) * span + (i % page_size) * token
    in_img = live & (rel >= 0) & (rel + (nch - 1) * cstride + CHUNK <= img_words)
    ok = in_img & (d >= 0) & (d < dev_len)
    dev = dev_off + d * dev_stride
    img = img_base + rel
    cols = tl.arange(0, BLOCK)
    for c in tl.static_range(NCH):
        for c0 in tl.static_range(0, CHUNK, BLOCK):
            col = c0 + cols
            has = (tl.full([TOK], c, tl.int64) < nch)[:, None] & (col < CHUNK)[None, :]
            m = ok[:, None] & has
            dptr = (dev + c * CHUNK)[:, None] + col[None, :]
            iptr = (img + c * cstride)[:, None] + col[None, :]
            if VEC > 1:
                dptr = tl.multiple_of(dptr, [1, VEC])
                iptr = tl.multiple_of(iptr, [1, VEC])
            if TO_IMAGE:
                # a device row out of range reads nothing and leaves zeros in its image slot (not what an earlier
                # transfer staged there: the copy engine moves the slot to the host)
                tl.store(anchor + iptr, tl.load(anchor + dptr, mask=m, other=0), mask=in_img[:, None] & has)
            else:
                tl.store(anchor + dptr, tl.load(anchor + iptr, mask=m), mask=m)


#: Positions of :func:`relayout_kernel`'s arguments that change from launch to launch.
DYNAMIC_ARGS = (1, 3, 4, 7, 8, 9)

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
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["programs", "work_size", "work_item", "index_tile", "device_rows", "paged_rows", "move_rows"]


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
    """Word offsets of host slots ``h`` of entry ``e`` in a paged layout: page stride, then token stride."""
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

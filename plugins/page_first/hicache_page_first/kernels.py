"""Triton kernel of the page-major layouts ``page_first`` and ``page_first_direct``.

Host slot ``s`` of entry ``e`` starts at ``host_off[e] + (s // PAGE_SIZE) *
host_page[e] + (s % PAGE_SIZE) * host_tok[e]`` words (the page size a constant: see
:func:`hicache_core.kernel_lib.paged_rows`).  The two layouts differ
in strides and in the order of work items (``ENTRIES_INNER``, set by each strategy):

* ``page_first`` (``[S, L, row]``): a token's rows of every layer are
  contiguous, so consecutive items are the layer entries of one token tile;
* ``page_first_direct`` (``[P, L, page_size, row]``): a page of one layer is
  contiguous, so consecutive items are the token tiles of one layer entry.

With ``PAGES``, backups copy whole pages as flat words instead
(:func:`hicache_core.kernel_lib.page_backup`): a layer's page is one packed run of rows in ``page_first_direct`` only
(:func:`hicache_core.rowcopy_pages.backup_reason` keeps token-major ``page_first`` rows, strided by every layer, on
the row path).  Built from :mod:`hicache_core.kernel_lib`; launched by
:class:`hicache_core.rowcopy.RowKernelStrategy` with the values it names.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hicache_core import kernel_lib as kl

__all__ = ["KERNEL", "TMA_LOAD_KERNEL", "PAGE_LOAD_KERNEL"]

#: Per-layer loads on Hopper-class GPUs: host slots are paged, so the shared descriptor kernel serves.
TMA_LOAD_KERNEL = kl.PAGED_TMA_LOAD
#: Loads of whole pages as flat words where a layer\'s host page is a packed run of rows.
PAGE_LOAD_KERNEL = kl.PAGE_LOAD


@triton.jit(do_not_specialize=["n", "n_ents"])
def KERNEL(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok, capacity,
           dev_rows, WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr, VEC: tl.constexpr,
           TO_HOST: tl.constexpr, STAGES: tl.constexpr, FENCE: tl.constexpr, ENTRIES_INNER: tl.constexpr,
           PAGE_SIZE: tl.constexpr, PDL: tl.constexpr = 0, PAGES: tl.constexpr = False,
           PAGE_TOKENS: tl.constexpr = 1, PAGE_CHUNK: tl.constexpr = 1):
    pid, nprog = kl.programs()
    n_tiles, n_items = kl.work_size(n, n_ents, TOKENS)
    if TO_HOST and PAGES:  # backups of whole pages as flat words (rowcopy_pages.backup_reason), unfenced, unchained
        kl.page_backup(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
                       capacity, dev_rows, PAGE_SIZE, WIDTH, BLOCK, TOKENS, PAGE_TOKENS, VEC, STAGES, PAGE_CHUNK)
        n_items = 0  # (a constant: the row loop below is compiled out)
    for item in tl.range(pid, n_items, nprog, num_stages=STAGES):
        kl.let_next_begin(item, n_items, nprog, PDL)
        e, tile = kl.work_item(item, ents, n_tiles, n_ents, ENTRIES_INNER)
        h, d, ok = kl.index_tile(host_idx, dev_idx, tile, n, capacity, dev_rows, TOKENS)
        host_row = kl.paged_rows(host_off, host_page, host_tok, e, h, PAGE_SIZE)
        kl.move_rows(anchor, kl.device_rows(dev_off, dev_stride, e, d), host_row, ok, WIDTH, BLOCK, VEC, TO_HOST)
        kl.tile_done(FENCE)
    kl.await_previous(PDL)

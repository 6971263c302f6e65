"""Triton kernel of the ``page_first_kv_split`` layout: a device row split over two host buffers.

A fused group (MLA ``latent`` + ``rope`` of one device row) sends words
``0..SPLIT-1`` of each row to the ``host_*`` buffers and the rest to the
``host_*_b`` buffers, both paged (``[P, L, page_size, width]``); a group of
one segment has ``SPLIT == WIDTH`` and never touches the second part.  On
load the parts are joined into the device row.  Work items walk in the strategy's order (``ENTRIES_INNER``:
the layer entries of one token tile together).  Built from :mod:`hicache_core.kernel_lib`.
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
def KERNEL(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
           host_off_b, host_page_b, host_tok_b, capacity, dev_rows, WIDTH: tl.constexpr,
           SPLIT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, TOKENS: tl.constexpr,
           VEC: tl.constexpr, TO_HOST: tl.constexpr, STAGES: tl.constexpr, FENCE: tl.constexpr,
           PAGE_SIZE: tl.constexpr, ENTRIES_INNER: tl.constexpr, PDL: tl.constexpr = 0):
    pid, nprog = kl.programs()
    n_tiles, n_items = kl.work_size(n, n_ents, TOKENS)
    for item in tl.range(pid, n_items, nprog, num_stages=STAGES):
        kl.let_next_begin(item, n_items, nprog, PDL)
        e, tile = kl.work_item(item, ents, n_tiles, n_ents, ENTRIES_INNER)
        h, d, ok = kl.index_tile(host_idx, dev_idx, tile, n, capacity, dev_rows, TOKENS)
        dev_row = kl.device_rows(dev_off, dev_stride, e, d)
        host_a = kl.paged_rows(host_off, host_page, host_tok, e, h, PAGE_SIZE)
        kl.move_rows(anchor, dev_row, host_a, ok, SPLIT, BLOCK, VEC, TO_HOST)
        if SPLIT < WIDTH:
            host_b = kl.paged_rows(host_off_b, host_page_b, host_tok_b, e, h, PAGE_SIZE)
            kl.move_rows(anchor, dev_row + SPLIT, host_b, ok, WIDTH - SPLIT, BLOCK_B, VEC, TO_HOST)
        kl.tile_done(FENCE)
    kl.await_previous(PDL)

"""Triton kernel of the ``page_first_kv_split`` layout.

One launch moves one *row group*: a device row (``ROW`` words) whose first
``SPLIT`` words live in host buffer ``a`` and whose remaining ``ROW - SPLIT``
words live in host buffer ``b`` (MLA ``latent`` + ``rope`` read from, or
written to, the device row once).  A group of one segment has ``SPLIT == ROW``
and never touches ``b``.

Work items are ``(selected page k, layer entry j)`` pairs, walked by a
persistent grid of programs (grid-stride loop).  Item ``(k, j)`` moves the
``PS`` tokens at index positions ``k*PS .. k*PS+PS-1`` of entry ``ent[j]``,
``TOKENS`` tokens by ``BLOCK`` words at a time.

Addressing (all int64, in words of the anchor's dtype, relative to ``anchor``):

* device row of token ``i``:  ``dev_off[e] + dev_idx[i] * dev_stride[e]``
* host row in buffer ``a``:   ``host_off_a[e] + (h // PS) * page_a + (h % PS) * SPLIT``
* host row in buffer ``b``:   ``host_off_b[e] + (h // PS) * page_b + (h % PS) * (ROW - SPLIT)``

(the layout stores a page of one layer as ``[page_size, width]``, so the host
token stride is the part's width).  Tokens whose host slot is outside
``0..capacity-1`` or whose device row is outside ``0..rows-1`` are masked
out: a bad index never reads or writes out of bounds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hicache_core.launch import Launcher

__all__ = ["kv_split_copy_kernel", "launch_kv_split", "DYNAMIC_ARGS"]


@triton.jit
def kv_split_copy_kernel(
    anchor,  # *word: every address below is anchor + int64 word offset
    host_idx,  # [n_tokens] int32/int64 host token slots
    dev_idx,  # [n_tokens] int32/int64 device rows
    ent,  # [n_ent] int64 entry positions (layers) to move
    dev_off,  # [E] int64 words: device row 0 of entry e (part offset folded in)
    dev_stride,  # [E] int64 words: device token stride of entry e
    host_off_a,  # [E] int64 words: host layer base of entry e in buffer a
    host_off_b,  # [E] int64 words: host layer base of entry e in buffer b
    n_tokens,  # entries of host_idx / dev_idx
    n_ent,  # entries of ent
    n_items,  # work items: cdiv(n_tokens, PS) * n_ent
    rows,  # device rows per layer (device index bound)
    capacity,  # host token slots (host index bound)
    page_a,  # host page stride of buffer a (words)
    page_b,  # host page stride of buffer b (words)
    PS: tl.constexpr,  # page size (tokens)
    ROW: tl.constexpr,  # device row words moved per token
    SPLIT: tl.constexpr,  # words of the row stored in buffer a (== ROW: no buffer b)
    TOKENS: tl.constexpr,  # tokens per inner step (power of two, <= next_pow2(PS))
    BLOCK: tl.constexpr,  # words per inner step (power of two)
    VEC: tl.constexpr,  # every row base is a multiple of VEC words (alignment hint)
    TO_HOST: tl.constexpr,  # True: device -> host (backup); False: host -> device (load)
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    tok = tl.arange(0, TOKENS)
    col = tl.arange(0, BLOCK)
    for item in range(pid, n_items, nprog):
        k = item // n_ent
        e = tl.load(ent + (item - k * n_ent)).to(tl.int64)
        d_off = tl.load(dev_off + e)
        d_stride = tl.load(dev_stride + e)
        h_a = tl.load(host_off_a + e)
        h_b = tl.load(host_off_b + e)
        for t0 in range(0, PS, TOKENS):
            i = k * PS + t0 + tok
            live = ((t0 + tok) < PS) & (i < n_tokens)
            h = tl.load(host_idx + i, mask=live, other=0).to(tl.int64)
            d = tl.load(dev_idx + i, mask=live, other=0).to(tl.int64)
            ok = live & (h >= 0) & (h < capacity) & (d >= 0) & (d < rows)
            hp = h // PS
            ht = h - hp * PS
            drow = d_off + d * d_stride
            arow = h_a + hp * page_a + ht * SPLIT
            brow = h_b + hp * page_b + ht * (ROW - SPLIT)
            if VEC > 1:
                drow = tl.multiple_of(drow, VEC)
                arow = tl.multiple_of(arow, VEC)
                brow = tl.multiple_of(brow, VEC)
            for c0 in range(0, ROW, BLOCK):
                c = (c0 + col)[None, :]
                in_a = ok[:, None] & (c < SPLIT)
                in_b = ok[:, None] & (c >= SPLIT) & (c < ROW)
                dptr = anchor + drow[:, None] + c
                aptr = anchor + arow[:, None] + c
                if TO_HOST:
                    x = tl.load(dptr, mask=ok[:, None] & (c < ROW))
                    tl.store(aptr, x, mask=in_a)
                    if SPLIT < ROW:
                        tl.store(anchor + brow[:, None] + (c - SPLIT), x, mask=in_b)
                else:
                    x = tl.load(aptr, mask=in_a)
                    if SPLIT < ROW:
                        xb = tl.load(anchor + brow[:, None] + (c - SPLIT), mask=in_b)
                        x = tl.where(c < SPLIT, x, xb)
                    tl.store(dptr, x, mask=ok[:, None] & (c < ROW))


#: Launches :func:`kv_split_copy_kernel` (all parameters positionally; see :class:`hicache_core.launch.Launcher`).
launch_kv_split = Launcher(kv_split_copy_kernel)
#: Positions of :func:`kv_split_copy_kernel`'s arguments that change from call to call
#: (indices, entries and the counts derived from them).
DYNAMIC_ARGS = (1, 2, 3, 8, 9, 10)

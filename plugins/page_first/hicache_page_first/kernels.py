"""Triton kernel moving rows between per-layer device tensors and a page-major host buffer.

One kernel serves both layouts of this plugin and both directions.  Host
address of (entry ``e``, host slot ``s``), in words from the anchor::

    host_off[e] + (s // page_size) * host_page + (s % page_size) * host_token

``page_first`` (``[S, L, row]``) and ``page_first_direct`` (``[P, L, ps, row]``)
differ only in those strides and in how the strategy groups work
(``item_tokens`` index positions x ``ent_group`` consecutive entries per work
item); see :mod:`hicache_page_first.strategy`.

Addressing convention (:mod:`hicache_core.kernel_support`): ``anchor`` is a
tensor typed as the access word; every address — device rows and pinned host
memory alike — is ``anchor + int64 word offset``.  Every load and store is
masked: index positions past ``n``, host slots outside ``0..capacity-1`` and
device rows outside ``0..dev_rows-1`` move nothing, so a bad index never
touches memory out of bounds even when value validation was skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache_core.launch import Launcher

__all__ = ["page_major_copy_kernel", "tile_shape", "launch", "MAX_BLOCK_BYTES",
           "TILE_BYTES", "MAX_TILE_ROWS", "NUM_WARPS"]

#: Widest row chunk one tile column loop moves (bytes): 1 KiB keeps a 576- or
#: 656-byte MLA row in one chunk at any access word.
MAX_BLOCK_BYTES = 1024

#: Bytes one tile (``TOK`` rows x ``BLOCK`` words) keeps in flight per program
#: (SM-driven H2D is latency bound, so bytes in flight matter).
#: H200 sweep 2026-11-29 (benchmarks/tune_tiles.py, docs/performance.md): 4.7 MB load_layer at 16 programs, page_first:
#: 8 KiB/4 warps 0.46, 32 KiB/16 warps 0.69; page_first_direct 0.47 -> 0.71;
#: backup_all_layers 0.94 either way.
TILE_BYTES = 32768

#: Upper bound on the rows of one tile (tiny rows such as a 4-byte fp32 scale).
MAX_TILE_ROWS = 64

#: Warps per program (same sweep: 16 warps best for loads at 32 KiB tiles).
NUM_WARPS = 16


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tile_shape(width: int, word: int) -> tuple[int, int]:
    """``(rows, block)`` of the copy tile for rows of ``width`` words of ``word`` bytes.

    ``block`` (words per chunk) is the next power of two >= ``width``, capped at
    :data:`MAX_BLOCK_BYTES`; ``rows`` fills :data:`TILE_BYTES`, capped at
    :data:`MAX_TILE_ROWS`.  Both are powers of two (Triton block shapes).
    """
    block = min(_next_pow2(width), max(1, MAX_BLOCK_BYTES // word))
    rows = min(MAX_TILE_ROWS, max(1, TILE_BYTES // (block * word)))  # powers of two divide powers of two
    return rows, block


@triton.jit
def _copy_tile(anchor, src_base, dst_base, ok, cols,
               WIDTH: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Copy ``WIDTH`` words from ``src_base[r]`` to ``dst_base[r]`` for every row ``r`` where ``ok[r]``."""
    for c in tl.static_range(0, WIDTH, BLOCK):
        col = c + cols
        m = ok[:, None] & (col < WIDTH)[None, :]
        src = src_base[:, None] + col[None, :]
        dst = dst_base[:, None] + col[None, :]
        if VEC > 1:  # each row's run starts on a VEC-word boundary: lets Triton vectorise
            src = tl.multiple_of(src, [1, VEC])
            dst = tl.multiple_of(dst, [1, VEC])
        x = tl.load(anchor + src, mask=m)
        tl.store(anchor + dst, x, mask=m)


@triton.jit(do_not_specialize=["ent0", "n_ent", "ent_group", "n_groups", "item_tokens"])
def page_major_copy_kernel(
    anchor,        # *word: origin of every address (the first device row of entry 0)
    host_idx,      # *int32|*int64 [n]: host slot of each index position
    dev_idx,       # *int32|*int64 [n]: device row of each index position
    dev_off,       # *int64 [entries]: device row 0 of each entry (words from anchor)
    dev_stride,    # *int64 [entries]: device token stride of each entry (words)
    host_off,      # *int64 [entries]: host layer slot base of each entry (words from anchor)
    n,             # index positions
    ent0,          # first selected entry
    n_ent,         # selected entries: ent0 .. ent0 + n_ent - 1
    ent_group,     # consecutive entries per work item
    n_groups,      # cdiv(n_ent, ent_group)
    item_tokens,   # index positions per work item
    page_size,
    host_page,     # host page stride (words)
    host_token,    # host token stride (words)
    capacity,      # host slots: valid host indices are 0 .. capacity - 1
    dev_rows,      # device rows: valid device indices are 0 .. dev_rows - 1
    WIDTH: tl.constexpr,    # row width (words)
    TOK: tl.constexpr,      # tile rows
    BLOCK: tl.constexpr,    # tile columns (words)
    VEC: tl.constexpr,      # every base offset is a multiple of VEC words (alignment hint)
    TO_HOST: tl.constexpr,  # True: device -> host (backup); False: host -> device (load)
):
    """Persistent grid-stride copy over work items ``(index block, entry group)``.

    Item ``it`` covers index positions ``[blk * item_tokens, (blk + 1) * item_tokens)``
    with ``blk = it // n_groups`` and entries ``ent0 + (it % n_groups) * ent_group``
    onward; entries are the innermost loop, so one program writes all of its
    entries' rows of a token (or page) before moving on.
    """
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    n_blk = tl.cdiv(n, item_tokens).to(tl.int64)
    total = n_blk * n_groups
    rows = tl.arange(0, TOK)
    cols = tl.arange(0, BLOCK)
    ent_end = ent0 + n_ent
    for item in range(pid, total, nprog):
        blk = item // n_groups
        e_lo = ent0 + (item % n_groups) * ent_group
        e_hi = tl.minimum(e_lo + ent_group, ent_end)
        first = blk * item_tokens
        for t0 in range(0, item_tokens, TOK):
            pos = t0 + rows
            i = first + pos
            ok = (i < n) & (pos < item_tokens)
            h = tl.load(host_idx + i, mask=ok, other=0).to(tl.int64)
            d = tl.load(dev_idx + i, mask=ok, other=0).to(tl.int64)
            ok = ok & (h >= 0) & (h < capacity) & (d >= 0) & (d < dev_rows)
            h_rel = (h // page_size) * host_page + (h % page_size) * host_token
            for e in range(e_lo, e_hi):
                hb = tl.load(host_off + e) + h_rel
                db = tl.load(dev_off + e) + d * tl.load(dev_stride + e)
                if TO_HOST:
                    _copy_tile(anchor, db, hb, ok, cols, WIDTH, BLOCK, VEC)
                else:
                    _copy_tile(anchor, hb, db, ok, cols, WIDTH, BLOCK, VEC)


_launch = Launcher(page_major_copy_kernel)

#: Positions of :func:`page_major_copy_kernel`'s arguments that change from call to call.
DYNAMIC_ARGS = (1, 2, 6, 7, 8, 9, 10, 11)


def static_key(anchor: torch.Tensor, dev_off: torch.Tensor, dev_stride: torch.Tensor, host_off: torch.Tensor, *,
               page_size: int, host_page: int, host_token: int, capacity: int, dev_rows: int, width: int,
               word: int, vec: int, to_host: bool) -> tuple:
    """The launch key of everything fixed per pool and segment (see :class:`hicache_core.launch.Launcher`)."""
    tok, block = tile_shape(width, word)
    args = (anchor, None, None, dev_off, dev_stride, host_off, None, None, None, None, None, None,
            page_size, host_page, host_token, capacity, dev_rows, width, tok, block, vec, to_host)
    return (tok, block), _launch.static_key(args, DYNAMIC_ARGS)


def launch(
    grid: int,
    anchor: torch.Tensor,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    dev_off: torch.Tensor,
    dev_stride: torch.Tensor,
    host_off: torch.Tensor,
    *,
    n: int,
    ent0: int,
    n_ent: int,
    ent_group: int,
    item_tokens: int,
    page_size: int,
    host_page: int,
    host_token: int,
    capacity: int,
    dev_rows: int,
    width: int,
    word: int,
    vec: int,
    to_host: bool,
    key: tuple | None = None,
) -> None:
    """Launch :func:`page_major_copy_kernel` on ``grid`` programs (tile shape from :func:`tile_shape`).

    ``key``: :func:`static_key` of the same fixed arguments, computed once (saves host time per call).
    """
    (tok, block), static = key if key is not None else ((*tile_shape(width, word),), None)
    n_groups = -(-n_ent // ent_group)
    _launch(grid, (
        anchor, host_idx, dev_idx, dev_off, dev_stride, host_off,
        n, ent0, n_ent, ent_group, n_groups, item_tokens,
        page_size, host_page, host_token, capacity, dev_rows,
        width, tok, block, vec, to_host,  # WIDTH, TOK, BLOCK, VEC, TO_HOST
    ), num_warps=NUM_WARPS, static_key=static, dynamic=DYNAMIC_ARGS)

"""Triton kernel of the ``layer_first`` layout: rows between per-layer device tensors and ``[L, S, row]`` host buffers.

In ``layer_first`` host slot ``s`` of host layer ``h`` starts at
``host_off[e] + s * host_tok[e]`` words (``host_off`` folds in the layer map,
the buffer base and the segment offset), so no page arithmetic is needed.
Device row ``r`` of entry ``e`` starts at ``dev_off[e] + r * dev_stride[e]``
(device rows may be strided views).  All offsets are in *words* from one
anchor pointer (see :mod:`hicache_core.kernel_support`); host memory is
pinned and reached through unified addressing (zero-copy).

One launch copies every selected (entry, token) row of a group of segments
that share the access word and the row width: ``backup_all_layers`` is one
launch over all owned layers, ``load_layer`` one launch over that layer's
entries.  A persistent grid of ``programs`` programs walks the work items
``(entry, token block, column block)`` with a grid-stride loop; each item is
a ``[TOKENS, BLOCK]`` tile of words.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hicache_core.launch import Launcher

__all__ = [
    "BACKUP_PROGRAMS",
    "LOAD_PROGRAMS",
    "LOAD_TILE_BYTES",
    "BACKUP_TILE_BYTES",
    "MAX_BLOCK_BYTES",
    "MAX_TOKENS",
    "LOAD_NUM_WARPS",
    "BACKUP_NUM_WARPS",
    "TileShape",
    "tile_shape",
    "grid_size",
    "copy_rows",
    "LaunchPlan",
    "launch_plan",
    "DYNAMIC_ARGS",
]

# --- tuning constants -----------------------------------------------------------------------
# Set by H200 measurements (ratio against a pinned ``copy_`` of the same bytes, same run; see
# docs/performance.md).  They are read when a pool is prepared.
# * load (H2D) reads pinned host memory over PCIe: latency-bound, so each program keeps many
#   bytes in flight (a large tile, more warps) and loads get more programs;
# * backup (D2H) writes host memory with posted writes: link-bound with few programs; the warps
#   per program also decide how much a GEMM running beside it slows down (the sweep below);
# * the budgets leave most SMs to the forward pass.  HICACHE_KERNEL_PROGRAMS or the strategy's
#   ``programs`` override both.

#: Default programs (persistent grid size) of a backup launch.  H200 2026-11-29: with the backup
#: tile below, 8 programs move 0.95 of memcpy (MLA 61x576, 32768 tokens); page-major layouts
#: reach 0.91-0.95 at 8, within 0.01 of 16 programs.
BACKUP_PROGRAMS = 8
#: Default programs of a load launch: loads are latency-bound.  H200 2026-11-29, MLA 37.7 MB/layer
#: across layouts: 0.83-0.89 at 16 programs, 0.56-0.89 at 8 (layer_first alone: 0.86-0.88 at 16,
#: 0.89 at 8; 4.7 MB layers: 0.69 at 16, 0.67-0.71 at 8); one default for every layout.
LOAD_PROGRAMS = 16
#: Target bytes per tile (``TOKENS x BLOCK`` words) of a load (H2D) iteration.
#: H200 sweep 2026-11-29 (benchmarks/tune_tiles.py, docs/performance.md): load_layer of 4.7 MB at 8 programs: 16 KiB 0.46,
#: 32 KiB 0.57, 64 KiB 0.70 of memcpy (16 warps); the backup is unaffected.
LOAD_TILE_BYTES = 65536
#: Target bytes per tile of a backup (D2H) iteration.  H200 sweep 2026-11-29
#: (tune_tiles.py --sweeps layer_first-backup --tokens 32768 --programs 8 --gemm): 8 KiB/4 warps
#: 0.75 of memcpy (bf16 8192^3 GEMM beside it +10%), 32 KiB/4 warps 0.95 (GEMM +32%), 32 KiB/16
#: warps 0.94 (GEMM +119%), 64 KiB/4 warps 0.95 (GEMM +58%).
BACKUP_TILE_BYTES = 32768
#: Widest column block; longer rows are copied in several column blocks.
MAX_BLOCK_BYTES = 4096
#: Most tokens per tile (rows of tiny components would otherwise make huge tiles).
MAX_TOKENS = 256
#: Warps per program of a load launch (same sweep: 16 beats 8 at 64 KiB tiles, 0.70 vs 0.69).
LOAD_NUM_WARPS = 16
#: Warps per program of a backup launch (same sweep: more warps, same throughput, a slower GEMM).
BACKUP_NUM_WARPS = 4


@triton.jit(do_not_specialize=["n_ents", "n", "dev_rows", "capacity"])
def _layer_first_copy_kernel(
    anchor,  # *word: every address is anchor + an int64 word offset
    ents,  # *int64 [n_ents]: positions in the entry tables below to copy
    n_ents,  # int: selected entries
    host_idx,  # *int32|*int64 [n]: host token slots
    dev_idx,  # *int32|*int64 [n]: device rows, paired with host_idx
    n,  # int: index pairs
    dev_off,  # *int64 [entries]: word offset of device row 0 of the entry's layer tensor
    dev_stride,  # *int64 [entries]: device token stride (words)
    host_off,  # *int64 [entries]: word offset of host slot 0 of the entry's host layer
    host_tok,  # *int64 [entries]: host token stride (words)
    dev_rows,  # int: device rows; device indices outside 0..dev_rows-1 are skipped
    capacity,  # int: host slots; host indices outside 0..capacity-1 are skipped
    WIDTH: tl.constexpr,  # row width (words)
    BLOCK: tl.constexpr,  # column block (words, power of two)
    TOKENS: tl.constexpr,  # tokens per tile (power of two)
    VEC: tl.constexpr,  # every row start is a multiple of VEC words (vector width hint)
    TO_HOST: tl.constexpr,  # True: device -> host (backup); False: host -> device (load)
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    n64 = n.to(tl.int64)
    ents64 = n_ents.to(tl.int64)
    N_CB: tl.constexpr = (WIDTH + BLOCK - 1) // BLOCK
    per_ent = tl.cdiv(n64, TOKENS) * N_CB
    total = ents64 * per_ent
    tok = tl.arange(0, TOKENS)
    col = tl.arange(0, BLOCK)
    for item in range(pid, total, nprog):
        ep = item // per_ent
        rem = item - ep * per_ent
        tb = rem // N_CB
        cb = rem - tb * N_CB
        e = tl.load(ents + ep, mask=ep < ents64, other=0)
        d_off = tl.load(dev_off + e)
        d_str = tl.load(dev_stride + e)
        h_off = tl.load(host_off + e)
        h_tok = tl.load(host_tok + e)
        t = tb * TOKENS + tok
        tmask = t < n64
        h = tl.load(host_idx + t, mask=tmask, other=-1).to(tl.int64)
        d = tl.load(dev_idx + t, mask=tmask, other=-1).to(tl.int64)
        ok = tmask & (h >= 0) & (h < capacity) & (d >= 0) & (d < dev_rows)
        drow = tl.multiple_of(d_off + d * d_str, VEC)
        hrow = tl.multiple_of(h_off + h * h_tok, VEC)
        c = cb * BLOCK + col
        m = ok[:, None] & (c < WIDTH)[None, :]
        dptr = anchor + drow[:, None] + c[None, :]
        hptr = anchor + hrow[:, None] + c[None, :]
        if TO_HOST:
            tl.store(hptr, tl.load(dptr, mask=m), mask=m)
        else:
            tl.store(dptr, tl.load(hptr, mask=m), mask=m)


_launch = Launcher(_layer_first_copy_kernel)


@dataclass(frozen=True)
class TileShape:
    """Launch shape of one group: column block and tokens per tile (words), warps."""

    block: int
    tokens: int
    num_warps: int


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def tile_shape(width: int, word: int, to_host: bool) -> TileShape:
    """The tile for rows of ``width`` words of ``word`` bytes, from the tuning constants."""
    block = min(1 << max(0, width - 1).bit_length(), _pow2_floor(MAX_BLOCK_BYTES // word))
    target = BACKUP_TILE_BYTES if to_host else LOAD_TILE_BYTES
    tokens = min(MAX_TOKENS, _pow2_floor(target // (block * word)))
    return TileShape(block, tokens, BACKUP_NUM_WARPS if to_host else LOAD_NUM_WARPS)


def grid_size(programs: int, items: int) -> int:
    """Programs to launch: the budget, or fewer when there are fewer work items."""
    return max(1, min(programs, items))


#: Argument positions of :func:`_layer_first_copy_kernel` that change from call to call
#: (entries, their count, the index tensors, their length); the rest is fixed per pool and group.
DYNAMIC_ARGS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class LaunchPlan:
    """What a group needs per direction, computed once per pool: tile shape and static launch key."""

    shape: TileShape
    static_key: tuple


def launch_plan(*, anchor: torch.Tensor, dev_off: torch.Tensor, dev_stride: torch.Tensor, host_off: torch.Tensor,
                host_tok: torch.Tensor, dev_rows: int, capacity: int, width: int, word: int, vec: int,
                to_host: bool) -> LaunchPlan:
    """The tile (from the tuning constants as they are now) and the static key of a group's launches."""
    shape = tile_shape(width, word, to_host)
    args = (anchor, None, None, None, None, None, dev_off, dev_stride, host_off, host_tok, dev_rows, capacity,
            width, shape.block, shape.tokens, vec, to_host)
    return LaunchPlan(shape, _launch.static_key(args, DYNAMIC_ARGS))


def copy_rows(
    *,
    anchor: torch.Tensor,
    ents: torch.Tensor,
    n_ents: int,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    dev_off: torch.Tensor,
    dev_stride: torch.Tensor,
    host_off: torch.Tensor,
    host_tok: torch.Tensor,
    dev_rows: int,
    capacity: int,
    width: int,
    word: int,
    vec: int,
    to_host: bool,
    programs: int,
    plan: LaunchPlan | None = None,
) -> int:
    """Launch one copy of rows ``dev_idx`` <-> host slots ``host_idx`` for entries ``ents``.

    Enqueued on the current stream; no synchronisation.  Returns the grid size.
    Callers pass index tensors on the anchor's device; indices out of range are
    skipped by the kernel, never accessed.  ``plan`` (from :func:`launch_plan` with the
    same fixed arguments) saves recomputing the tile and the static launch key.
    """
    n = host_idx.numel()
    shape = plan.shape if plan is not None else tile_shape(width, word, to_host)
    # plain integer ceil-divisions: triton.cdiv goes through the JIT machinery (~5 us a call on the host)
    items = n_ents * -(-n // shape.tokens) * -(-width // shape.block)
    grid = grid_size(programs, items)
    _launch(grid, (
        anchor, ents, n_ents, host_idx, dev_idx, n,
        dev_off, dev_stride, host_off, host_tok, dev_rows, capacity,
        width, shape.block, shape.tokens, vec, to_host,  # WIDTH, BLOCK, TOKENS, VEC, TO_HOST
    ), num_warps=shape.num_warps, static_key=plan.static_key if plan is not None else None, dynamic=DYNAMIC_ARGS)
    return grid

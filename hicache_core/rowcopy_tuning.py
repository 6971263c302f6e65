"""Launch shapes of the row-copy kernel strategies: :class:`Tuning` per direction (:class:`KernelTuning`), the shared
TMA and page load tunings, and the tile a group of rows is moved in (:func:`tile`).

Part of the row-copy toolkit whose public face is :mod:`hicache_core.rowcopy` (every name here is importable from
there too).  Nothing here imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["Tuning", "KernelTuning", "TMA_LOAD_TUNING", "PAGE_LOAD_TUNING", "PAGE_BACKUP_TUNING", "BACKUP_LAUNCH_BYTES",
           "tile",
           "MAX_BLOCK_BYTES", "MAX_TOKENS", "MAX_VECTOR_BYTES", "MAX_TILE_BYTES"]

#: Widest column step of a tile; longer rows take several steps.
MAX_BLOCK_BYTES = 4096
#: Most tokens per tile (rows of tiny components would otherwise make huge tiles).
MAX_TOKENS = 256
#: Widest access the kernels are told about through ``tl.multiple_of``.
MAX_VECTOR_BYTES = 16


#: The largest ``tile_bytes``: a page load's piece is ``tile_bytes`` over the access word (1 byte at the least) words,
#: and Triton refuses a tensor of more than 2**20 elements (16x the page loads' default, 64 KiB).
MAX_TILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Tuning:
    """Launch shape of one direction: programs (the persistent grid, an SM budget), warps per program,
    the bytes one program moves per tile, and how many work items the loop keeps in flight
    (``stages``, software pipelining); ``maxnreg`` caps registers per thread; ``fence``: each program waits
    after each tile until the GPU has taken its writes (:func:`hicache_core.kernel_lib.tile_done`; kernels that
    declare ``FENCE``, on CUDA), for groups whose rows (both parts) hold at least ``fence_min_row_bytes``: backups
    that bound their host writes in flight so slow a GEMM beside them less, where a tile carries enough bytes for
    the wait not to cost them speed; ``launch_bytes``: the most bytes one launch moves: a call moving more goes out
    in several launches back to back (some entries each, or, where the strategy walks a tile's entries together,
    every entry of a run of positions), so that no launch holds its SMs for long; a launch still moves at least one
    entry's rows, or one aligned run of positions, even where those are more (0: one launch per group); ``pdl``: a
    call's launches after its first are programmatic dependent launches (Hopper's PDL) where the kernel declares
    ``PDL``, on CUDA devices of compute capability 9.0 and later: each may begin while the one before drains its
    last work items (:func:`hicache_core.kernel_lib.let_next_begin`), and ends only after it."""

    programs: int
    num_warps: int
    tile_bytes: int
    stages: int = 1
    maxnreg: int | None = None
    fence: bool = False
    fence_min_row_bytes: int = 0
    launch_bytes: int = 0
    pdl: bool = False

    def __post_init__(self) -> None:
        for name in ("programs", "num_warps", "tile_bytes", "stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if self.tile_bytes > MAX_TILE_BYTES:
            raise ConfigError(f"tile_bytes must be at most {MAX_TILE_BYTES} (a page load's piece of more than 2**20 "
                              f"elements exceeds Triton's largest tensor), got {self.tile_bytes}")
        if self.num_warps & (self.num_warps - 1):
            raise ConfigError(f"num_warps must be a power of two (1, 2, 4, ...), got {self.num_warps}")
        for name in ("fence", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("fence_min_row_bytes", "launch_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {v!r}")
        if self.maxnreg is not None and (isinstance(self.maxnreg, bool) or not isinstance(self.maxnreg, int)
                                         or self.maxnreg < 1):
            raise ConfigError(f"maxnreg must be a positive int (registers per thread) or None, got {self.maxnreg!r}")


@dataclass(frozen=True)
class KernelTuning:
    """A strategy's :class:`Tuning` per direction; ``tma_load``: per-layer loads through tensor
    descriptors (``None``: the strategy has no TMA loads); ``page_load``: loads of whole pages as flat
    words (``tile_bytes``: the largest part of a page one work item reads; ``None``: no page loads);
    ``page_backup``: backups of whole pages as flat words, for the groups whose backups take them
    (``tile_bytes``: the bytes of a page one step copies, and the tile of pages gathered row by row; ``None``: every
    backup by rows)."""

    backup: Tuning
    load: Tuning
    tma_load: Tuning | None = None
    page_load: Tuning | None = None
    page_backup: Tuning | None = None

    def direction(self, to_host: bool) -> Tuning:
        return self.backup if to_host else self.load


#: Launch shape of the shared TMA load kernel (``kernel_lib.PAGED_TMA_LOAD``), for a plugin's
#: ``KernelTuning.tma_load``.  H200 2026-11-30 (docs/perf/runs.md, "TMA loads for every host layout";
#: sweeps in docs/perf/tune-tma-*-2026-11-30.json): 4 programs move a load burst of 1152- or 2048-byte rows
#: as fast as the row kernel at 16, with a GEMM beside them -0.9% to +1% instead of up to +6%; boxes of
#: ~20 KiB (16 rows of 1152 bytes, 8 of 2 KiB) beat ~40 KiB by 0.01-0.025 at the same GEMM cost.
TMA_LOAD_TUNING = Tuning(programs=4, num_warps=4, tile_bytes=20480, stages=4)
#: Launch shape of the shared page load kernel (``kernel_lib.PAGE_LOAD``), for a plugin's
#: ``KernelTuning.page_load``: parts of up to 64 KiB (a 64 x 656-byte page is one item).
PAGE_LOAD_TUNING = Tuning(programs=16, num_warps=16, tile_bytes=65536)

#: ``Tuning.launch_bytes`` of the shipped plugins' backups: an all-layer backup goes out in launches of at most this
#: many bytes, back to back.  A kernel that holds SMs for milliseconds slows a GEMM beside it whatever it does there: on
#: an H100 (2026-12-07, benchmarks/backup_hint_probe.py, record calls 55-56) programs that only waited, as long as an
#: MLA all-layer backup takes (5.5 ms), cost a bf16 8192^3 GEMM +5-7% (1-2 programs) to +11-12% (4-8), and nothing in
#: launches of 100 us (+1.4% at most in launches of 1 ms).  The plugins' backups at 4096 tokens (record calls 57-59):
#: rows of >= 1152 B 0.921-0.933 of memcpy at -0.6% to +2.3% (one launch: 0.934-0.948 at +12% to +21%); fp8 rows
#: 0.853-0.876 at +0.6-2.7% (0.874-0.920 at +8-14%); launches of 8 MiB lost 2-9 more points, of 64 MiB cost +3-8%.
BACKUP_LAUNCH_BYTES = 32 << 20
#: Launch shape of backups of whole pages as flat words (``kernel_lib.page_backup``, a plugin's ``KERNEL`` declaring
#: ``PAGES``), for a plugin's ``KernelTuning.page_backup``: 4 programs, steps of 16 KiB, no fence, no dependent
#: launches, the row backups' launch size.  On an H100 (2026-12-07, benchmarks/backup_place_probe.py, record calls
#: 68-69; MLA all-layer backups, 4096 tokens, page 64) against the row kernel's default (8 programs): fp8 656-byte rows
#: 0.934 of memcpy at +0.2% GEMM against 0.820-0.836 at +2.6% to +10.1%, fp8 576 B 0.937 / +0.5% against 0.906 /
#: +0.7%, bf16 576 (1152-byte rows) 0.938 / +0.9% against 0.919 / +0.1%; at 8 programs the pages reached 0.93-0.94
#: too but cost the GEMM +15-17%, at 2 programs they fell to 0.63-0.66; the row kernel at 4 programs fell to 0.49-0.71.
PAGE_BACKUP_TUNING = Tuning(programs=4, num_warps=4, tile_bytes=16384, launch_bytes=BACKUP_LAUNCH_BYTES)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def tile(width: int, split: int, word: int, tile_bytes: int) -> tuple[int, int, int]:
    """``(BLOCK, BLOCK_B, TOKENS)`` for rows of ``width`` words (``split`` in the first part).

    Column steps are the next power of two of each part, capped at
    :data:`MAX_BLOCK_BYTES`; ``TOKENS`` fills ``tile_bytes`` (capped at
    :data:`MAX_TOKENS`).  All powers of two (Triton block shapes).
    """
    cap = _pow2_floor(MAX_BLOCK_BYTES // word)
    block = min(_pow2_ceil(split), cap)
    block_b = min(_pow2_ceil(max(1, width - split)), cap)
    step = block + (block_b if split < width else 0)
    return block, block_b, max(1, min(MAX_TOKENS, _pow2_floor(tile_bytes // (step * word))))

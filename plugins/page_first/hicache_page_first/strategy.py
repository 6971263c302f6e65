"""``page_first.kernel`` and ``page_first_direct.kernel``: the page-major Triton strategies.

Everything but the kernels and their tuning is :class:`hicache_core.rowcopy.RowKernelStrategy`.
Kernels are imported on first :meth:`prepare`, so ``supports`` works (and
explains itself) where Triton is missing.
"""

from __future__ import annotations

from hicache_core.rowcopy import (BACKUP_LAUNCH_BYTES, PAGE_BACKUP_TUNING, PAGE_LOAD_TUNING, TMA_LOAD_TUNING,
                                  KernelTuning, RowKernelStrategy, Tuning)

__all__ = ["PageFirstKernelStrategy", "PageFirstDirectKernelStrategy", "TUNING"]

#: Launch shape per direction, both layouts.  H200 sweep 2026-11-30 (benchmarks/tune_tiles.py,
#: docs/perf/tune-2026-11-30.json): backups at 8 programs x 4 warps x 32 KiB reach 0.83-0.84 of
#: memcpy with a GEMM beside them +12-13%; 16 warps reach 0.91-0.95 but cost the GEMM +44% to +172%
#: (2026-11-29), so backups keep 4 warps (the copy engine, io_backend direct/auto, moves these
#: backups at 0.93 for +1-2%).  Loads need more programs and warps in flight.  Backups of rows of >= 2 KiB wait for
#: each tile's writes (fence, kernel_lib.tile_done): on an H100 (2026-12-07, benchmarks/backup_place_probe.py,
#: docs/perf/runs.md) all-layer backups of MHA 2048-byte rows ran 0.944-0.947 with a GEMM beside them +13% (unfenced:
#: 0.948-0.950 at +67-69%); MLA bf16 1152-byte rows fenced ran 0.923 at +14% against 0.931 at +20% (page_first)
#: and 0.872 at +13% against 0.920 at +20% (page_first_direct), fp8 rows 15-19 points slower at about the same GEMM
#: cost.  A call moving more than BACKUP_LAUNCH_BYTES goes out in launches (H100, record calls 57-59): page_first
#: (token-major) every layer of a run of tokens per launch, MLA bf16 0.921 at +0.5% (one launch 0.936 at +21%), at
#: 32768 tokens 0.926 at +0.2% (0.934 at +25%), MHA 0.923 at -0.6% (0.946 at +14%); page_first_direct some layers per
#: launch, MLA bf16 0.925 at +2.3% (0.934 at +21%).
#: Those launches after a call's first are programmatic dependent launches (pdl, sm_90+: each may begin while the
#: one before drains; H100, record call 63): MHA page_first 0.925 -> 0.940 at +0.8% -> +1.6%.
TUNING = KernelTuning(
    backup=Tuning(programs=8, num_warps=4, tile_bytes=32768, fence=True, fence_min_row_bytes=2048,
                  launch_bytes=BACKUP_LAUNCH_BYTES, pdl=True),
    load=Tuning(programs=16, num_warps=16, tile_bytes=32768),
    tma_load=TMA_LOAD_TUNING,  # per-layer loads through TMA on compute capability 9.x/10.x
    page_load=PAGE_LOAD_TUNING,  # loads of whole contiguous pages as flat words (rowcopy_pages)
    # backups of whole pages of narrow rows as flat words where a layer's page is one packed run (page_first_direct;
    # rowcopy_pages.backup_reason; KERNEL's PAGES): the same kernel_lib.page_backup as layer_first's
    page_backup=PAGE_BACKUP_TUNING,
)


class PageFirstKernelStrategy(RowKernelStrategy):
    """``page_first`` (``[S, L, row]``): consecutive work items are the layers of one token tile."""

    name = "page_first.kernel"
    layouts = ("page_first",)
    kernel_module = "hicache_page_first.kernels"
    entries_inner = True
    tuning = TUNING
    # (pages of one host layer alone: bit-exact on a GPU, not timed yet; page_backups=True takes them)
    auto_page_backups = False


class PageFirstDirectKernelStrategy(RowKernelStrategy):
    """``page_first_direct`` (``[P, L, page_size, row]``): consecutive work items are the tiles of one layer."""

    name = "page_first_direct.kernel"
    layouts = ("page_first_direct",)
    kernel_module = "hicache_page_first.kernels"
    entries_inner = False
    tuning = TUNING

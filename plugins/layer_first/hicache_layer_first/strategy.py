"""``layer_first.kernel``: the Triton zero-copy strategy of the ``layer_first`` layout.

Everything but the kernel and its tuning is :class:`hicache_core.rowcopy.RowKernelStrategy`:
per-pool tables, groups (MHA ``k`` and ``v`` of equal width share a launch),
one launch per group per transfer.
"""

from __future__ import annotations

from hicache_core import Layout, PoolSpec
from hicache_core.rowcopy import (BACKUP_LAUNCH_BYTES, PAGE_BACKUP_TUNING, PAGE_LOAD_TUNING, TMA_LOAD_TUNING,
                                  KernelTuning, RowKernelStrategy, Tuning)

__all__ = ["LayerFirstKernelStrategy", "STRATEGY_NAME", "TUNING"]

STRATEGY_NAME = "layer_first.kernel"

#: Launch shape per direction.  H200 sweep 2026-11-30 (benchmarks/tune_tiles.py, MLA 61x576 bf16,
#: 4096 tokens, page 64, docs/perf/tune-2026-11-30.json): a bf16 GEMM beside a backup slows by
#: ~+2.5% per program up to 4 and ~+12% at 4-8 programs whatever the warps or tile (the GEMM loses
#: the SMs); backups reach 0.93-0.94 of memcpy at 8 programs x 4 warps x 32 KiB, 0.83 at 4, 0.42 at 2.
#: Loads (H2D) are latency-bound: they need more programs and bytes in flight (0.74 at 8 x 4 x 32 KiB).
#: Backups of rows of >= 1 KiB wait for each tile's writes (fence, kernel_lib.tile_done): on an H100 (2026-12-07,
#: benchmarks/backup_place_probe.py, docs/perf/runs.md) all-layer backups of MLA bf16 1152-byte rows ran 0.934 with
#: a GEMM beside them +12% (unfenced: 0.931 at +30%), MHA 2048-byte rows 0.947 at +16% (0.948 at +78%); fp8 rows
#: fenced lost 9-15 points of the ratio (656 B: 0.812 at +9.5% against 0.907 at +19.5%; 576 B: 0.756 at +7.5%
#: against 0.905 at +10.0%), so they stay unfenced.  A call moving more than BACKUP_LAUNCH_BYTES goes out in launches of
#: some layers each (H100, record calls 57-59): MLA bf16 0.925-0.927 at -0.3% to +0.3% (one launch: 0.936 at +12%),
#: MHA 0.932-0.933 at -0.2% to +1.6% (0.947 at +17%), fp8 656 B 0.853-0.868 at +0.6-2.7% (0.874 at +14%).
#: Those launches after a call's first are programmatic dependent launches (pdl, sm_90+: each may begin while the
#: one before drains; H100, record call 63): MHA 0.934 -> 0.945 at +0.9% -> +2.1%, MLA bf16 0.927 / 0.924.
TUNING = KernelTuning(
    backup=Tuning(programs=8, num_warps=4, tile_bytes=32768, fence=True, fence_min_row_bytes=1024,
                  launch_bytes=BACKUP_LAUNCH_BYTES, pdl=True),
    load=Tuning(programs=16, num_warps=16, tile_bytes=65536),
    tma_load=TMA_LOAD_TUNING,  # per-layer loads through TMA on compute capability 9.x/10.x
    page_load=PAGE_LOAD_TUNING,  # loads of whole contiguous pages as flat words (rowcopy_pages)
    # backups of whole pages of narrow rows as flat words (rowcopy_pages.backup_reason; KERNEL's PAGES; automatic for
    # rows of <= 1152 B in pages of >= 36 KiB): H100 record call 70, MLA fp8 656 B 0.940 / -0.3% GEMM against the rows'
    # 0.858 / +1.6% in the same run (rowcopy_tuning.PAGE_BACKUP_TUNING)
    page_backup=PAGE_BACKUP_TUNING,
)


class LayerFirstKernelStrategy(RowKernelStrategy):
    """Triton zero-copy transfers for ``layer_first`` host buffers (``[L, S, row]``).

    Options: see :class:`~hicache_core.rowcopy.RowKernelStrategy` (``programs``,
    ``num_warps``, ``tile_bytes``, ``maxnreg``); defaults in :data:`TUNING`.
    """

    name = STRATEGY_NAME
    layouts = ("layer_first",)
    kernel_module = "hicache_layer_first.kernels"
    tuning = TUNING

    def layout_reason(self, spec: PoolSpec, layout: Layout) -> str | None:
        """The kernel addresses host slot ``s`` at ``s * token``: the page stride must be ``page_size * token``."""
        for seg in layout.plan(spec).segments:
            a = seg.addressing
            if a.page != spec.page_size * a.token:
                return (f"segment {seg.component!r} has page stride {a.page} != page_size*token stride "
                        f"{spec.page_size * a.token}; {self.name} addresses host slot s at s*token")
        return None

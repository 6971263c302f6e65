"""``page_first_kv_split.kernel``: the Triton zero-copy strategy of ``page_first_kv_split``.

The ``latent`` and ``rope`` parts of an MLA row that the device holds whole
form one launch group (``fuse_parts``): the kernel reads (backup) or writes
(load) each device row once and splits or joins it.  Every other segment
(MHA ``k``/``v``, a packed FP8 row, DSA extras, parts the device keeps in
separate tensors) is grouped by width.  Everything else is
:class:`hicache_core.rowcopy.RowKernelStrategy`.
"""

from __future__ import annotations

from hicache_core.rowcopy import PAGE_LOAD_TUNING, TMA_LOAD_TUNING, KernelTuning, RowKernelStrategy, Tuning

from .layout import LAYOUT

__all__ = ["KVSplitKernelStrategy", "NAME", "TUNING"]

NAME = "page_first_kv_split.kernel"

#: Launch shape per direction.  H200 sweep 2026-11-30 (benchmarks/tune_tiles.py,
#: docs/perf/tune-2026-11-30.json): a GEMM beside a backup slows by ~+11-12% at 4-8 programs
#: whatever the warps; 8 programs x 4 warps x 32 KiB move 0.68 of memcpy on MLA rows.  Loads need
#: more programs and warps in flight.  Backups take 4 warps, as the other layouts' do, since the kernel's
#: page split became a constant: on an H100 (2026-12-07, benchmarks/backup_place_probe.py) 8 warps backed fp8
#: 656-byte rows up at 0.816 with a GEMM +24.5% slower beside them, 4 warps at 0.846 and +10.8%.
TUNING = KernelTuning(
    backup=Tuning(programs=8, num_warps=4, tile_bytes=32768),
    load=Tuning(programs=16, num_warps=8, tile_bytes=32768),
    tma_load=TMA_LOAD_TUNING,  # per-layer loads through TMA on compute capability 9.x/10.x
    page_load=PAGE_LOAD_TUNING,  # loads of whole contiguous pages as flat words (rowcopy_pages)
)


class KVSplitKernelStrategy(RowKernelStrategy):
    """Zero-copy Triton transfers for ``page_first_kv_split``, sharded or not.

    Options: see :class:`~hicache_core.rowcopy.RowKernelStrategy`; ``fuse_parts=False``
    launches once per part instead of once per row.
    """

    name = NAME
    layouts = (LAYOUT.name,)
    kernel_module = "hicache_kv_split.kernels"
    tuning = TUNING
    fuse_parts = True
    entries_inner = True

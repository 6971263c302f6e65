"""``page_first_kv_split.kernel``: the Triton zero-copy strategy of ``page_first_kv_split``.

The ``latent`` and ``rope`` parts of an MLA row that the device holds whole
form one launch group (``fuse_parts``): the kernel reads (backup) or writes
(load) each device row once and splits or joins it.  Every other segment
(MHA ``k``/``v``, a packed FP8 row, DSA extras, parts the device keeps in
separate tensors) is grouped by width.  Everything else is
:class:`hicache_core.rowcopy.RowKernelStrategy`.
"""

from __future__ import annotations

from hicache_core.rowcopy import (BACKUP_LAUNCH_BYTES, PAGE_LOAD_TUNING, TMA_LOAD_TUNING, KernelTuning,
                                  RowKernelStrategy, Tuning)

from .layout import LAYOUT

__all__ = ["KVSplitKernelStrategy", "NAME", "TUNING"]

NAME = "page_first_kv_split.kernel"

#: Launch shape per direction.  Backups take 4 warps, as the other layouts' do: on an H100 (2026-12-07,
#: benchmarks/backup_place_probe.py, 8 and 4 warps alternating in one process; docs/perf/runs.md, record calls 41-46)
#: all-layer backups of fp8 656-byte rows ran 0.755-0.810 with a GEMM beside them +18-32% slower at 8 warps,
#: 0.826-0.851 at +7-10% at 4; MLA bf16 0.924-0.928 at +33-52% against 0.935-0.944 at +11-12%; MHA at +96-98%
#: against +69-77%.  (The H200 sweep of 2026-11-30, before the page split became a constant, had seen ~+11-12%
#: at 4-8 programs whatever the warps: docs/perf/tune-toolkit-*-2026-11-30.json.)  Loads need more programs
#: and warps in flight.  Backups of rows of >= 2 KiB (both parts) wait for each tile's writes (fence,
#: kernel_lib.tile_done): on an H100 (2026-12-07, benchmarks/backup_place_probe.py, docs/perf/runs.md) all-layer
#: backups of MHA 2048-byte rows ran 0.946 with a GEMM beside them +21% (unfenced: 0.949 at +71%); MLA bf16 rows
#: fenced ran 0.849 at +12% against 0.939 at +13%, fp8 rows 15-30 points slower, so MLA rows stay unfenced.  A call
#: moving more than BACKUP_LAUNCH_BYTES goes out in launches of every layer of a run of tokens (H100, record call 59):
#: MLA bf16 0.924 at +1.1% (one launch 0.946 at +12%), at 32768 tokens 0.928 at -1.4% (0.950 at +15%), MHA 0.923 at
#: +0.7% (0.946 at +14%), fp8 576 B 0.876 at +2.4% (0.920 at +8%).
#: Those launches after a call's first are programmatic dependent launches (pdl, sm_90+: each may begin while the
#: one before drains; H100, record call 63): the other layouts' MHA rows 0.925-0.934 -> 0.940-0.945 at +1-2%.
TUNING = KernelTuning(
    backup=Tuning(programs=8, num_warps=4, tile_bytes=32768, fence=True, fence_min_row_bytes=2048,
                  launch_bytes=BACKUP_LAUNCH_BYTES, pdl=True),
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

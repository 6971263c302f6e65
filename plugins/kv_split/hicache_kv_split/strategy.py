"""Host wrapper of the ``page_first_kv_split`` Triton kernel: checks once, then launches.

``prepare`` turns the pool's bound segments into *row groups*: the ``latent``
and ``rope`` segments of an MLA row that the device holds whole become one
group, so the kernel reads (backup) or writes (load) each device row once and
splits or joins it; every other segment (MHA ``k``/``v``, a packed FP8 row,
DSA extras, parts the device keeps in separate tensors) is a group of its own.
Every table a transfer needs (offsets, strides, entry positions for all layers
and for each owned layer) is built there, on the pool's device, so a transfer
copies no table and loops over no layer: one launch per group.
"""

from __future__ import annotations

import logging
import math
from typing import Any
from dataclasses import dataclass

import torch

from hicache_core import DirectionalStrategy, Layout, PoolBinding, PoolSpec
from hicache_core.kernel_support import (
    SegmentTable,
    access_word,
    on_pool_device,
    transfer_indices,
    kernel_unsupported_reason,
    require_pinned,
    segment_tables,
    Budget,
    sm_budgets,
)

from .layout import LAYOUT

__all__ = ["KVSplitKernelStrategy", "RowGroup", "BACKUP_PROGRAMS", "LOAD_PROGRAMS", "NAME"]

logger = logging.getLogger(__name__)

NAME = "page_first_kv_split.kernel"

#: Default SM budget of a backup launch (programs of the persistent grid).  H200 2026-11-29
#: (docs/performance.md): 0.93-0.95 of memcpy at 8 programs for page sizes >= 16, as at 16 or
#: 132.  Override per strategy (``programs=``, both directions) or per process
#: (``HICACHE_KERNEL_PROGRAMS``).
BACKUP_PROGRAMS = 8
#: Default SM budget of a load launch: latency-bound reads of host memory; 16 programs move
#: 0.88 of memcpy on 37.7 MB/layer MLA loads against 0.56-0.60 at 8.
LOAD_PROGRAMS = 16
#: Words moved per program per inner step (TOKENS x BLOCK).
#: H200 sweep 2026-11-29 (benchmarks/tune_tiles.py, docs/performance.md): 4.7 MB load_layer at 16 programs:
#: 2048 words/4 warps 0.50, 4096/8 warps 0.73, 8192/8 warps 0.64; backup 0.95 throughout.
STEP_WORDS = 4096
#: Widest column block (words); longer rows loop.
MAX_BLOCK = 512
#: Warps per program (same sweep).
NUM_WARPS = 8

_SCRATCH = "kv_split.kernel"


@dataclass(frozen=True)
class RowGroup:
    """One kernel launch's worth of segments: a device row split over one or two host buffers.

    Offsets and strides are in ``word``-byte words relative to ``anchor``.
    ``split`` words go to buffer ``a``; ``row - split`` words to buffer ``b``
    (``split == row``: one buffer, ``host_off_b``/``page_b`` unused).
    """

    names: tuple[str, ...]
    word: int
    anchor: torch.Tensor
    dev_off: torch.Tensor
    dev_stride: torch.Tensor
    host_off_a: torch.Tensor
    host_off_b: torch.Tensor
    page_a: int
    page_b: int
    row: int
    split: int
    rows: int
    vec: int
    block: int
    tokens: int
    entries_all: torch.Tensor
    entries_by_layer: dict[int, torch.Tensor]
    keys: dict[bool, tuple]  # to_host -> static launch key (hicache_core.launch.Launcher)

    def entries(self, layer: int | None) -> torch.Tensor | None:
        """Entry positions a transfer of ``layer`` (``None``: all) moves, or ``None`` when none."""
        if layer is None:
            return self.entries_all if self.entries_all.numel() else None
        return self.entries_by_layer.get(layer)


@dataclass(frozen=True)
class _Prepared:
    groups: tuple[RowGroup, ...]
    programs: Budget
    capacity: int
    page_size: int
    launch: Any  # hicache_kv_split.kernels.launch_kv_split (imported at prepare: no Triton import at registration)
    dynamic: tuple[int, ...]  # its per-call argument positions


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fusable(a: SegmentTable, b: SegmentTable) -> bool:
    """Whether ``b`` is the part right after ``a`` in the same device rows."""
    sa, sb = a.segment, b.segment
    if sa.segment.component != sb.segment.component or sa.segment.part is None or sb.segment.part is None:
        return False
    if not sa.device_layers or sa.device_layers != sb.device_layers or sa.dev_strides != sb.dev_strides:
        return False
    return all(pb == pa + sa.width for pa, pb in zip(sa.dev_ptrs, sb.dev_ptrs))


class KVSplitKernelStrategy(DirectionalStrategy):
    """Zero-copy Triton transfers for ``page_first_kv_split``, sharded or not.

    :param programs: SM budget (programs of the persistent grid) of both directions.
        An explicit value wins; otherwise ``HICACHE_KERNEL_PROGRAMS``, else
        :data:`BACKUP_PROGRAMS` for backups and :data:`LOAD_PROGRAMS` for loads.
    :param fuse_parts: read/write an MLA row split into ``latent``/``rope`` in one
        launch (default); ``False`` launches once per segment.
    """

    def __init__(self, programs: int | None = None, *, fuse_parts: bool = True) -> None:
        if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
            raise ValueError(f"programs must be a positive int (the SM budget), got {programs!r}")
        self.programs = programs
        self.fuse_parts = fuse_parts

    # -- resolution ----------------------------------------------------------
    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        """``None`` when the kernel can run here and ``layout`` is ``page_first_kv_split``."""
        why = kernel_unsupported_reason(spec)
        if why:
            return why
        if layout.name != LAYOUT.name:
            return f"{NAME} serves layout {LAYOUT.name!r} only, not {layout.name!r}"
        for seg in layout.plan(spec).segments:
            a = seg.addressing
            if a.chunk_bytes != seg.width or a.token != seg.width or not a.row_contiguous:
                return (f"segment {seg.buffer!r} is not stored as whole contiguous rows "
                        f"(token stride {a.token}, chunk {a.chunk_bytes} of {seg.width} bytes)")
        return None

    # -- set-up ----------------------------------------------------------------
    def prepare(self, binding: PoolBinding) -> None:
        """Build the row groups and launch parameters once per pool."""
        require_pinned(binding, NAME)
        tables = segment_tables(binding)
        groups: list[RowGroup] = []
        i = 0
        while i < len(tables):
            if self.fuse_parts and i + 1 < len(tables) and _fusable(tables[i], tables[i + 1]):
                a, b = tables[i], tables[i + 1]
                if a.word != b.word:
                    narrow = segment_tables(binding, max_word=min(a.word, b.word))
                    a, b = narrow[i], narrow[i + 1]
                groups.append(self._group(binding, a, b))
                i += 2
            else:
                groups.append(self._group(binding, tables[i], None))
                i += 1
        programs = sm_budgets(self.programs, binding.device, backup=BACKUP_PROGRAMS, load=LOAD_PROGRAMS)
        from .kernels import DYNAMIC_ARGS, launch_kv_split

        binding.scratch[_SCRATCH] = _Prepared(tuple(groups), programs, binding.spec.capacity, binding.spec.page_size,
                                              launch_kv_split, DYNAMIC_ARGS)
        logger.debug("%s: %d launch group(s) %s, programs %s", NAME, len(groups),
                     [g.names for g in groups], programs)

    def _group(self, binding: PoolBinding, a: SegmentTable, b: SegmentTable | None) -> RowGroup:
        device = binding.device
        seg = a.segment
        word = a.word
        if b is None:
            host_off_b, page_b, row = a.host_off, a.page, a.width
        else:
            delta_bytes = b.anchor.data_ptr() - a.anchor.data_ptr()
            host_off_b, page_b, row = b.host_off + delta_bytes // word, b.page, a.width + b.width
        vec = self._vec(a, b, word, row)
        block = min(_next_pow2(row), MAX_BLOCK)
        tokens = max(1, min(_next_pow2(binding.spec.page_size), STEP_WORDS // block))
        by_layer: dict[int, torch.Tensor] = {}
        for d in set(seg.device_layers):
            by_layer[d] = torch.tensor(seg.entries(d), dtype=torch.int64, device=device)
        names = (seg.segment.buffer,) if b is None else (seg.segment.buffer, b.segment.segment.buffer)
        rows = min(a.rows, b.rows) if b is not None else a.rows
        spec = binding.spec
        from .kernels import DYNAMIC_ARGS, launch_kv_split

        keys = {to_host: launch_kv_split.static_key((
            a.anchor, None, None, None, a.dev_off, a.dev_stride, a.host_off, host_off_b, None, None, None,
            rows, spec.capacity, a.page, page_b, spec.page_size, row, a.width, tokens, block, vec, to_host,
        ), DYNAMIC_ARGS) for to_host in (True, False)}
        return RowGroup(
            names=names, word=word, anchor=a.anchor, dev_off=a.dev_off, dev_stride=a.dev_stride,
            host_off_a=a.host_off, host_off_b=host_off_b, page_a=a.page, page_b=page_b,
            row=row, split=a.width, rows=rows, vec=vec, block=block, tokens=tokens,
            entries_all=torch.arange(len(seg.device_layers), dtype=torch.int64, device=device),
            entries_by_layer=by_layer, keys=keys,
        )

    @staticmethod
    def _vec(a: SegmentTable, b: SegmentTable | None, word: int, row: int) -> int:
        """Words per 16-byte access when every row base is 16-byte aligned, else 1."""
        if word != 8:
            return 1
        quantities = [a.anchor.data_ptr(), row * word, a.width * word, a.page * word]
        quantities += [int(x) * word for x in a.dev_off.tolist() + a.dev_stride.tolist() + a.host_off.tolist()]
        if b is not None:
            quantities += [b.width * word, b.page * word, b.anchor.data_ptr()]
            quantities += [int(x) * word for x in b.host_off.tolist()]
        return 16 // word if access_word(*quantities, max_word=16) == 16 else 1

    # -- transfers ---------------------------------------------------------------
    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        prep: _Prepared = binding.scratch[_SCRATCH]
        n = int(host_indices.numel())
        if n == 0:
            return
        h, d = transfer_indices(binding, host_indices, device_indices)
        with on_pool_device(binding.device):
            self._launch(prep, h, d, n, math.ceil(n / prep.page_size), layer, to_host)

    @staticmethod
    def _launch(prep: "_Prepared", h: torch.Tensor, d: torch.Tensor, n: int, pages: int, layer: int | None,
                to_host: bool) -> None:
        for g in prep.groups:
            ent = g.entries(layer)
            if ent is None:
                continue
            items = pages * ent.numel()
            prep.launch(min(prep.programs.for_direction(to_host), items), (
                g.anchor, h, d, ent, g.dev_off, g.dev_stride, g.host_off_a, g.host_off_b,
                n, ent.numel(), items, g.rows, prep.capacity, g.page_a, g.page_b,
                prep.page_size, g.row, g.split, g.tokens, g.block, g.vec, to_host,  # PS ROW SPLIT TOKENS BLOCK VEC TO_HOST
            ), num_warps=NUM_WARPS, static_key=g.keys[to_host], dynamic=prep.dynamic)

"""Host wrappers of the page-major Triton kernel: ``page_first.kernel`` and ``page_first_direct.kernel``.

Both strategies check, then launch one kernel per bound segment per transfer
(every selected layer in that one launch).  Everything a launch needs —
offset tables on the device, entry positions of each device layer, tile
shape, alignment hint, SM budget — is built once in :meth:`prepare`; a
transfer only places the index tensors and launches.

They differ in how work is grouped (see :func:`work_plan`):

* ``page_first`` (``[S, L, row]``): a work item is a tile of tokens times a
  group of consecutive layers, layers innermost, so one program fills a
  token's contiguous all-layer block.  All owned layers form one group when
  there are at least as many token tiles as programs; smaller batches split
  the layers into groups so every program gets work.
* ``page_first_direct`` (``[P, L, page_size, row]``): a work item is one page
  (several pages when pages are smaller than a tile) of one layer — one
  contiguous host block.

Kernels are imported on first :meth:`prepare`, so ``supports`` works (and
explains itself) where Triton is missing.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from hicache_core import DirectionalStrategy, Layout, PoolBinding, PoolSpec
from hicache_core.errors import HostBufferError
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

__all__ = ["PageFirstKernelStrategy", "PageFirstDirectKernelStrategy", "WorkPlan", "work_plan",
           "DEFAULT_BACKUP_PROGRAMS", "DEFAULT_LOAD_PROGRAMS"]

logger = logging.getLogger(__name__)

#: Programs of a backup launch when no budget is given (``HICACHE_KERNEL_PROGRAMS`` overrides
#: both defaults).  H200 2026-11-29 (docs/performance.md): backups are link-bound at 8 programs,
#: 0.91-0.95 of memcpy for MLA and MHA, within 0.01 of 16 programs.
DEFAULT_BACKUP_PROGRAMS = 8
#: Programs of a load launch: reads of host memory are latency-bound; at 16 programs large MLA
#: loads reach 0.83-0.89 of memcpy against 0.64-0.77 at 8 (37.7 MB/layer).
DEFAULT_LOAD_PROGRAMS = 16

#: Largest alignment (bytes) the kernel is told about through ``tl.multiple_of``.
MAX_VECTOR_BYTES = 16


@dataclass(frozen=True)
class WorkPlan:
    """How one launch splits its work.

    :param grid: programs launched (<= the SM budget, <= work items).
    :param item_tokens: index positions per work item.
    :param ent_group: consecutive layer entries per work item.
    """

    grid: int
    item_tokens: int
    ent_group: int


def work_plan(n: int, n_ent: int, *, tile_rows: int, page_size: int, programs: int, per_page: bool) -> WorkPlan:
    """Split ``n`` index positions x ``n_ent`` layer entries into work items.

    ``per_page`` (``page_first_direct``): items are whole pages (or as many whole
    pages as fit a tile) of one entry.  Otherwise (``page_first``): items are
    ``tile_rows`` tokens of a group of entries, all entries in one group unless
    that leaves programs idle.
    """
    if per_page:
        item = page_size if page_size >= tile_rows else (tile_rows // page_size) * page_size
        group = 1
    else:
        item = tile_rows
        blocks = -(-n // item)
        groups = min(n_ent, max(1, -(-programs // blocks)))
        group = -(-n_ent // groups)
    items = -(-n // item) * -(-n_ent // group)
    return WorkPlan(grid=max(1, min(programs, items)), item_tokens=item, ent_group=group)


@dataclass(frozen=True)
class _Prepared:
    """One bound segment ready to launch."""

    table: SegmentTable
    vec: int  # alignment hint (words)
    tile_rows: int
    layer_entry: dict[int, int]  # device layer id -> entry position
    keys: dict[bool, tuple]  # to_host -> kernels.static_key(...)


@dataclass(frozen=True)
class _State:
    kernels: ModuleType
    programs: Budget
    segments: tuple[_Prepared, ...]


def _vector_words(t: SegmentTable) -> int:
    """Largest power-of-two count of words dividing every base offset, stride and the width."""
    words = [t.width, t.page, t.token, *t.dev_off.tolist(), *t.dev_stride.tolist(), *t.host_off.tolist()]
    return access_word(*(w * t.word for w in words), max_word=max(MAX_VECTOR_BYTES, t.word)) // t.word


class _PageMajorKernelStrategy(DirectionalStrategy):
    """The shared wrapper; subclasses fix the layout name and the work grouping."""

    name: ClassVar[str]
    layout_name: ClassVar[str]
    per_page: ClassVar[bool]

    def __init__(self, programs: int | None = None) -> None:
        """:param programs: SM budget (programs per launch) of both directions; ``None``:
        ``HICACHE_KERNEL_PROGRAMS``, else :data:`DEFAULT_BACKUP_PROGRAMS` / :data:`DEFAULT_LOAD_PROGRAMS`
        (capped by :func:`~hicache_core.kernel_support.sm_budget`)."""
        if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
            raise ValueError(f"programs must be a positive int (the SM budget) or None, got {programs!r}")
        self.programs = programs

    def budget(self, device: torch.device) -> Budget:
        """Programs per launch on ``device`` by direction (see :func:`~hicache_core.kernel_support.sm_budgets`)."""
        return sm_budgets(self.programs, device, backup=DEFAULT_BACKUP_PROGRAMS, load=DEFAULT_LOAD_PROGRAMS)

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        why = kernel_unsupported_reason(spec)
        if why:
            return why
        if layout.name != self.layout_name:
            return f"{self.name} serves layout {self.layout_name!r}, not {layout.name!r}"
        for seg in layout.plan(spec).segments:
            if seg.addressing.chunk_bytes != seg.width:
                return (f"segment {seg.buffer!r} stores rows in {seg.addressing.chunk_bytes}-byte chunks; "
                        f"{self.name} moves whole contiguous rows only")
        return None

    def prepare(self, binding: PoolBinding) -> None:
        require_pinned(binding, self.name)
        kernels = importlib.import_module("hicache_page_first.kernels")
        prepared = []
        for t in segment_tables(binding):
            if t.chunk != t.width:
                raise HostBufferError(
                    f"{self.name}: segment {t.segment.segment.buffer!r} splits rows into chunks of {t.chunk} words; "
                    "this kernel moves whole rows — use io_backend 'direct'"
                )
            rows, _ = kernels.tile_shape(t.width, t.word)
            entries = {d: e for e, d in enumerate(t.segment.device_layers)}
            vec = _vector_words(t)
            spec = binding.spec
            keys = {to_host: kernels.static_key(
                t.anchor, t.dev_off, t.dev_stride, t.host_off, page_size=spec.page_size, host_page=t.page,
                host_token=t.token, capacity=spec.capacity, dev_rows=t.rows, width=t.width, word=t.word, vec=vec,
                to_host=to_host) for to_host in (True, False)}
            prepared.append(_Prepared(t, vec, rows, entries, keys))
        state = _State(kernels, self.budget(binding.device), tuple(prepared))
        binding.scratch[self.name] = state
        logger.debug("%s: %d segments, programs %s, words %s", self.name, len(prepared), state.programs,
                     [p.table.word for p in prepared])

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        n = host_indices.numel()
        if n == 0:
            return
        state: _State = binding.scratch[self.name]
        h, d = transfer_indices(binding, host_indices, device_indices)
        with on_pool_device(binding.device):
            self._launch_all(state, binding.spec, h, d, n, layer, to_host)

    def _launch_all(self, state: _State, spec: PoolSpec, h: torch.Tensor, d: torch.Tensor, n: int,
                    layer: int | None, to_host: bool) -> None:
        for p in state.segments:
            t = p.table
            if layer is None:
                ent0, n_ent = 0, len(p.layer_entry)
            elif layer in p.layer_entry:
                ent0, n_ent = p.layer_entry[layer], 1
            else:
                continue
            if n_ent == 0:
                continue
            plan = work_plan(n, n_ent, tile_rows=p.tile_rows, page_size=spec.page_size,
                             programs=state.programs.for_direction(to_host), per_page=self.per_page)
            state.kernels.launch(
                plan.grid, t.anchor, h, d, t.dev_off, t.dev_stride, t.host_off,
                n=n, ent0=ent0, n_ent=n_ent, ent_group=plan.ent_group, item_tokens=plan.item_tokens,
                page_size=spec.page_size, host_page=t.page, host_token=t.token, capacity=spec.capacity,
                dev_rows=t.rows, width=t.width, word=t.word, vec=p.vec, to_host=to_host, key=p.keys[to_host],
            )


class PageFirstKernelStrategy(_PageMajorKernelStrategy):
    """``page_first`` (``[S, L, row]``) through the page-major Triton kernel; tokens outer, layers inner."""

    name = "page_first.kernel"
    layout_name = "page_first"
    per_page = False


class PageFirstDirectKernelStrategy(_PageMajorKernelStrategy):
    """``page_first_direct`` (``[P, L, page_size, row]``) through the page-major Triton kernel; (page, layer) items."""

    name = "page_first_direct.kernel"
    layout_name = "page_first_direct"
    per_page = True

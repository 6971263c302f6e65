"""``layer_first.kernel``: the Triton zero-copy strategy of the ``layer_first`` layout.

:meth:`LayerFirstKernelStrategy.prepare` builds everything a transfer needs
once per pool: the word-offset tables of :func:`hicache_core.kernel_support.segment_tables`,
merged into *groups* of segments that share the access word and the row width
(MHA ``k`` and ``v`` of equal head dims are one group), and per group the
device tensors of entry positions for "all owned layers" and for each owned
device layer.  A transfer then moves the index tensors to the device (when
they are not there already) and launches one kernel per group: no table is
copied and no Python loop runs over layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hicache_core import DirectionalStrategy, Layout, PoolBinding, PoolSpec, SpecError
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

from . import kernels

__all__ = ["LayerFirstKernelStrategy", "STRATEGY_NAME"]

logger = logging.getLogger(__name__)

STRATEGY_NAME = "layer_first.kernel"


@dataclass(frozen=True)
class Entries:
    """Entry positions (an int64 tensor on the pool's device) and how many there are."""

    positions: torch.Tensor
    count: int


@dataclass(frozen=True)
class Group:
    """Segments sharing access word and row width, copied by one launch.

    Table rows are entries (one per segment and owned device layer); offsets
    are words from ``anchor``.  ``host_tok[e]`` is the host token stride of
    entry ``e``'s segment (a segment holding one part of a row still steps by
    the whole row).
    """

    anchor: torch.Tensor
    word: int
    width: int
    vec: int
    dev_off: torch.Tensor
    dev_stride: torch.Tensor
    host_off: torch.Tensor
    host_tok: torch.Tensor
    rows: int
    all_layers: Entries | None
    per_layer: dict[int, Entries]
    plans: dict[bool, kernels.LaunchPlan]  # by to_host


@dataclass(frozen=True)
class Prepared:
    """What :meth:`LayerFirstKernelStrategy.prepare` leaves in ``binding.scratch``."""

    groups: tuple[Group, ...]
    programs: Budget
    capacity: int


def _layout_reason(spec: PoolSpec, layout: Layout) -> str | None:
    """Why ``layout``'s plan for ``spec`` is not the ``[L, S, row]`` shape this kernel addresses, if it is not."""
    for seg in layout.plan(spec).segments:
        a = seg.addressing
        if a.chunk_bytes != seg.width or not a.row_contiguous:
            return (f"segment {seg.component!r} splits rows into {a.chunk_bytes}-byte chunks; "
                    "layer_first.kernel copies whole contiguous rows")
        if a.page != spec.page_size * a.token:
            return (f"segment {seg.component!r} has page stride {a.page} != page_size*token stride "
                    f"{spec.page_size * a.token}; layer_first.kernel addresses host slot s at s*token")
    return None


def _entries(positions: list[int], device: torch.device) -> Entries | None:
    if not positions:
        return None
    return Entries(torch.tensor(positions, dtype=torch.int64, device=device), len(positions))


def _vector_words(members: list[SegmentTable], word: int) -> int:
    """Largest VEC (VEC*word <= 16 bytes) such that every row start of the group is VEC-word aligned."""
    quantities = [members[0].anchor.data_ptr(), members[0].width * word]
    for t in members:
        seg = t.segment
        a = seg.segment.addressing
        hbase = seg.host_flat.data_ptr() + a.offset
        quantities += [*seg.dev_ptrs, *seg.dev_strides, a.token]
        quantities += [hbase + h * a.layer for h in seg.host_layers]
    return access_word(*quantities, max_word=16) // word


def _group(members: list[SegmentTable], spec: PoolSpec) -> Group:
    device = spec.device
    word, width = members[0].word, members[0].width
    anchor = members[0].anchor
    base = anchor.data_ptr()
    dev_off, dev_stride, host_off, host_tok, layers = [], [], [], [], []
    for t in members:
        shift = (t.anchor.data_ptr() - base) // word  # every anchor is word-aligned
        dev_off.append(t.dev_off + shift)
        host_off.append(t.host_off + shift)
        dev_stride.append(t.dev_stride)
        host_tok.append(torch.full((t.dev_off.numel(),), t.token, dtype=torch.int64, device=device))
        layers += list(t.segment.device_layers)
    per_layer: dict[int, Entries] = {}
    for layer in sorted(set(layers)):
        ents = _entries([i for i, d in enumerate(layers) if d == layer], device)
        if ents is not None:
            per_layer[layer] = ents
    tables = dict(anchor=anchor, dev_off=torch.cat(dev_off), dev_stride=torch.cat(dev_stride),
                  host_off=torch.cat(host_off), host_tok=torch.cat(host_tok))
    vec = _vector_words(members, word)
    rows = min((t.rows for t in members if t.dev_off.numel()), default=0)
    plans = {to_host: kernels.launch_plan(**tables, dev_rows=rows, capacity=spec.capacity, width=width, word=word,
                                          vec=vec, to_host=to_host) for to_host in (True, False)}
    return Group(
        **tables, word=word, width=width, vec=vec, rows=rows,
        all_layers=_entries(list(range(len(layers))), device), per_layer=per_layer, plans=plans,
    )


def build_groups(tables: list[SegmentTable], spec: PoolSpec) -> tuple[Group, ...]:
    """Merge segment tables sharing (word, width) into launch groups, in first-seen order."""
    by_key: dict[tuple[int, int], list[SegmentTable]] = {}
    for t in tables:
        if t.chunk != t.width or t.page != spec.page_size * t.token:
            raise SpecError(
                f"layer_first.kernel: segment {t.segment.segment.component!r} is not addressed as [L, S, row] "
                f"(chunk {t.chunk} of width {t.width} words, page stride {t.page}, token stride {t.token})"
            )
        by_key.setdefault((t.word, t.width), []).append(t)
    return tuple(_group(members, spec) for members in by_key.values())


class LayerFirstKernelStrategy(DirectionalStrategy):
    """Triton zero-copy transfers for ``layer_first`` host buffers.

    :param programs: SM budget (programs per launch) of both directions.  ``None``:
        the ``HICACHE_KERNEL_PROGRAMS`` environment variable if set, else
        :data:`~hicache_layer_first.kernels.BACKUP_PROGRAMS` for backups and
        :data:`~hicache_layer_first.kernels.LOAD_PROGRAMS` for loads.
    """

    name = STRATEGY_NAME

    def __init__(self, programs: int | None = None) -> None:
        if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
            raise ValueError(f"programs must be a positive int (the SM budget), got {programs!r}")
        self._programs = programs

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        """``None`` when a Triton kernel can run here and ``layout`` plans ``[L, S, row]`` buffers."""
        return kernel_unsupported_reason(spec) or _layout_reason(spec, layout)

    def prepare(self, binding: PoolBinding) -> None:
        """Check pinning and build the launch groups and entry tensors (once per pool)."""
        require_pinned(binding, self.name)
        spec = binding.spec
        programs = sm_budgets(self._programs, spec.device, backup=kernels.BACKUP_PROGRAMS, load=kernels.LOAD_PROGRAMS)
        groups = build_groups(segment_tables(binding), spec)
        binding.scratch[self.name] = Prepared(groups, programs, spec.capacity)
        logger.debug("%s: %d launch group(s), programs %s, widths %s words", self.name, len(groups), programs,
                     [(g.width, g.word, g.vec) for g in groups])

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        if host_indices.numel() == 0:
            return
        prep: Prepared = binding.scratch[self.name]
        h, d = transfer_indices(binding, host_indices, device_indices)
        with on_pool_device(binding.device):
            self._launch_all(prep, h, d, layer, to_host)

    @staticmethod
    def _launch_all(prep: Prepared, h: torch.Tensor, d: torch.Tensor, layer: int | None, to_host: bool) -> None:
        for g in prep.groups:
            ents = g.all_layers if layer is None else g.per_layer.get(layer)
            if ents is None:
                continue
            kernels.copy_rows(
                anchor=g.anchor, ents=ents.positions, n_ents=ents.count, host_idx=h, dev_idx=d,
                dev_off=g.dev_off, dev_stride=g.dev_stride, host_off=g.host_off, host_tok=g.host_tok,
                dev_rows=g.rows, capacity=prep.capacity, width=g.width, word=g.word, vec=g.vec,
                to_host=to_host, programs=prep.programs.for_direction(to_host), plan=g.plans[to_host],
            )

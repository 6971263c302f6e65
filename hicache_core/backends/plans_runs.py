"""Helpers of the ``direct`` backend's copy plans: the per-pool address tables runs are placed with (memoised in the
binding's scratch), what ``auto`` staging decides on besides the plain runs (a page image's sizes, whether plain runs
stay in their host page and how long they can be, whether layers share device allocations, a layer's shape), and
reads of a plan's index copies (range, page runs).

Part of the copy plans whose public face is :mod:`hicache_core.backends.plans` (every name here is importable from
there too); :class:`~hicache_core.backends.plans.Plan` looks them up there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..binding import BoundSegment, PoolBinding
from ..validate import IndexFacts, index_bounds, page_starts

if TYPE_CHECKING:
    from .staging import _Image


def _host_base(seg: BoundSegment, e: int) -> int:
    a = seg.segment.addressing
    return seg.host_flat.data_ptr() + a.offset + seg.host_layers[e] * a.layer


def _bases(binding: PoolBinding, si: int, seg: BoundSegment,
           stride: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
    """Host and device base addresses of the entries of segment ``si`` with device stride ``stride``,
    and entry -> row; they depend on the pool alone, so they are built once per pool."""
    memo = binding.scratch.setdefault("direct.bases", {})
    hit = memo.get((si, stride))
    if hit is None:
        group = [e for e in range(len(seg.device_layers)) if seg.dev_strides[e] == stride]
        hit = memo[(si, stride)] = (torch.tensor([_host_base(seg, e) for e in group], dtype=torch.int64),
                                    torch.tensor([seg.dev_ptrs[e] for e in group], dtype=torch.int64),
                                    {e: i for i, e in enumerate(group)})
    return hit


def _storages(binding: PoolBinding, si: int, seg: BoundSegment, stride: int) -> list[int]:
    """Per row of :func:`_bases`: the device allocation (torch storage) the entry's rows live in; built once per pool."""
    memo = binding.scratch.setdefault("direct.storages", {})
    hit = memo.get((si, stride))
    if hit is None:
        row = _bases(binding, si, seg, stride)[2]
        hit = memo[(si, stride)] = [0] * len(row)
        for e, r in row.items():
            hit[r] = seg.device_rows[e].untyped_storage().data_ptr()
    return hit


def _page_sizes(images: list[_Image]) -> tuple[int, int]:
    """Bytes and blocks of one page over ``images`` (a staged route's per-page copy-engine work)."""
    return sum(int(im.lens.sum()) for im in images), sum(int(im.lens.numel()) for im in images)


def _runs_stay_in_page(seg: BoundSegment, page_size: int, num_pages: int) -> bool:
    """Whether no plain run of ``seg`` can continue from one host page into another: the bytes of one
    layer's rows of a page (from its first row to the end of its last) never end where the same
    layer's rows of another page begin (a whole number of page strides away)."""
    a = seg.segment.addressing
    extent = (page_size - 1) * a.token + (a.chunks(seg.width) - 1) * (a.chunk_stride or a.chunk_bytes) + a.chunk_bytes
    if a.page == 0:
        return False
    k, rest = divmod(extent, a.page)
    return rest != 0 or not 0 < abs(k) < num_pages


def _longest_run(seg: BoundSegment, page_size: int) -> int:
    """The longest plain run of ``seg`` where runs stay in their page (:func:`_runs_stay_in_page`):
    one layer's rows of one page where they are adjacent on the host, else one row."""
    a = seg.segment.addressing
    return page_size * seg.width if a.whole_row(seg.width) and a.token == seg.width else seg.width


def _layers_share_allocations(binding: PoolBinding) -> bool:
    """Whether some segment has layers in one device allocation (memoised per pool)."""
    hit = binding.scratch.get("direct.shared_allocations")
    if hit is None:
        hit = binding.scratch["direct.shared_allocations"] = any(
            len({r.untyped_storage().data_ptr() for r in seg.device_rows}) < len(seg.device_rows)
            for seg in binding.segments)
    return bool(hit)


def _layer_shape(binding: PoolBinding, layer: int, pitched: bool) -> tuple:
    """What ``auto`` staging's decision for a one-layer selection depends on besides the plan's indices: per
    segment with entries in ``layer``, its position, its entries' device strides (their plain runs: one table row
    each) and the block sizes of its page image.  Layers of one shape get one decision per plan (memoised per pool)."""
    memo = binding.scratch.setdefault("direct.layer_shapes", {})
    key = (layer, pitched)
    hit = memo.get(key)
    if hit is None:
        from .staging import page_images

        images = {id(im.seg): im for im in page_images(binding, layer, pitched)}
        parts = []
        for si, seg in enumerate(binding.segments):
            entries = seg.entries(layer)
            if entries:
                im = images.get(id(seg))
                parts.append((si, tuple(seg.dev_strides[e] for e in entries),
                              None if im is None else tuple(im.lens.tolist())))
        hit = memo[key] = tuple(parts)
    return hit


def _within(t: torch.Tensor, n: int) -> bool:
    """Whether every value of the non-empty ``t`` lies in ``0..n-1``."""
    lo, hi = index_bounds(t)
    return lo >= 0 and hi < n


def _page_runs(h: torch.Tensor, d: torch.Tensor, ps: int, facts: IndexFacts | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """See :attr:`~hicache_core.backends.plans.Plan.page_runs` (``h``, ``d``: the plan's own int64 copies); ``facts``:
    what the pool's check of the tensors they were copied from saw of their shape (whole aligned host pages; device
    run starts or none)."""
    if ps == 1 or h.numel() == 0:
        return None
    hs: torch.Tensor | None
    if facts is not None and facts.host_starts is not None:
        hs = h.view(-1, ps)[:, 0]
    else:
        hs = page_starts(h, ps)
        if hs is None or bool((hs % ps).any()):
            return None
    if facts is not None and facts.device_read:
        ds = None if facts.device_starts is None else d.view(-1, ps)[:, 0]
    else:
        ds = page_starts(d, ps)
    if ds is None:
        return None
    return hs // ps, ds.contiguous()

"""The ``page_head`` host layout: ``[P, H, page_size, L, D]`` per MHA component.

One buffer per component (``k``, ``v``, and any extra component whose row
splits into ``head_num`` equal heads).  ``D`` is derived from the row:
``row_bytes / head_num / itemsize``, so ``v`` may have its own head dim.  A
token's row is ``H`` chunks of ``D`` items, one per head, ``page_size * L * D``
items apart.
"""

from __future__ import annotations

from hicache_core import MHA, Addressing, BufferSpec, Component, HostPlan, PoolSpec, Segment, SpecError

__all__ = ["PageHeadLayout", "LAYOUT"]


def _head_items(comp: Component, head_num: int) -> int | None:
    """Items per head of ``comp``'s row, or ``None`` when the row does not split into ``head_num`` heads."""
    per_head, rem = divmod(comp.row_bytes, head_num * comp.itemsize)
    return per_head if rem == 0 and per_head > 0 else None


class PageHeadLayout:
    name = "page_head"
    description = "[P, H, page_size, L, D] per component (MHA only); one head of one page contiguous"

    def check(self, spec: PoolSpec) -> str | None:
        if spec.kind != MHA:
            return f"page_head stores per-head rows of MHA pools only; this pool is {spec.kind!r}"
        if spec.head_num < 1:
            return f"page_head needs head_num >= 1, got {spec.head_num}"
        for comp in spec.components:
            if _head_items(comp, spec.head_num) is None:
                return (
                    f"component {comp.name!r} row of {comp.row_bytes} bytes does not split into "
                    f"{spec.head_num} heads of whole {comp.dtype} items"
                )
        return None

    def plan(self, spec: PoolSpec) -> HostPlan:
        reason = self.check(spec)
        if reason:
            raise SpecError(f"layout page_head cannot hold this pool: {reason}")
        H, ps, P = spec.head_num, spec.page_size, spec.num_pages
        buffers, segments = [], []
        for comp in spec.components:
            L = spec.component_map(comp.name).host_layer_num
            item = comp.itemsize
            D = comp.row_bytes // (H * item)  # whole, check() passed
            buffers.append(BufferSpec(comp.name, (P, H, ps, L, D), comp.dtype))
            addr = Addressing(
                offset=0,
                layer=D * item,
                page=H * ps * L * D * item,
                token=L * D * item,
                chunk_bytes=D * item,
                chunk_stride=ps * L * D * item,
            )
            segments.append(Segment(comp.name, comp.name, None, 0, comp.row_bytes, addr))
        return HostPlan(tuple(buffers), tuple(segments))


LAYOUT = PageHeadLayout()

"""Two page-major host layouts.

``page_first``: ``[S, L, row]`` per component; one token's rows of every
layer are contiguous, and so is one page of all layers (``page_size * L * row``
bytes): what a storage tier wants.

``page_first_direct``: ``[P, L, page_size, row]`` per component; one page of
one layer is contiguous (``page_size * row`` bytes): what a copy engine wants.
"""

from __future__ import annotations

from hicache_core import Addressing, BufferSpec, HostPlan, PoolSpec, Segment

__all__ = ["PageFirstLayout", "PageFirstDirectLayout", "PAGE_FIRST", "PAGE_FIRST_DIRECT"]


class PageFirstLayout:
    name = "page_first"
    description = "[S, L, row] per component; a token's rows of all layers contiguous"

    def check(self, spec: PoolSpec) -> str | None:
        return None

    def plan(self, spec: PoolSpec) -> HostPlan:
        buffers, segments = [], []
        for comp in spec.components:
            L = spec.component_map(comp.name).host_layer_num
            row = comp.row_bytes
            buffers.append(BufferSpec(comp.name, (spec.capacity, L, row // comp.itemsize), comp.dtype))
            addr = Addressing(offset=0, layer=row, page=spec.page_size * L * row, token=L * row, chunk_bytes=row)
            segments.append(Segment(comp.name, comp.name, None, 0, row, addr))
        return HostPlan(tuple(buffers), tuple(segments))


class PageFirstDirectLayout:
    name = "page_first_direct"
    description = "[P, L, page_size, row] per component; a page of one layer contiguous"

    def check(self, spec: PoolSpec) -> str | None:
        return None

    def plan(self, spec: PoolSpec) -> HostPlan:
        buffers, segments = [], []
        ps = spec.page_size
        for comp in spec.components:
            L = spec.component_map(comp.name).host_layer_num
            row = comp.row_bytes
            buffers.append(BufferSpec(comp.name, (spec.num_pages, L, ps, row // comp.itemsize), comp.dtype))
            addr = Addressing(offset=0, layer=ps * row, page=L * ps * row, token=row, chunk_bytes=row)
            segments.append(Segment(comp.name, comp.name, None, 0, row, addr))
        return HostPlan(tuple(buffers), tuple(segments))


PAGE_FIRST = PageFirstLayout()
PAGE_FIRST_DIRECT = PageFirstDirectLayout()

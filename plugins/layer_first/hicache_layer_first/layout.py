"""The ``layer_first`` host layout: one ``[L, S, row]`` buffer per component.

For MHA that is ``k`` ``[L, S, H, D]`` and ``v`` ``[L, S, H, Dv]`` (rows
flattened); for MLA ``kv`` ``[L, S, C]``.  One host layer of one component is
contiguous, so a per-layer transfer touches one dense block.  Two buffers or
one: an engine that keeps ``k`` and ``v`` in one ``[2, L, S, ...]`` tensor
passes its two halves as ``host_buffers``.
"""

from __future__ import annotations

from hicache_core import Addressing, BufferSpec, HostPlan, PoolSpec, Segment

__all__ = ["LayerFirstLayout", "LAYOUT"]


class LayerFirstLayout:
    name = "layer_first"
    description = "[L, S, row] per component; each host layer contiguous"

    def check(self, spec: PoolSpec) -> str | None:
        return None

    def plan(self, spec: PoolSpec) -> HostPlan:
        buffers, segments = [], []
        S = spec.capacity
        for comp in spec.components:
            L = spec.component_map(comp.name).host_layer_num
            row = comp.row_bytes
            buffers.append(BufferSpec(comp.name, (L, S, row // comp.itemsize), comp.dtype))
            addr = Addressing(offset=0, layer=S * row, page=spec.page_size * row, token=row, chunk_bytes=row)
            segments.append(Segment(comp.name, comp.name, None, 0, row, addr))
        return HostPlan(tuple(buffers), tuple(segments))


LAYOUT = LayerFirstLayout()

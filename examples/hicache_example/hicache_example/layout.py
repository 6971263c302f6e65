"""The ``example_packed`` layout: one host buffer ``[L, S, R]`` holding every component side by side.

``R`` is the sum of the components' row bytes; component ``c`` occupies bytes
``[off_c, off_c + row_c)`` of each ``R``-byte row.  One segment per component,
all in the same buffer, told apart by ``Addressing.offset``; together they
cover every byte of every row exactly once.
"""

from __future__ import annotations

from hicache_core import Addressing, BufferSpec, HostPlan, PoolSpec, Segment, SpecError
import torch

__all__ = ["PackedLayout", "LAYOUT", "BUFFER"]

BUFFER = "packed"


class PackedLayout:
    name = "example_packed"
    description = "[L, S, sum of row bytes] uint8, every component of a token's layer row side by side"

    def check(self, spec: PoolSpec) -> str | None:
        return None  # any pool: rows are bytes

    def plan(self, spec: PoolSpec) -> HostPlan:
        reason = self.check(spec)
        if reason:
            raise SpecError(f"layout example_packed cannot hold this pool: {reason}")
        row = sum(c.row_bytes for c in spec.components)
        # Host layer slots per component: sharded maps may pad, drafts add slots, and a component
        # present on some layers only has fewer; the buffer has room for the largest.
        layers = max(spec.component_map(c.name).host_layer_num for c in spec.components)
        segments, offset = [], 0
        for comp in spec.components:
            addr = Addressing(offset=offset, layer=spec.capacity * row, page=spec.page_size * row, token=row,
                              chunk_bytes=comp.row_bytes)
            # Segment(buffer, component, part, src_offset, width, addressing): the whole row of ``comp``.
            segments.append(Segment(BUFFER, comp.name, None, 0, comp.row_bytes, addr))
            offset += comp.row_bytes
        return HostPlan((BufferSpec(BUFFER, (layers, spec.capacity, row), torch.uint8),), tuple(segments))


LAYOUT = PackedLayout()

"""The ``page_first_kv_split`` host layout: page-major, one buffer per stored row piece.

Every component part (MLA ``latent`` and ``rope``) and every component without
parts (MHA ``k`` and ``v``, a packed FP8 MLA row, a DSA indexer key, an fp32
scale) gets its own ``[P, L_c, page_size, width]`` buffer, where ``L_c`` is the
number of host layers that piece exists on.  On backup a device row is split
into its parts; on load it is joined again.
"""

from __future__ import annotations

from hicache_core import Addressing, BufferSpec, HostPlan, PoolSpec, Segment

__all__ = ["KVSplitLayout", "LAYOUT"]


class KVSplitLayout:
    name = "page_first_kv_split"
    description = "[P, L, page_size, width] per component part; MLA latent/rope and MHA K/V apart"

    def check(self, spec: PoolSpec) -> str | None:
        return None

    def plan(self, spec: PoolSpec) -> HostPlan:
        buffers, segments = [], []
        ps = spec.page_size
        for comp in spec.components:
            L = spec.component_map(comp.name).host_layer_num
            pieces: list[tuple[str, str | None, int, int]] = [(p.name, p.name, p.offset, p.nbytes) for p in comp.parts]
            pieces = pieces or [(comp.name, None, 0, comp.row_bytes)]
            for buf, part, offset, width in pieces:
                buffers.append(BufferSpec(buf, (spec.num_pages, L, ps, width // comp.itemsize), comp.dtype))
                addr = Addressing(offset=0, layer=ps * width, page=L * ps * width, token=width, chunk_bytes=width)
                segments.append(Segment(buf, comp.name, part, offset, width, addr))
        return HostPlan(tuple(buffers), tuple(segments))


LAYOUT = KVSplitLayout()

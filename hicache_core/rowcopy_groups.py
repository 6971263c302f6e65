"""Launch groups of the row-copy kernel strategies: the per-entry word-offset tables of a pool merged into
:class:`RowGroup` s (segments of one access word and row width share a launch; with ``fuse_parts`` the two parts of a
device row, MLA ``latent`` + ``rope``, are one group whose second part goes to other host buffers).

Part of the row-copy toolkit whose public face is :mod:`hicache_core.rowcopy` (every name here is importable from
there too).  Nothing here imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .binding import PoolBinding
from .errors import HostBufferError
from .kernel_support import SegmentTable, access_word, segment_tables
from .rowcopy_tuning import MAX_VECTOR_BYTES

__all__ = ["RowGroup", "build_groups"]


@dataclass(frozen=True)
class RowGroup:
    """Segments moved by one launch, as per-entry tables (int64, on the pool's device, words from ``anchor``).

    An entry is one (segment, device layer).  ``split < width``: a fused row;
    words ``0..split-1`` of a device row go to ``host_*`` and the rest to
    ``host_*_b``.  ``layers[e]`` is entry ``e``'s device layer and ``hosts[e]``
    its segment's host buffer (flat bytes).
    """

    names: tuple[str, ...]
    anchor: torch.Tensor
    word: int
    width: int
    split: int
    vec: int
    rows: int
    tables: dict[str, torch.Tensor]  # dev_off, dev_stride, host_off, host_page, host_tok and the _b parts
    all_layers: torch.Tensor
    per_layer: dict[int, torch.Tensor]
    layers: tuple[int, ...]
    hosts: tuple[torch.Tensor, ...]

    def entries(self, layer: int | None) -> torch.Tensor | None:
        """Entry positions a transfer of ``layer`` (``None``: every owned layer) moves, or ``None``."""
        ents = self.all_layers if layer is None else self.per_layer.get(layer)
        return ents if ents is not None and ents.numel() else None


def _fusable(a: SegmentTable, b: SegmentTable) -> bool:
    """Whether ``b`` is the part right after ``a`` in the same device rows."""
    sa, sb = a.segment, b.segment
    if sa.segment.component != sb.segment.component or sa.segment.part is None or sb.segment.part is None:
        return False
    if not sa.device_layers or sa.device_layers != sb.device_layers or sa.dev_strides != sb.dev_strides:
        return False
    return all(pb == pa + sa.width for pa, pb in zip(sa.dev_ptrs, sb.dev_ptrs))


def _host_tables(t: SegmentTable, shift: int) -> dict[str, torch.Tensor]:
    n = t.dev_off.numel()
    full = lambda v: torch.full((n,), v, dtype=torch.int64, device=t.dev_off.device)  # noqa: E731
    return {"host_off": t.host_off + shift, "host_page": full(t.page), "host_tok": full(t.token)}


def _group(members: list[tuple[SegmentTable, SegmentTable | None]]) -> RowGroup:
    """One group from ``(part a, part b or None)`` members sharing word and widths."""
    a0, b0 = members[0]
    word, anchor = a0.word, a0.anchor
    base = anchor.data_ptr()
    parts: dict[str, list[torch.Tensor]] = {}
    layers: list[int] = []
    hosts: list[torch.Tensor] = []
    names: list[str] = []
    quantities = [base, a0.width * word]
    for a, b in members:
        shift = (a.anchor.data_ptr() - base) // word  # anchors are word-aligned
        cols = {"dev_off": a.dev_off + shift, "dev_stride": a.dev_stride, **_host_tables(a, shift)}
        bt = _host_tables(b, (b.anchor.data_ptr() - base) // word) if b is not None else _host_tables(a, shift)
        cols.update({k + "_b": v for k, v in bt.items()})
        for k, v in cols.items():
            parts.setdefault(k, []).append(v)
            quantities += [int(x) * word for x in v.tolist()]
        layers += list(a.segment.device_layers)
        hosts += [a.segment.host_flat] * len(a.segment.device_layers)
        names += [a.segment.segment.buffer] + ([b.segment.segment.buffer] if b is not None else [])
    width = a0.width + (b0.width if b0 is not None else 0)
    quantities.append(width * word)
    vec = access_word(*quantities, max_word=max(MAX_VECTOR_BYTES, word)) // word
    device = a0.dev_off.device
    per_layer = {d: torch.tensor([i for i, x in enumerate(layers) if x == d], dtype=torch.int64, device=device)
                 for d in sorted(set(layers))}
    # device rows every member with device layers here has (a member holding no layer of this rank, e.g. a component
    # of other layers on a sharded rank, moves nothing and bounds nothing: its 0 rows would mask the whole group)
    rows = min((min(a.rows, b.rows if b is not None else a.rows) for a, b in members if a.segment.device_layers),
               default=0)
    return RowGroup(names=tuple(names), anchor=anchor, word=word, width=width, split=a0.width, vec=vec, rows=rows,
                    tables={k: torch.cat(v) for k, v in parts.items()},
                    all_layers=torch.arange(len(layers), dtype=torch.int64, device=device), per_layer=per_layer,
                    layers=tuple(layers), hosts=tuple(hosts))


def build_groups(binding: PoolBinding, *, fuse_parts: bool, strategy: str) -> tuple[RowGroup, ...]:
    """The launch groups of ``binding``: fused part pairs (when ``fuse_parts``), then other segments
    merged by (access word, width), in first-seen order.

    :raises HostBufferError: a segment whose rows are not whole and contiguous in host memory.
    """
    tables = segment_tables(binding)
    for t in tables:
        if t.chunk != t.width:
            raise HostBufferError(
                f"{strategy}: segment {t.segment.segment.buffer!r} splits rows into chunks of {t.chunk} words; "
                "this kernel moves whole rows, use io_backend 'direct'")
    members: dict[tuple, list[tuple[SegmentTable, SegmentTable | None]]] = {}
    i = 0
    while i < len(tables):
        a = tables[i]
        if fuse_parts and i + 1 < len(tables) and _fusable(a, tables[i + 1]):
            b = tables[i + 1]
            if a.word != b.word:  # one access word for the whole row
                narrow = segment_tables(binding, max_word=min(a.word, b.word))
                a, b = narrow[i], narrow[i + 1]
            members.setdefault(("fused", i), []).append((a, b))
            i += 2
            continue
        members.setdefault((a.word, a.width), []).append((a, None))
        i += 1
    return tuple(_group(m) for m in members.values())

"""Layout descriptors: how host buffers are shaped and where each row lives.

A layout never moves bytes.  It answers two questions for a :class:`PoolSpec`:
which host buffers to allocate (:class:`BufferSpec`), and where the bytes of
(host layer ``h``, token slot ``s``) of each row segment live
(:class:`Addressing`, strides in bytes).  Generic backends serve any layout
from these answers alone; kernel strategies may specialise on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch

from .errors import SpecError
from .spec import PoolSpec, as_int

__all__ = ["Addressing", "Segment", "BufferSpec", "HostPlan", "Layout", "strided_host_view", "page_blocks", "strided_reach"]


@dataclass(frozen=True)
class Addressing:
    """Byte address of a row segment inside its host buffer.

    Chunk ``c`` of the segment for (host layer ``h``, slot ``s``) starts at::

        offset + h*layer + (s // page_size)*page + (s % page_size)*token + c*chunk_stride

    and holds ``chunk_bytes`` contiguous bytes.  A contiguous row has one chunk
    (``chunk_bytes`` = segment width).  Layouts that interleave heads (e.g.
    ``[P, H, page, L, D]``) split a row into ``width // chunk_bytes`` chunks.
    """

    offset: int
    layer: int
    page: int
    token: int
    chunk_bytes: int
    chunk_stride: int = 0

    def __post_init__(self) -> None:
        # whole numbers (NumPy ints are taken as ints): a float or a bool would reach as_strided and the kernels'
        # offset tables as something else; strides may be negative (the views check the bytes they reach)
        for name in ("offset", "layer", "page", "token", "chunk_bytes", "chunk_stride"):
            object.__setattr__(self, name, as_int(getattr(self, name), f"Addressing {name}"))
        if self.chunk_bytes < 1:
            raise SpecError(f"Addressing chunk_bytes={self.chunk_bytes} must be >= 1 (the bytes of one contiguous "
                            "chunk; a contiguous row has one chunk of the segment's width); fix the layout's plan")

    def chunks(self, width: int) -> int:
        return width // self.chunk_bytes

    @property
    def row_contiguous(self) -> bool:
        """Whether consecutive chunks follow each other (``chunk_stride`` 0 or ``chunk_bytes``)."""
        return self.chunk_stride in (0, self.chunk_bytes)

    def whole_row(self, width: int) -> bool:
        """Whether a row of ``width`` bytes is one contiguous block on the host: a single chunk (whatever
        ``chunk_stride``: it is never stepped) or chunks that follow each other."""
        return self.chunk_bytes == width or self.row_contiguous


@dataclass(frozen=True)
class Segment:
    """A byte range of a component row stored in one host buffer.

    :param buffer: host buffer name (a key of the host buffer mapping).
    :param component: source component name in the pool spec.
    :param part: the component part this segment holds, if it is one part
        (device pools that keep the part in its own tensor are then served).
    :param src_offset: byte offset of the segment in the component row.
    :param width: segment bytes per row.
    :param addressing: where the segment lives in ``buffer``.
    """

    buffer: str
    component: str
    part: str | None
    src_offset: int
    width: int
    addressing: Addressing

    def __post_init__(self) -> None:
        for name in ("buffer", "component"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                what = "BufferSpec" if name == "buffer" else "component"
                raise SpecError(f"Segment {name} must be a non-empty str (a {what} name), got {type(value).__name__} "
                                f"{value!r}; fix the layout's plan")
        if self.part is not None and (not isinstance(self.part, str) or not self.part):
            raise SpecError(f"Segment part must be a part name or None, got {type(self.part).__name__} {self.part!r}; "
                            "fix the layout's plan")
        object.__setattr__(self, "src_offset", as_int(self.src_offset, f"Segment {self.component!r} src_offset"))
        object.__setattr__(self, "width", as_int(self.width, f"Segment {self.component!r} width"))
        if self.src_offset < 0:
            raise SpecError(f"segment of {self.component!r}: src_offset={self.src_offset} must be >= 0 (a byte offset in "
                            "the component row); fix the layout's plan")
        if self.width < 1:
            raise SpecError(f"segment of {self.component!r}: width={self.width} must be >= 1 (the row bytes the segment "
                            "holds); fix the layout's plan")
        if not isinstance(self.addressing, Addressing):
            raise SpecError(f"segment of {self.component!r}: addressing must be an Addressing, got "
                            f"{type(self.addressing).__name__} {self.addressing!r}")


@dataclass(frozen=True)
class BufferSpec:
    """A host buffer to allocate: name, shape and dtype (C-contiguous)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"BufferSpec name must be a non-empty str, got {type(self.name).__name__} {self.name!r}")
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Iterable):
            raise SpecError(f"host buffer {self.name!r}: shape must be a tuple of ints, got "
                            f"{type(self.shape).__name__} {self.shape!r}; pass e.g. (layers, slots, row_bytes)")
        shape = tuple(as_int(d, f"host buffer {self.name!r} shape entry") for d in self.shape)
        if any(d < 0 for d in shape):  # 0 is fine: a component on none of this rank's layers
            raise SpecError(f"host buffer {self.name!r}: shape {shape} has a negative dimension; fix the layout's plan")
        object.__setattr__(self, "shape", shape)  # a list compares unequal to the tuple of a tensor's shape
        if not isinstance(self.dtype, torch.dtype):
            raise SpecError(f"host buffer {self.name!r}: dtype must be a torch.dtype (e.g. torch.uint8), got "
                            f"{type(self.dtype).__name__} {self.dtype!r}")

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class HostPlan:
    """Everything a layout decides for a spec: buffers and row segments."""

    buffers: tuple[BufferSpec, ...]
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        for name, kind in (("buffers", BufferSpec), ("segments", Segment)):
            value = getattr(self, name)
            items = tuple(value) if isinstance(value, (tuple, list)) else None
            if items is None or not all(isinstance(x, kind) for x in items):
                raise SpecError(f"HostPlan {name} must be a tuple of {kind.__name__}, got {value!r}; fix the layout's "
                                "plan")
            object.__setattr__(self, name, items)
        names = [b.name for b in self.buffers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # one would silently replace the other when the pool allocates them by name
            raise SpecError(f"HostPlan plans host buffers {twice} more than once; give each BufferSpec its own name")
        unplanned = sorted({s.buffer for s in self.segments} - set(names))
        if unplanned:
            raise SpecError(f"HostPlan segments live in host buffers {unplanned} that it does not plan (buffers: "
                            f"{names}); add a BufferSpec for each or fix the segments' buffer names")


@runtime_checkable
class Layout(Protocol):
    """Contract of a host layout descriptor.

    ``name`` is the registry key.  ``check`` returns ``None`` when the layout can
    hold ``spec`` or a one-line reason when it cannot.  ``plan`` is called once per
    pool; its segments must cover every byte of every owned row exactly once,
    and no two segments may overlap in host memory.
    """

    name: str
    description: str

    def check(self, spec: PoolSpec) -> str | None: ...

    def plan(self, spec: PoolSpec) -> HostPlan: ...


def strided_host_view(flat: torch.Tensor, seg: Segment, spec: PoolSpec, host_layers: int) -> torch.Tensor:
    """A ``[host_layers, pages, page_size, chunks, chunk_bytes]`` uint8 view of ``seg`` in ``flat``.

    ``flat`` is the whole host buffer as a flat uint8 tensor.
    """
    a = seg.addressing
    row = spec.component(seg.component).row_bytes
    if seg.src_offset < 0 or seg.src_offset + seg.width > row:  # past the row: device rows would be cut short
        raise SpecError(f"segment of {seg.component!r} in host buffer {seg.buffer!r} holds row bytes "
                        f"{seg.src_offset}..{seg.src_offset + seg.width - 1}, but the component's rows are {row} B; "
                        "fix the layout's plan")
    if a.chunk_bytes <= 0 or seg.width % a.chunk_bytes:
        raise SpecError(f"segment of {seg.component!r} in host buffer {seg.buffer!r}: its width ({seg.width} B) is not a "
                        f"positive multiple of its chunk_bytes ({a.chunk_bytes} B); fix the layout's plan")
    shape = (host_layers, spec.num_pages, spec.page_size, a.chunks(seg.width), a.chunk_bytes)
    stride = (a.layer, a.page, a.token, a.chunk_stride or a.chunk_bytes, 1)
    # the lowest and highest byte the segment reaches must lie in its own buffer (as_strided checks only the whole
    # storage, which may hold other buffers after this one)
    lo, hi = (a.offset + r for r in strided_reach(shape, stride))
    if all(shape) and (lo < 0 or hi > flat.numel()):  # an empty view (no host layer of it here) reaches no byte
        raise SpecError(f"segment of {seg.component!r} reaches bytes {lo}..{hi - 1} of host buffer {seg.buffer!r}, "
                        f"which holds {flat.numel()} B; fix the layout's plan (it addresses {host_layers} host layers "
                        f"of {spec.num_pages} pages of {spec.page_size} slots: size the buffer and the strides by "
                        f"spec.component_map({seg.component!r}).host_layer_num and spec.capacity)")
    return flat.as_strided(shape, stride, flat.storage_offset() + a.offset)


def strided_reach(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, int]:
    """The elements ``[lo, hi)`` a non-empty strided view of ``shape`` and ``stride`` reaches, relative to its first
    element (``lo <= 0`` where a stride is negative)."""
    lo = sum(min(0, (n - 1) * st) for n, st in zip(shape, stride))
    return lo, sum(max(0, (n - 1) * st) for n, st in zip(shape, stride)) + 1


def page_blocks(seg: Segment, spec: PoolSpec, host_layers: int) -> list[tuple[int, int]]:
    """Contiguous ``(byte offset, nbytes)`` blocks of page 0 of ``seg``, merged and sorted.

    Page ``p``'s blocks are the same shifted by ``p * addressing.page``.
    Storage tiers use this for per-page pointer + length lists.
    """
    a = seg.addressing
    starts = sorted(
        a.offset + h * a.layer + t * a.token + c * (a.chunk_stride or a.chunk_bytes)
        for h in range(host_layers)
        for t in range(spec.page_size)
        for c in range(a.chunks(seg.width))
    )
    blocks: list[tuple[int, int]] = []
    for s in starts:
        if blocks and blocks[-1][0] + blocks[-1][1] == s:
            blocks[-1] = (blocks[-1][0], blocks[-1][1] + a.chunk_bytes)
        else:
            blocks.append((s, a.chunk_bytes))
    return blocks

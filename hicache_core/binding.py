"""A pool's buffers bound to its plan: what strategies operate on.

Built once at pool construction (never per transfer): every host segment gets
a strided uint8 view, and every owned device layer a uint8 row view plus its
base address and token stride, so strategies can build pointer tables once.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from .errors import DeviceBufferError, HostBufferError
from .layout import BufferSpec, HostPlan, Layout, Segment, strided_host_view
from .spec import Part, PoolSpec

if TYPE_CHECKING:
    from .validate import CheckedPair

__all__ = ["BoundSegment", "PoolBinding", "device_rows", "flat_bytes", "bind"]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    return t.reshape(-1).view(torch.uint8)


def device_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` (``[tokens, ...]``, any dtype) as a uint8 ``[tokens, row_bytes]`` view.

    Only the token axis may be strided; everything after it must be contiguous.
    """
    if t.dim() < 1:
        raise DeviceBufferError(f"device buffer {name} must have a token axis, got a 0-d tensor; pass the layer's "
                                "[tokens, ...] tensor")
    if t.dim() > 1 and not _inner_contiguous(t):
        raise DeviceBufferError(
            f"device buffer {name}: each token's row must be contiguous (only the token axis may be "
            f"strided); got shape {tuple(t.shape)} strides {t.stride()}. Pass a view with contiguous rows"
        )
    row_items = math.prod(t.shape[1:])
    if t.shape[0] > 1 and t.stride(0) < row_items:
        raise DeviceBufferError(
            f"device buffer {name}: token rows overlap (shape {tuple(t.shape)}, token stride {t.stride(0)} elements "
            f"for rows of {row_items}); a load would write one row's bytes through another. Pass a buffer whose "
            "tokens each have their own memory (not an expand()ed or as_strided() view)"
        )
    rows = t.reshape(t.shape[0], row_items) if t.dim() > 1 else t.unsqueeze(1)
    return rows.view(torch.uint8)


def _inner_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class BoundSegment:
    """One host segment with its device rows, in layer-map entry order.

    ``device_rows[i]`` (uint8 ``[N_i, width]``, token stride ``dev_strides[i]``
    bytes, base address ``dev_ptrs[i]``) is stored in host layer slot
    ``host_layers[i]``; it is device layer ``device_layers[i]``.
    """

    segment: Segment
    host_flat: torch.Tensor
    host_view: torch.Tensor
    host_layer_num: int
    device_layers: tuple[int, ...]
    host_layers: tuple[int, ...]
    device_rows: tuple[torch.Tensor, ...]
    dev_ptrs: tuple[int, ...]
    dev_strides: tuple[int, ...]
    dev_lens: tuple[int, ...]

    def entries(self, layer: int | None) -> list[int]:
        """Entry positions for one device layer (empty when absent) or all of them (a new list each call)."""
        if layer is None:
            return list(range(len(self.device_layers)))
        by_layer = self.__dict__.get("_entries_by_layer")
        if by_layer is None:  # built once: a burst of per-layer calls asks for every layer
            by_layer = {}
            for i, d in enumerate(self.device_layers):
                by_layer.setdefault(d, []).append(i)
            object.__setattr__(self, "_entries_by_layer", by_layer)
        return list(by_layer.get(layer, ()))

    @property
    def width(self) -> int:
        return self.segment.width


@dataclass
class PoolBinding:
    """Spec, layout, plan, host buffers and bound segments of one pool.

    ``scratch`` is private to the pool's strategy (pointer tables and the like).
    """

    spec: PoolSpec
    layout: Layout
    plan: HostPlan
    host_buffers: dict[str, torch.Tensor]
    segments: tuple[BoundSegment, ...]
    host_pinned: bool
    scratch: dict[str, Any] = field(default_factory=dict)
    #: rows every bound device tensor has (device indices must be below it); huge when none is bound
    device_rows: int = field(init=False)
    #: Per thread: the pair checked in that thread's call now running (:attr:`checked`).
    _calls: threading.local = field(default_factory=threading.local, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.device_rows = min((n for s in self.segments for n in s.dev_lens), default=1 << 62)

    @property
    def checked(self) -> CheckedPair | None:
        """During a transfer call, the index pair the pool checked in it, with what the check read of their values
        (:class:`~hicache_core.validate.CheckedPair`); ``None`` outside calls and in a call whose check was skipped
        because the pool had checked the same tensors before.  Per thread: another thread's check, under way in a call
        of its own on the same tensors, is never this call's (its facts could describe values rewritten since, behind
        torch's version counter, that this call's skipped check would have refused).  A strategy takes facts from it
        only through :meth:`~hicache_core.validate.CheckedPair.facts_of` with the tensors its call was handed."""
        return getattr(self._calls, "checked", None)

    @checked.setter
    def checked(self, value: CheckedPair | None) -> None:
        self._calls.checked = value

    @property
    def device(self) -> torch.device:
        return self.spec.device




def _device_list(
    spec: PoolSpec, seg: Segment, device_buffers: Mapping[str, Sequence[torch.Tensor | None]]
) -> tuple[Sequence[torch.Tensor | None], str, int]:
    if seg.part is not None and seg.part in device_buffers:
        part = _part(spec, seg)
        offset = seg.src_offset - part.offset  # src_offset is in the component row, the tensor holds the part alone
        if offset < 0 or offset + seg.width > part.nbytes:
            raise DeviceBufferError(
                f"layout segment of {seg.component!r} bytes {seg.src_offset}..{seg.src_offset + seg.width} names part "
                f"{part.name!r} (bytes {part.offset}..{part.offset + part.nbytes} of the row) but lies outside it; "
                "fix the layout's Segment (part, src_offset, width)"
            )
        return device_buffers[seg.part], seg.part, offset
    if seg.component in device_buffers:
        return device_buffers[seg.component], seg.component, seg.src_offset
    wanted = [seg.component] + ([seg.part] if seg.part else [])
    raise DeviceBufferError(
        f"device_buffers has no entry for {' or '.join(map(repr, wanted))}; it has {sorted(device_buffers)}. "
        "Pass one per-layer tensor list per component (or per part)"
    )


def _part(spec: PoolSpec, seg: Segment) -> Part:
    for p in spec.component(seg.component).parts:
        if p.name == seg.part:
            return p
    raise DeviceBufferError(f"layout segment names part {seg.part!r}, which component {seg.component!r} does not have "
                            f"(parts: {[p.name for p in spec.component(seg.component).parts]}); fix the layout's Segment")


def _split_by_parts(spec: PoolSpec, seg: Segment, device_buffers: Mapping[str, object]) -> list[Segment]:
    """Segments as the device holds them: a segment without a part becomes one per part its bytes overlap (that
    piece of it) when the device keeps the component's parts in separate tensors."""
    comp = spec.component(seg.component)
    if seg.part is not None or seg.component in device_buffers or not comp.parts:
        return [seg]
    if not all(p.name in device_buffers for p in comp.parts):
        return [seg]
    a = seg.addressing
    if not a.whole_row(seg.width):
        raise DeviceBufferError(
            f"component {comp.name!r} is held as separate parts on the device, but layout addressing splits its "
            f"rows into {a.chunk_bytes}-byte chunks {a.chunk_stride} bytes apart (start to start); pass the "
            "whole-row device tensors instead"
        )
    out = []
    start, end = seg.src_offset, seg.src_offset + seg.width
    for p in comp.parts:
        lo, hi = max(start, p.offset), min(end, p.offset + p.nbytes)
        if lo < hi:  # this part's bytes of the segment, where they lie in the segment's host row
            addr = replace(a, offset=a.offset + lo - start, chunk_bytes=hi - lo, chunk_stride=0)
            out.append(replace(seg, part=p.name, src_offset=lo, width=hi - lo, addressing=addr))
    return out


def _bind_segment(
    spec: PoolSpec, seg: Segment, host: torch.Tensor, device_buffers: Mapping[str, Sequence[torch.Tensor | None]]
) -> BoundSegment:
    lmap = spec.component_map(seg.component)
    layers, name, offset = _device_list(spec, seg, device_buffers)
    need_bytes = spec.component(seg.component).row_bytes if name == seg.component else _part(spec, seg).nbytes
    if len(layers) < lmap.num_device_layers and lmap.device_layers and max(lmap.device_layers) >= len(layers):
        raise DeviceBufferError(
            f"device_buffers[{name!r}] has {len(layers)} layers but the layer map reads device layer "
            f"{max(lmap.device_layers)}; pass one tensor per device layer id (None for layers not held)"
        )
    rows: list[torch.Tensor] = []
    for d in lmap.device_layers:
        t = layers[d]
        label = f"device_buffers[{name!r}][{d}]"
        if t is None:
            raise DeviceBufferError(f"{label} is None but the layer map owns device layer {d}; pass that layer's tensor "
                                    "(None only for layers the map does not own)")
        if t.device != spec.device:
            raise DeviceBufferError(f"{label} is on {t.device}, the pool spec says {spec.device}; move it or fix the spec")
        r = device_rows(t, label)
        if r.shape[1] != need_bytes:
            raise DeviceBufferError(
                f"{label} rows are {r.shape[1]} bytes, the spec's {name!r} rows are {need_bytes} bytes; pass tensors "
                f"whose rows match the spec (head count, head dim, dtype) or fix the spec"
            )
        rows.append(r[:, offset : offset + seg.width])
    hflat = flat_bytes(host)
    host_view = strided_host_view(hflat, seg, spec, lmap.host_layer_num)
    return BoundSegment(
        segment=seg,
        host_flat=hflat,
        host_view=host_view,
        host_layer_num=lmap.host_layer_num,
        device_layers=lmap.device_layers,
        host_layers=lmap.host_slots or (),  # always set after LayerMap.__post_init__
        device_rows=tuple(rows),
        dev_ptrs=tuple(r.data_ptr() for r in rows),
        dev_strides=tuple(r.stride(0) for r in rows),
        dev_lens=tuple(r.shape[0] for r in rows),
    )


def bind(
    spec: PoolSpec,
    layout: Layout,
    plan: HostPlan,
    host_buffers: Mapping[str, torch.Tensor],
    device_buffers: Mapping[str, Sequence[torch.Tensor | None]],
) -> PoolBinding:
    """Check host buffers against ``plan`` and bind every segment to its device rows."""
    hosts = {b.name: _host_buffer(b, host_buffers.get(b.name), layout, plan) for b in plan.buffers}
    segments = tuple(
        _bind_segment(spec, piece, hosts[s.buffer], device_buffers)
        for s in plan.segments
        for piece in _split_by_parts(spec, s, device_buffers)
    )
    # an empty buffer (a component on none of this rank's layers) holds no byte to pin: torch reports it unpinned
    pinned = all(t.is_pinned() for t in hosts.values() if t.numel()) if torch.cuda.is_available() else False
    return PoolBinding(spec, layout, plan, hosts, segments, pinned)


def _host_buffer(b: BufferSpec, t: torch.Tensor | None, layout: Layout, plan: HostPlan) -> torch.Tensor:
    """``t`` viewed as the planned buffer ``b``.

    Engine tensors may keep extra trailing dims (``[L, S, H, D]`` for a planned
    ``[L, S, H*D]``): any contiguous CPU tensor of the planned dtype whose
    leading dims match and whose trailing dims flatten to the planned row is accepted.
    """
    if t is None:
        raise HostBufferError(f"host buffer {b.name!r} is missing; the layout {layout.name!r} needs {[x.name for x in plan.buffers]}")
    lead = len(b.shape) - 1
    fits = (
        isinstance(t, torch.Tensor) and t.dtype == b.dtype and t.device.type == "cpu" and t.is_contiguous()
        and tuple(t.shape[:lead]) == b.shape[:lead] and t.numel() == BufferSpec(b.name, b.shape, b.dtype).nbytes // t.element_size()
    )
    if not fits:
        got = f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})" if isinstance(t, torch.Tensor) else type(t).__name__
        raise HostBufferError(
            f"host buffer {b.name!r} must be a contiguous CPU {b.dtype} tensor of shape {b.shape} (trailing dims may be "
            f"split) for layout {layout.name!r}; got {got}"
        )
    return t.view(b.shape)

"""Argument checks run before any byte moves."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from .errors import (
    ConfigError,
    DeviceBufferError,
    DuplicateIndexError,
    HostBufferError,
    IndexDeviceError,
    IndexDtypeError,
    IndexLengthMismatchError,
    IndexRangeError,
    IndexShapeError,
    LayerIdError,
    PageAlignmentError,
    PageMultipleError,
)
from .layout import strided_reach
from .spec import PoolSpec

__all__ = ["check_indices", "check_layer", "tensor_version", "tensor_where", "pair_where", "check_device_buffers", "check_host_buffers_disjoint", "check_host_apart_from_device",
           "byte_storage", "parse_programs", "repeated_rows", "index_bounds", "page_starts", "IndexFacts", "CheckedPair"]

_INDEX_DTYPES = (torch.int32, torch.int64)
#: :func:`check_indices` checks up to this many page starts of a CPU index tensor as Python ints (a batch's
#: pages: each torch operation costs the host microseconds, a Python pass over a few hundred ints less)
SMALL_STARTS = 256
#: ``arange(run)`` per (run, dtype, device): :func:`page_starts` compares every call's indices with it
_STEPS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


@dataclass(frozen=True)
class IndexFacts:
    """What :func:`check_indices` learnt of a pair's values while checking them.

    ``host_starts``: the first slot of each host page (their values checked: in range, whole aligned
    pages), ``None`` where the host values were not read.  ``device_read``: whether the device values
    were checked in range; then ``device_starts`` holds the first row of each run where the device
    rows are whole runs of ``page_size`` consecutive rows (``None`` where they are not).  Both
    tensors live on the checked index tensors' device; they may be views of them, so they describe the
    values at the check: take values from them only while the tensors are unchanged.
    """

    host_starts: torch.Tensor | None
    device_starts: torch.Tensor | None
    device_read: bool


@dataclass(frozen=True)
class CheckedPair:
    """The index tensors a pool checked in the call now running, their version counters, and the
    :class:`IndexFacts` of that check (see :attr:`~hicache_core.binding.PoolBinding.checked`)."""

    host_indices: torch.Tensor
    host_version: int | None
    device_indices: torch.Tensor
    device_version: int | None
    facts: IndexFacts

    def facts_of(self, host_indices: object, device_indices: object) -> IndexFacts | None:
        """The facts, if they are of these very tensors, unchanged since the check; else ``None``."""
        if host_indices is not self.host_indices or device_indices is not self.device_indices:
            return None
        if self.host_version is None or self.device_version is None:
            return None
        if tensor_version(self.host_indices) != self.host_version or tensor_version(self.device_indices) != self.device_version:
            return None
        return self.facts


def tensor_where(t: torch.Tensor) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    """What a ``.data`` swap changes while keeping the tensor object and its version counter: address, length, dtype,
    strides (a swap to another view of the same storage may keep the first three: ``store[::2]`` for ``store[:n]``).
    Memos compare it beside :func:`tensor_version`, and hold the storage so that no other one takes its address."""
    return t.data_ptr(), t.numel(), t.dtype, t.stride()


def pair_where(host_indices: torch.Tensor, device_indices: torch.Tensor) -> tuple:
    """:func:`tensor_where` of an index pair."""
    return (*tensor_where(host_indices), *tensor_where(device_indices))


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s in-place modification counter, or ``None`` where torch keeps none (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _basic(name: str, t: object, spec: PoolSpec) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise IndexDtypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(t).__name__}")
    if t.layout != torch.strided:  # sparse & co: no values to read in place (copy plans and kernels read memory)
        raise IndexDtypeError(f"{name} must be a dense (strided) tensor of int32 or int64, got layout {t.layout}; "
                              "convert it with .to_dense()")
    if t.dim() != 1:
        raise IndexShapeError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}; flatten it")
    if t.dtype not in _INDEX_DTYPES:
        raise IndexDtypeError(f"{name} must be int32 or int64, got {t.dtype}; convert with .long()")
    # the checks read values as torch shows them; strategies (kernels, copy plans) read the tensor's memory: a lazily
    # negated view holds the negated values there, a zero tensor has no memory at all
    if t.is_neg():
        raise IndexDtypeError(f"{name} is a lazily negated view (is_neg()): its memory holds other values than it "
                              f"reads as; pass {name}.resolve_neg()")
    if t._is_zerotensor():
        raise IndexDtypeError(f"{name} is a zero tensor without memory of its own; pass a materialised tensor "
                              "(e.g. torch.zeros)")
    if t.device.type != "cpu" and t.device != spec.device:
        raise IndexDeviceError(f"{name} is on {t.device}; pass it on the CPU or on the pool's device {spec.device}")
    return t


def index_bounds(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty index tensor, in one pass (reading them waits for a GPU tensor's producers)."""
    lo, hi = torch.aminmax(t)
    return int(lo), int(hi)


def page_starts(t: torch.Tensor, run: int) -> torch.Tensor | None:
    """The first value of each run where the 1-D ``t`` is whole runs of ``run`` consecutive values
    (the slots or rows an engine's page allocator hands out), else ``None``; ``t`` itself where
    ``run`` is 1.  A view of ``t`` (a strided one where ``run`` > 1), of an int64 copy where ``t`` is int32
    (so that no run wraps around the int32 range)."""
    if run == 1:
        return t
    if t.numel() % run:
        return None
    if t.dtype != torch.int64:
        t = t.long()
    key = (run, t.dtype, t.device)
    step = _STEPS.get(key)
    if step is None:
        step = _STEPS[key] = torch.arange(run, dtype=t.dtype, device=t.device)
    runs = t.view(-1, run)
    starts = runs[:, 0]
    return starts if torch.equal(runs, starts.unsqueeze(1) + step) else None


def _bounds(t: torch.Tensor, starts: torch.Tensor | None, run: int) -> tuple[int, int]:
    """:func:`index_bounds` of ``t``, from its run starts where it is whole runs (``1/run`` of the values)."""
    if starts is None:
        return index_bounds(t)
    lo, hi = index_bounds(starts)
    return lo, hi + run - 1


def _runs_and_bounds(t: torch.Tensor, run: int) -> tuple[torch.Tensor | None, list[int] | None, int, int]:
    """:func:`page_starts` of the non-empty ``t``; the starts as Python ints where they are few
    (:data:`SMALL_STARTS`) and on the CPU, else ``None``; and ``t``'s bounds, from the starts where ``t`` is
    whole runs."""
    starts = page_starts(t, run)
    if starts is None or starts.numel() > SMALL_STARTS or starts.device.type != "cpu":
        return starts, None, *_bounds(t, starts, run)
    vals = starts.tolist()
    return starts, vals, min(vals), max(vals) + run - 1


def _runs_overlap(starts: list[int], run: int) -> bool:
    """Whether two of the runs of ``run`` consecutive values starting at ``starts`` share a value."""
    ordered = sorted(starts)
    return any(b - a < run for a, b in zip(ordered, ordered[1:]))


_UNKNOWN = object()


def repeated_rows(rows: torch.Tensor, run: int, starts: object = _UNKNOWN) -> torch.Tensor:
    """The values that occur more than once in the 1-D ``rows`` (sorted, each at least once; empty when
    none).  Where ``rows`` is whole runs of ``run`` consecutive values (device rows of an engine's page
    allocator), they repeat only if two runs overlap, which the runs' sorted starts show
    (``1/run`` of the sorting); otherwise, or when some do overlap, every value is sorted.
    ``starts``: :func:`page_starts` of ``rows`` where the caller has it."""
    first = page_starts(rows, run) if starts is _UNKNOWN else starts
    if isinstance(first, torch.Tensor):
        first = first.sort().values
        if not bool((first[1:] - first[:-1] < run).any()):
            return first[:0]
    ordered = rows.sort().values
    return ordered[1:][ordered[1:] == ordered[:-1]]


def check_indices(
    spec: PoolSpec,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    device_rows: int,
    *,
    host_values: bool = True,
    device_values: bool = True,
    unique_host: bool = False,
    unique_device: bool = False,
) -> IndexFacts:
    """Validate a transfer's index tensors; returns what the check learnt of their values.

    Shape, dtype, device, equal length and page multiple are always checked.
    With ``host_values`` the host slots are checked to lie in range and form
    whole pages (and, with ``unique_host``, no page to repeat: a backup writes
    them); with ``device_values`` the device rows to lie in ``0..device_rows-1``
    (and, with ``unique_device``, none to repeat: a load writes them).  Checking
    the values of device-resident indices synchronises with the device.
    """
    h = _basic("host_indices", host_indices, spec)
    d = _basic("device_indices", device_indices, spec)
    if h.numel() != d.numel():
        raise IndexLengthMismatchError(
            f"host_indices has {h.numel()} entries but device_indices has {d.numel()}; they must pair one to one"
        )
    ps = spec.page_size
    if h.numel() % ps:
        raise PageMultipleError(
            f"host_indices has {h.numel()} entries, not a multiple of page_size={ps}; transfer whole pages"
        )
    if h.numel() == 0:
        return IndexFacts(h if host_values else None, d if device_values else None, device_values)
    dev_starts = None
    if device_values:
        dev_starts, vals, dmin, dmax = _runs_and_bounds(d, ps)
        if dmin < 0 or dmax >= device_rows:
            if device_rows == 0:
                raise IndexRangeError(f"device_indices {dmin}..{dmax}, but the shortest device layer has no rows; "
                                      "give the pool device tensors with rows to move")
            raise IndexRangeError(
                f"device_indices must lie in 0..{device_rows - 1} (rows of the device buffers, the shortest layer's), got {dmin}..{dmax}; "
                "index rows the device tensors have"
            )
        if unique_device and (vals is None or _runs_overlap(vals, ps)):
            dup = repeated_rows(d, ps, dev_starts)
            if dup.numel():
                raise DuplicateIndexError(
                    f"device_indices repeat rows {dup.unique()[:4].tolist()}; a load would write them twice "
                    "(the last write would win, kernels would race): pass each device row once"
                )
    if not host_values:
        return IndexFacts(None, dev_starts, device_values)
    starts, vals, hmin, hmax = _runs_and_bounds(h, ps)
    if hmin < 0 or hmax >= spec.capacity:
        raise IndexRangeError(
            f"host_indices must lie in 0..{spec.capacity - 1} (capacity), got {hmin}..{hmax}; use slots from alloc()"
        )
    if starts is None or (ps > 1 and (any(v % ps for v in vals) if vals is not None else bool((starts % ps).any()))):
        raise PageAlignmentError(
            f"host_indices must be whole pages: runs of page_size={ps} consecutive slots "
            "starting at a multiple of page_size (as alloc returns them)"
        )
    if unique_host and (vals is None or len(set(vals)) < len(vals)):
        first = starts.sort().values
        dup = first[1:][first[1:] == first[:-1]]
        if dup.numel():
            raise DuplicateIndexError(
                f"host_indices repeat the pages starting at slots {dup.unique()[:4].tolist()}; a backup would write "
                "them twice (the last write would win, kernels would race): pass each host page once"
            )
    return IndexFacts(starts, dev_starts, device_values)


def check_layer(spec: PoolSpec, layer_id: object) -> int:
    """``layer_id`` as an int in ``0..num_device_layers-1``, else :class:`LayerIdError`.  Integers such as NumPy's are
    taken as the allocator takes them (``__index__``); bools, floats, strings and tensors are not (a tensor would
    be read back from its device: pass ``int(t)``)."""
    n = spec.layer_map.num_device_layers
    i = layer_id if type(layer_id) is int else None
    if i is None and not isinstance(layer_id, (bool, torch.Tensor)) and hasattr(type(layer_id), "__index__"):
        i = operator.index(layer_id)  # type: ignore[arg-type]
    if i is None or not 0 <= i < n:
        fix = "; pass int(layer_id) (a tensor would be read back from its device)" if isinstance(layer_id, torch.Tensor) else ""
        raise LayerIdError(f"layer_id must be an int in 0..{n - 1} (device layer ids), got {layer_id!r}{fix}")
    return i


def byte_storage(dtype: torch.dtype) -> bool:
    """One-byte dtypes (uint8, int8, FP8): engines keep packed or quantised rows in them."""
    return torch.empty((), dtype=dtype).element_size() == 1


def check_device_buffers(spec: PoolSpec, device_buffers: object) -> None:
    """Check what :func:`~hicache_core.binding.bind` cannot see: the container types, the
    number of per-layer entries and the dtypes.

    ``device_buffers`` must map component (or part) names to one entry per device
    layer id (exactly ``num_device_layers``, at most) of torch tensors or ``None``.
    A tensor's dtype must be the component's, except that one-byte dtypes (uint8,
    int8, FP8) on either side are byte storage and pair with anything of the right
    row size.
    """
    if not isinstance(device_buffers, Mapping):
        n = len(device_buffers) if hasattr(device_buffers, "__len__") else "?"  # type: ignore[arg-type]
        example = ", ".join(f"{c.name!r}: {c.name}_layers" for c in spec.components)
        raise DeviceBufferError(
            f"device_buffers must be a mapping of component (or part) name -> per-layer tensor list, got a "
            f"{type(device_buffers).__name__} of {n} items; pass e.g. {{{example}}}"
        )
    dtypes = {c.name: c.dtype for c in spec.components}
    dtypes.update({p.name: c.dtype for c in spec.components for p in c.parts})
    n_layers = spec.layer_map.num_device_layers
    for name, layers in device_buffers.items():
        if name not in dtypes:
            continue  # not read: names the spec does not have are ignored (e.g. a whole row next to its parts)
        if isinstance(layers, torch.Tensor) or not isinstance(layers, (list, tuple)):
            raise DeviceBufferError(
                f"device_buffers[{name!r}] must be a list with one tensor (or None) per device layer id, got "
                f"{type(layers).__name__}; pass [layer0, layer1, ...]"
            )
        if len(layers) > n_layers:
            raise DeviceBufferError(
                f"device_buffers[{name!r}] has {len(layers)} layers but the spec has {n_layers} device layers "
                "(layer_map.num_device_layers); pass one tensor per device layer id, or fix the layer map"
            )
        for i, t in enumerate(layers):
            label = f"device_buffers[{name!r}][{i}]"
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise DeviceBufferError(
                    f"{label} must be a torch.Tensor (or None), got {type(t).__name__}; wrap it with torch.from_numpy "
                    "or pass the engine's tensor"
                )
            want = dtypes[name]
            if t.dtype != want and not byte_storage(t.dtype) and not byte_storage(want):
                raise DeviceBufferError(
                    f"{label} is {t.dtype} but the spec's {name!r} rows are {want}; pass tensors of the spec's dtype "
                    f"or build the spec with dtype={t.dtype}"
                )


def check_host_buffers_disjoint(host_buffers: Mapping[str, torch.Tensor]) -> None:
    """Wrapped host buffers must not share memory (a round trip would return another buffer's bytes)."""
    spans = []
    for name, t in host_buffers.items():
        # a non-contiguous one's bytes are not one span (bind refuses it, naming what is wrong with it)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() and t.is_contiguous():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    reach, owner = 0, ""
    for start, end, name in spans:
        if start < reach:
            first, second = sorted((owner, name))
            raise HostBufferError(
                f"host buffers {first!r} and {second!r} share memory ({min(reach, end) - start} bytes overlap); each "
                "buffer the layout plans needs its own memory: pass separate tensors"
            )
        if end > reach:
            reach, owner = end, name


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` that a tensor's elements lie within (a strided one's gaps included); ``None`` for an
    empty tensor."""
    if t.numel() == 0:
        return None
    lo, hi = strided_reach(t.shape, t.stride())
    return t.data_ptr() + lo * t.element_size(), t.data_ptr() + hi * t.element_size()


def check_host_apart_from_device(host_buffers: Mapping[str, torch.Tensor],
                                 device_buffers: Mapping[str, Sequence[torch.Tensor | None]]) -> None:
    """On a CPU pool, no host buffer may share memory with the device rows (a backup would overwrite rows it has yet
    to read, a load the host bytes it reads): :class:`HostBufferError` naming both."""
    dev = [(ext, f"{name}[{i}]") for name, layers in device_buffers.items() for i, t in enumerate(layers)
           if isinstance(t, torch.Tensor) and t.device.type == "cpu" and (ext := _extent(t)) is not None]
    for hname, h in host_buffers.items():
        ext = _extent(h) if isinstance(h, torch.Tensor) and h.device.type == "cpu" else None
        hit = next((d for (lo, hi), d in dev if ext is not None and lo < ext[1] and ext[0] < hi), None)
        if hit is not None:
            raise HostBufferError(f"host buffer {hname!r} shares memory with device_buffers {hit}; the host pool needs "
                                  "memory of its own: pass separate tensors (or let the pool allocate them)")


def parse_programs(value: object, source: str) -> int:
    """A kernel program count (SM budget) from ``source`` (an option or environment variable): an int >= 1.

    :raises ConfigError: anything else (``"abc"``, ``"-3"``, ``0``, ``2.5``), naming ``source``.
    """
    n: int | None = None
    if isinstance(value, str):
        try:
            n = int(value.strip())
        except ValueError:  # "abc", "+-5", "2.5": named below
            n = None
    elif not isinstance(value, bool):
        try:
            n = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            n = None
    if n is None or n < 1:
        raise ConfigError(f"{source}={value!r}: the number of kernel programs must be an integer >= 1 (e.g. 8); "
                          "fix or unset it", setting=source)
    return n

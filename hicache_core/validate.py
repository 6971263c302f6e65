"""Argument checks run before any byte moves."""

from __future__ import annotations

import operator
from typing import Mapping

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
from .spec import PoolSpec

__all__ = ["check_indices", "check_layer", "tensor_version", "check_device_buffers", "check_host_buffers_disjoint",
           "byte_storage", "parse_programs", "repeated_rows", "index_bounds"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s in-place modification counter, or ``None`` where torch keeps none (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _basic(name: str, t: object, spec: PoolSpec) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise IndexDtypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(t).__name__}")
    if t.dim() != 1:
        raise IndexShapeError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}; flatten it")
    if t.dtype not in _INDEX_DTYPES:
        raise IndexDtypeError(f"{name} must be int32 or int64, got {t.dtype}; convert with .long()")
    if t.device.type != "cpu" and t.device != spec.device:
        raise IndexDeviceError(f"{name} is on {t.device}; pass it on the CPU or on the pool's device {spec.device}")
    return t


def index_bounds(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty index tensor, in one pass (reading them waits for a GPU tensor's producers)."""
    lo, hi = torch.aminmax(t)
    return int(lo), int(hi)


def repeated_rows(rows: torch.Tensor, run: int) -> torch.Tensor:
    """The values that occur more than once in the 1-D ``rows`` (sorted, each at least once; empty when
    none).  Where ``rows`` is whole runs of ``run`` consecutive values (device rows of an engine's page
    allocator), they repeat only if two runs overlap, which the runs' sorted starts show
    (``1/run`` of the sorting); otherwise, or when some do overlap, every value is sorted."""
    if run > 1 and rows.numel() % run == 0:
        runs = rows.view(-1, run)
        starts = runs[:, 0]
        if torch.equal(runs, starts.unsqueeze(1) + torch.arange(run, dtype=rows.dtype, device=rows.device)):
            first = starts.sort().values
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
) -> None:
    """Validate a transfer's index tensors.

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
    if h.numel() % spec.page_size:
        raise PageMultipleError(
            f"host_indices has {h.numel()} entries, not a multiple of page_size={spec.page_size}; transfer whole pages"
        )
    if h.numel() == 0:
        return
    if device_values:
        dmin, dmax = index_bounds(d)
        if dmin < 0 or dmax >= device_rows:
            raise IndexRangeError(
                f"device_indices must lie in 0..{device_rows - 1} (rows of the device buffers), got {dmin}..{dmax}; "
                "index rows the device tensors have"
            )
        if unique_device:
            dup = repeated_rows(d, spec.page_size)
            if dup.numel():
                raise DuplicateIndexError(
                    f"device_indices repeat rows {dup.unique()[:4].tolist()}; a load would write them twice "
                    "(the last write would win, kernels would race): pass each device row once"
                )
    if not host_values:
        return
    hmin, hmax = index_bounds(h)
    if hmin < 0 or hmax >= spec.capacity:
        raise IndexRangeError(
            f"host_indices must lie in 0..{spec.capacity - 1} (capacity), got {hmin}..{hmax}; use slots from alloc()"
        )
    pages = h.view(-1, spec.page_size)
    if spec.page_size > 1:
        step = torch.arange(spec.page_size, device=h.device, dtype=h.dtype)
        aligned = bool(((pages[:, 0] % spec.page_size) == 0).all()) and bool((pages == pages[:, :1] + step).all())
        if not aligned:
            raise PageAlignmentError(
                f"host_indices must be whole pages: runs of page_size={spec.page_size} consecutive slots "
                "starting at a multiple of page_size (as alloc returns them)"
            )
    if unique_host:
        starts = pages[:, 0].sort().values
        dup = starts[1:][starts[1:] == starts[:-1]]
        if dup.numel():
            raise DuplicateIndexError(
                f"host_indices repeat the pages starting at slots {dup.unique()[:4].tolist()}; a backup would write "
                "them twice (the last write would win, kernels would race): pass each host page once"
            )


def check_layer(spec: PoolSpec, layer_id: object) -> int:
    """``layer_id`` as an int in ``0..num_device_layers-1``, else :class:`LayerIdError`."""
    n = spec.layer_map.num_device_layers
    if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < n:
        raise LayerIdError(f"layer_id must be an int in 0..{n - 1} (device layer ids), got {layer_id!r}")
    return layer_id


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
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
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


def parse_programs(value: object, source: str) -> int:
    """A kernel program count (SM budget) from ``source`` (an option or environment variable): an int >= 1.

    :raises ConfigError: anything else (``"abc"``, ``"-3"``, ``0``, ``2.5``), naming ``source``.
    """
    n: int | None = None
    if isinstance(value, str):
        n = int(value.strip()) if value.strip().lstrip("+-").isdigit() else None
    elif not isinstance(value, bool):
        try:
            n = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            n = None
    if n is None or n < 1:
        raise ConfigError(f"{source}={value!r}: the number of kernel programs must be an integer >= 1 (e.g. 8); "
                          "fix or unset it")
    return n

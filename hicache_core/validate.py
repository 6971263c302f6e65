"""Argument checks run before any byte moves."""

from __future__ import annotations

import torch

from .errors import (
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

__all__ = ["check_indices", "check_layer", "tensor_version"]

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


def check_indices(
    spec: PoolSpec,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    device_rows: int,
    *,
    host_values: bool = True,
    device_values: bool = True,
) -> None:
    """Validate a transfer's index tensors.

    Shape, dtype, device, equal length and page multiple are always checked.
    With ``host_values`` the host slots are checked to lie in range and form
    whole pages; with ``device_values`` the device rows to lie in
    ``0..device_rows-1``.  Checking the values of device-resident indices
    synchronises with the device.
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
        dmin, dmax = int(d.min()), int(d.max())
        if dmin < 0 or dmax >= device_rows:
            raise IndexRangeError(
                f"device_indices must lie in 0..{device_rows - 1} (rows of the device buffers), got {dmin}..{dmax}; "
                "index rows the device tensors have"
            )
    if not host_values:
        return
    hmin, hmax = int(h.min()), int(h.max())
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


def check_layer(spec: PoolSpec, layer_id: object) -> int:
    """``layer_id`` as an int in ``0..num_device_layers-1``, else :class:`LayerIdError`."""
    n = spec.layer_map.num_device_layers
    if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < n:
        raise LayerIdError(f"layer_id must be an int in 0..{n - 1} (device layer ids), got {layer_id!r}")
    return layer_id

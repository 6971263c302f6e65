"""Page-granular host slot allocator."""

from __future__ import annotations

import threading

import torch

from .errors import (
    AllocatorArgumentError,
    AllocSizeError,
    DoubleFreeError,
    ForeignSlotError,
    FreePageError,
    PoolExhaustedError,
    SpecError,
)
from .spec import as_int as _as_int

__all__ = ["PageAllocator"]


class PageAllocator:
    """Hands out host token slots in whole, page-aligned pages.

    ``alloc(n)`` returns ``n`` CPU int64 slots made of ``n // page_size`` whole
    pages (lowest free pages first).  ``free`` takes back whole pages.  Double
    frees, slots outside the pool, partial pages and exhaustion raise.  All
    methods are thread-safe.  A call that raises changes nothing.
    """

    def __init__(self, capacity: int, page_size: int) -> None:
        page_size = _as_int(page_size, "page_size", SpecError)
        capacity = _as_int(capacity, "capacity", SpecError)
        if page_size < 1 or capacity < page_size or capacity % page_size:
            raise SpecError(f"capacity={capacity} must be a positive multiple of page_size={page_size} (>= 1)")
        self.capacity = capacity
        self.page_size = page_size
        self.num_pages = capacity // page_size
        self._lock = threading.RLock()
        self._used = torch.zeros(self.num_pages, dtype=torch.bool)
        self._free = torch.arange(self.num_pages, dtype=torch.int64)

    def available_size(self) -> int:
        """Free token slots."""
        with self._lock:
            return int(self._free.numel()) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor:
        """``need_size`` slots (a multiple of ``page_size``) as a CPU int64 tensor.

        :raises AllocatorArgumentError: ``need_size`` is not an int (float, str, ``None``, bool).
        :raises AllocSizeError: ``need_size`` is not a positive multiple of ``page_size``.
        :raises PoolExhaustedError: fewer than ``need_size`` slots are free.
        """
        need_size = _as_int(need_size, "alloc(need_size)", AllocatorArgumentError)
        if need_size <= 0 or need_size % self.page_size:
            raise AllocSizeError(
                f"alloc(need_size={need_size}): need_size must be a positive multiple of page_size={self.page_size}"
            )
        pages = need_size // self.page_size
        with self._lock:
            if pages > self._free.numel():
                raise PoolExhaustedError(
                    f"alloc(need_size={need_size}): only {self._free.numel() * self.page_size} of "
                    f"{self.capacity} host slots are free; free some or build a larger pool"
                )
            self._free, _ = self._free.sort()
            taken, self._free = self._free[:pages], self._free[pages:]
            self._used[taken] = True
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (taken.unsqueeze(1) * self.page_size + offsets).reshape(-1)

    def try_alloc(self, need_size: int) -> torch.Tensor | None:
        """Like :meth:`alloc`, but ``None`` when the pool is exhausted (SGLang's convention)."""
        try:
            return self.alloc(need_size)
        except PoolExhaustedError:
            return None

    def free(self, indices: torch.Tensor) -> int:
        """Return whole pages of slots; returns the number of slots freed.

        :raises AllocatorArgumentError: ``indices`` is not a torch.Tensor of an integer dtype
            (a list, a NumPy array, floats, bools) or its values cannot be read (meta tensor).
        :raises ForeignSlotError: a slot lies outside ``0..capacity-1``.
        :raises AllocSizeError: the count is not a multiple of ``page_size``.
        :raises FreePageError: the slots are not whole pages.
        :raises DoubleFreeError: a page is not currently allocated, or appears twice in ``indices``.
        """
        idx = _slot_values(indices)
        if idx.numel() == 0:
            return 0
        if int(idx.min()) < 0 or int(idx.max()) >= self.capacity:
            raise ForeignSlotError(
                f"free(indices): slots must lie in 0..{self.capacity - 1}, got {int(idx.min())}..{int(idx.max())}; "
                "these slots do not belong to this pool"
            )
        if idx.numel() % self.page_size:
            raise AllocSizeError(f"free(indices): {idx.numel()} slots is not a multiple of page_size={self.page_size}; "
                                 "free whole pages as alloc returned them")
        pages = idx.view(-1, self.page_size)
        expected = pages[:, :1] + torch.arange(self.page_size)
        if not torch.equal(pages, expected) or bool((pages[:, 0] % self.page_size).ne(0).any()):
            raise FreePageError("free(indices): slots must be whole pages as returned by alloc")
        page_ids = pages[:, 0] // self.page_size
        uniq, counts = page_ids.unique(return_counts=True)
        if bool((counts > 1).any()):
            raise DoubleFreeError(
                f"free(indices): pages {uniq[counts > 1][:4].tolist()} appear more than once in this call; "
                "pass each page once"
            )
        with self._lock:
            if not bool(self._used[page_ids].all()):
                bad = page_ids[~self._used[page_ids]][:4].tolist()
                raise DoubleFreeError(f"free(indices): pages {bad} are not allocated (double free?)")
            self._used[page_ids] = False
            self._free = torch.cat([self._free, page_ids])
        return idx.numel()

    def allocated(self, page_ids: torch.Tensor) -> torch.Tensor:
        """A CPU bool mask of ``page_ids``'s shape: which of those pages (ids in ``0..num_pages-1``) are allocated.

        :raises AllocatorArgumentError: ``page_ids`` is not a torch.Tensor of an integer dtype (a bool tensor would
            select by mask, not by page id) or its values cannot be read (meta tensor).
        :raises ForeignSlotError: a page id lies outside ``0..num_pages-1`` (a negative one would name a page counted
            from the end).
        """
        ids = _page_values(page_ids)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_pages):
            raise ForeignSlotError(
                f"allocated(page_ids): page ids must lie in 0..{self.num_pages - 1}, got {int(ids.min())}..{int(ids.max())}; "
                "pass page ids (slot // page_size) of this pool"
            )
        with self._lock:
            return self._used[ids].clone()

    def clear(self) -> None:
        """Free everything."""
        with self._lock:
            self._used.zero_()
            self._free = torch.arange(self.num_pages, dtype=torch.int64)


def _int_tensor(value: object, call: str, what: str, how: str, dtype_fix: str) -> torch.Tensor:
    """``call``'s tensor argument of integer ``what`` (``how``: where they come from), refusing anything that would be
    truncated, guessed or read as something else (a bool tensor would select by mask); ``dtype_fix``: what to pass
    instead of a non-integer dtype."""
    if not isinstance(value, torch.Tensor):
        raise AllocatorArgumentError(
            f"{call} must be a torch.Tensor of integer {what}{how}, got {type(value).__name__}; "
            "wrap it with torch.as_tensor(..., dtype=torch.int64)"
        )
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise AllocatorArgumentError(f"{call} must hold integer {what}, got {value.dtype}; {dtype_fix}")
    return value


def _slot_values(indices: object) -> torch.Tensor:
    """``free``'s argument as flat CPU int64 slot values."""
    t = _int_tensor(indices, "free(indices)", "slots", " as alloc returned them",
                    "pass the int64 tensor alloc returned")
    if t.device.type == "meta":
        raise AllocatorArgumentError("free(indices) is a meta tensor, whose values cannot be read; pass the slots alloc returned")
    return _cpu_int64(t.reshape(-1), "free(indices)", "slots")


def _cpu_int64(t: torch.Tensor, call: str, what: str) -> torch.Tensor:
    """``t``'s values as CPU int64, refusing uint64 values of 2**63 or more (the conversion would wrap them negative
    and the range error would name values the caller never passed)."""
    out = t.to("cpu", torch.int64)
    if t.dtype == torch.uint64 and bool((out < 0).any()):
        big = int(out[out < 0].max()) + 2**64
        raise ForeignSlotError(f"{call}: {what} must be below 2**63, got {big}; these {what} do not belong to this pool")
    return out


def _page_values(page_ids: object) -> torch.Tensor:
    """``allocated``'s argument as CPU int64 page ids of its shape."""
    t = _int_tensor(page_ids, "allocated(page_ids)", "page ids", "", "pass slot // page_size as int64")
    if t.device.type == "meta":
        raise AllocatorArgumentError("allocated(page_ids) is a meta tensor, whose values cannot be read; pass real page ids")
    return _cpu_int64(t, "allocated(page_ids)", "page ids")

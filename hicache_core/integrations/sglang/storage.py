"""SGLang's storage-tier page API, served from our page views where SGLang's code cannot.

SGLang's L3 path moves host pages through ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page`` (copying backends such
as ``HiCacheFile``) and ``get_page_buffer_meta`` (zero-copy backends, which use
the pointers).  SGLang 0.5.23 implements them for the layouts in
:data:`SGLANG_PAGES`; for every other layout the bridge serves (``page_first_kv_split``
off NPU, plugin layouts) the AROUND hooks below answer from
:meth:`~hicache_core.HostKVPool.get_page` / ``set_page`` / ``page_pointers``:

* a page is the bytes of every host layer of one page, block by block in
  ``page_pointers`` order (component by component: ``k`` before ``v``; MLA
  ``page_first_kv_split``: latent before rope, as SGLang's NPU pointers), as
  one flat tensor of the pool's dtype;
* ``get_page_buffer_meta(indices)`` returns, per page (every ``page_size``-th
  index), the address and byte size of each of those blocks.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from ...pool import HostKVPool
from .adapter import bridge_for, pool_kind
from .mode import current_mode

__all__ = ["SGLANG_PAGES", "PAGE_METHODS", "page_pool", "get_data_page", "get_dummy_flat_data_page",
           "set_from_flat_data_page", "get_page_buffer_meta"]

#: The SGLang host-pool methods hooked here (one AROUND hook of the same name each).
PAGE_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page", "get_page_buffer_meta")

#: Layouts whose page API SGLang 0.5.23 implements itself (off NPU), per pool kind.
SGLANG_PAGES = {
    "mla": frozenset({"layer_first", "page_first", "page_first_direct"}),
    "mha": frozenset({"layer_first", "page_first", "page_first_direct", "page_head"}),
}
#: The io_backend of the pool that serves page views (any resolves; ``direct`` is the core's generic one).
_PAGE_IO = "direct"


def page_pool(host: Any) -> HostKVPool | None:
    """Our pool over ``host``'s host buffers when we serve its page API, else ``None`` (SGLang's code runs)."""
    kind = pool_kind(host)
    if kind not in SGLANG_PAGES or host.layout in SGLANG_PAGES[kind] or current_mode() == "off":
        return None
    return bridge_for(host, None, _PAGE_IO).pool


def _page_of(host: Any, index: Any, what: str) -> int:
    """The page whose first host slot is ``index`` (an integer: int, NumPy integer, 0-d integer tensor).

    :raises ValueError: ``index`` is not an integer, or not the first slot of a page (a neighbouring page would be
        read or written instead)."""
    try:
        slot = operator.index(index)
    except TypeError:
        raise ValueError(f"{what}: index must be an integer host slot, got {index!r}") from None
    if slot % host.page_size:
        raise ValueError(f"{what}: host slot {slot} does not start a page (pages of {host.page_size} slots)")
    return slot // host.page_size


def _flat(host: Any, data: torch.Tensor) -> torch.Tensor:
    return data.view(host.dtype) if data.numel() % host.dtype.itemsize == 0 else data


def get_data_page(original: Callable, self: Any, index: int, flat: bool = True) -> torch.Tensor:
    """The page starting at host slot ``index`` (a copy, flat: our pages have no common shape)."""
    pool = page_pool(self)
    if pool is None:
        return original(self, index, flat=flat)
    return _flat(self, pool.get_page(_page_of(self, index, "get_data_page")))


def get_dummy_flat_data_page(original: Callable, self: Any) -> torch.Tensor:
    """A zeroed flat page on the host pool's device, as :func:`get_data_page` returns one."""
    pool = page_pool(self)
    if pool is None:
        return original(self)
    return _flat(self, torch.zeros(pool.page_bytes, dtype=torch.uint8, device=self.device,
                                   pin_memory=bool(self.pin_memory)))


def set_from_flat_data_page(original: Callable, self: Any, index: int, data_page: torch.Tensor) -> None:
    """Write a flat page (as :func:`get_data_page` returns it) into the page starting at host slot ``index``."""
    pool = page_pool(self)
    if pool is None:
        return original(self, index, data_page)
    pool.set_page(_page_of(self, index, "set_from_flat_data_page"), data_page)
    return None


def get_page_buffer_meta(original: Callable, self: Any, indices: Any) -> tuple[list[int], list[int]]:
    """``(pointers, byte sizes)`` of every contiguous block of the pages of ``indices`` (whole pages)."""
    pool = page_pool(self)
    if pool is None:
        return original(self, indices)
    slots = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
    ps = self.page_size
    if len(slots) % ps:
        raise ValueError(f"get_page_buffer_meta: {len(slots)} indices are not whole pages of {ps}")
    starts = slots[::ps]
    pages = [_page_of(self, start, "get_page_buffer_meta") for start in starts]
    for k, page in enumerate(pages):  # as SGLang reads them: each page by its first index (UMBP probes with zeros)
        if any(int(x) // ps != page for x in slots[k * ps:(k + 1) * ps]):
            raise ValueError(f"get_page_buffer_meta: indices {k * ps}..{(k + 1) * ps - 1} name slots of more than one "
                             f"page; pass each page's {ps} slots together")
    blocks = [b for page in pages for b in pool.page_pointers(page)]
    return [a for a, _ in blocks], [n for _, n in blocks]

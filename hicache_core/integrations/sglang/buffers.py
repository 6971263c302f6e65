"""``page_first_kv_split`` host buffers where SGLang 0.5.23 cannot allocate them.

SGLang allocates this layout only on NPU (MLA with ``MLASplitBuffers``); on
CUDA/CPU MLA ``init_kv_buffer`` fails with ``AttributeError`` and MHA raises
``ValueError: Unsupported layout``.  We allocate SGLang's NPU shapes with its
own allocator function, so every other attribute SGLang derives keeps working:

* MLA: ``k_buffer [P, L, ps, 1, kv_lora_rank]``, ``v_buffer [P, L, ps, 1, rope]``
  (a packed FP8 row lives whole in ``k_buffer [P, L, ps, 1, kv_cache_dim]`` and
  ``v_buffer`` is ``None``); ``kv_buffer`` is ``k_buffer``; no indexer mirrors.
* MHA: ``kv_buffer [2, P, L, ps, H, D]`` so that ``k_buffer``/``v_buffer``
  (SGLang's properties) are ``[P, L, ps, H, D]``.

``token_stride_size`` is one token's row of one layer across the split
buffers (as for the other layouts) and ``layout_dim = token_stride_size * L``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...registry import default_registry
from .adapter import pool_kind

__all__ = ["KV_SPLIT", "wants_kv_split_takeover", "init_kv_split_buffer", "init_transfer_views", "alloc_host",
           "destroy_mla"]

KV_SPLIT = "page_first_kv_split"


def wants_kv_split_takeover(host: Any) -> bool:
    """Whether ``host.init_kv_buffer`` is one SGLang cannot perform and we do: CUDA/CPU pools whose transfers the
    bridge serves (not allocator-only (dummy) pools, not decode context parallelism, and only with the
    ``page_first_kv_split`` layout installed); the others keep SGLang's allocation, and its error."""
    if getattr(host, "layout", None) != KV_SPLIT:
        return False
    if getattr(host, "_is_dummy", False) or getattr(host, "dcp_size", 1) != 1:
        return False  # the bridge leaves these pools' transfers to SGLang (adapter.describe)
    if KV_SPLIT not in default_registry().layouts:
        return False  # no hicache layout would serve the buffers allocated here
    kind = pool_kind(host)
    if kind == "mla":
        return getattr(host, "_native_buffers", None) is None
    return kind == "mha"


def alloc_host(host: Any, dims: tuple[int, ...], dtype: torch.dtype, granularity: int | None) -> torch.Tensor:
    """A host tensor from SGLang's own allocator function for ``host`` (pinned/registered as SGLang does)."""
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

    alloc = ALLOC_MEMORY_FUNCS[host._transfer_device.type]
    return alloc(dims, dtype=dtype, device=host.device, pin_memory=host.pin_memory, allocator=host.allocator,
                 registration_granularity_bytes=granularity)


def _mla(host: Any) -> torch.Tensor:
    P, L, ps, item = host.page_num, host.layer_num, host.page_size, host.dtype.itemsize
    packed = host.kv_cache_dim != host.kv_lora_rank + host.qk_rope_head_dim or bool(host.dsa_kv_cache_store_fp8)
    k_width = host.kv_cache_dim if packed else host.kv_lora_rank
    host.k_buffer = alloc_host(host, (P, L, ps, 1, k_width), host.dtype, ps * L * k_width * item)
    host.v_buffer = None
    if not packed:
        rope = host.qk_rope_head_dim
        host.v_buffer = alloc_host(host, (P, L, ps, 1, rope), host.dtype, ps * L * rope * item)
        host.__dict__[MLA_ROPE_ATTR] = True  # SGLang's destroy() unregisters kv_buffer (k_buffer) only: destroy_mla
        # zero-copy storage backends (Mooncake, UMBP) register kv_buffer plus get_hybrid_pool_buffer(); SGLang's MLA
        # pools have no such method, so without it the rope buffer, a page's second block, would go unregistered
        host.get_hybrid_pool_buffer = lambda: [host.k_buffer, host.v_buffer]
    host.index_k_buffer = None
    host.index_k_scale_buffer = None
    host.token_stride_size = host.kv_cache_dim * item
    host.layout_dim = host.token_stride_size * L
    return host.k_buffer


#: Set on an MLA host pool whose ``page_first_kv_split`` rope buffer (``v_buffer``) :func:`init_kv_split_buffer`
#: allocated through SGLang's allocator.
MLA_ROPE_ATTR = "_hicache_mla_rope_buffer"
#: Set on an MHA host pool whose ``page_first_kv_split`` buffers :func:`init_kv_split_buffer` allocated.
MHA_KV_SPLIT_ATTR = "_hicache_mha_kv_split"


def _mha(host: Any) -> torch.Tensor:
    if host.head_dim != host.v_head_dim:
        raise ValueError(f"Unsupported layout: {host.layout} (MHA with head_dim != v_head_dim)")
    P, L, ps = host.page_num, host.layer_num, host.page_size
    host.token_stride_size = host.head_num * host.head_dim * host.dtype.itemsize
    host.layout_dim = host.token_stride_size * L
    dims = (2, P, L, ps, host.head_num, host.head_dim)
    host.__dict__[MHA_KV_SPLIT_ATTR] = True
    return alloc_host(host, dims, host.dtype, ps * host.layout_dim)


def init_transfer_views(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """``MHATokenToKVPoolHost._initialize_transfer_views`` of a pool whose ``page_first_kv_split`` buffers we
    allocated: SGLang's branch for layouts it does not know takes ``k_buffer[i]`` as layer ``i``, which is page ``i``
    of these page-major buffers (and fails outright where the pool has fewer pages than layers).  It gets the buffers
    layer-major for the call (a transposed view, as SGLang makes its own page-major layouts' per-layer views);
    ``kv_buffer`` is restored after."""
    if not self.__dict__.get(MHA_KV_SPLIT_ATTR):
        return original(self, *args, **kwargs)
    kv = self.kv_buffer
    self.kv_buffer = kv.transpose(1, 2)  # [2, L, P, ps, H, D]
    try:
        return original(self, *args, **kwargs)
    finally:
        self.kv_buffer = kv


def init_kv_split_buffer(host: Any) -> torch.Tensor:
    """Allocate ``host``'s ``page_first_kv_split`` buffers; returns what SGLang stores as ``kv_buffer``."""
    return _mla(host) if pool_kind(host) == "mla" else _mha(host)


def destroy_mla(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """``MLATokenToKVPoolHost.destroy``: SGLang unregisters the pinned registration of ``kv_buffer`` alone, which for
    ``page_first_kv_split`` is ``k_buffer``; the rope buffer (``v_buffer``) :func:`init_kv_split_buffer` registered
    through SGLang's allocator is unregistered with it, on the same condition (else its registration outlives the
    pool, and a later registration over those pages fails).  Idempotent, as SGLang's is."""
    rope = self.v_buffer if self.__dict__.get(MLA_ROPE_ATTR) and not getattr(self, "_destroyed", False) else None
    result = original(self, *args, **kwargs)
    if rope is not None:
        from sglang.srt.mem_cache.pool_host import base

        self.__dict__.pop(MLA_ROPE_ATTR, None)
        if self.pin_memory and (base._is_cuda or base._is_hip):
            base._cuda_host_unregister(rope)
    return result

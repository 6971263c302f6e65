"""Describe an SGLang host pool (and its device pool) as a hicache pool.

:func:`describe` turns SGLang's attributes into a :class:`~hicache_core.PoolSpec`
with a :class:`~hicache_core.LayerMap`, the device buffers (SGLang's own
per-layer device tensors) and the host buffers (views of SGLang's own host
tensors, reshaped to the planned shapes of our layout).  Nothing is copied or
allocated.  :func:`bridge_for` resolves our strategy once per (host pool,
device pool, io_backend) and caches the outcome on the SGLang host object.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ...errors import ConfigError, HicacheError, SpecError
from ...logonce import log_once
from ...pool import ENV_VALIDATE, HostKVPool, validate_level
from ...registry import default_registry
from ...spec import MLA, Component, LayerMap, PoolSpec

__all__ = [
    "Unsupported", "Described", "Bridge", "pool_kind", "describe", "mha_spec", "bridge_for", "ENV_VALIDATE_DEFAULT",
    "HOST_BUFFERS_ATTR",
]

logger = logging.getLogger(__name__)

#: Index validation for bridged pools unless ``HICACHE_VALIDATE`` says otherwise:
#: CPU-resident indices are always checked; device-resident ones (kernel io)
#: are not (that would synchronise every layer) -- kernels mask every access.
ENV_VALIDATE_DEFAULT = "shapes"

_KINDS = {
    ("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost"): "mla",
    ("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost"): "mha",
    ("sglang.srt.mem_cache.pool_host.dsa", "DSAIndexerPoolHost"): "dsa_indexer",
}
_CACHE_ATTR = "_hicache_bridges"
#: Attribute of an SGLang host pool holding the host buffers we allocated (plugin layouts).
HOST_BUFFERS_ATTR = "_hicache_host_buffers"
_BUILD_LOCK = threading.Lock()


class Unsupported(HicacheError):
    """This SGLang pool cannot be described; SGLang's original method runs."""


def pool_kind(host: Any) -> str | None:
    """``mla`` / ``mha`` / ``dsa_indexer`` for the exact SGLang classes we understand, else ``None``.

    Subclasses (MXFP8, asymmetric, K-only, HiSparse...) override the transfer
    methods with semantics of their own and are left to SGLang.
    """
    cls = type(host)
    return _KINDS.get((cls.__module__, cls.__qualname__))


@dataclass
class Described:
    """A pool spec plus the tensors it is bound to, and how SGLang layer ids map to ours."""

    kind: str
    spec: PoolSpec
    device_buffers: dict[str, list[torch.Tensor | None]]
    host_buffers: dict[str, torch.Tensor]  # SGLang's tensors, by our buffer name (reshaped on bind)
    target_layers: frozenset[int]  # device-local target ids owned by this rank
    draft_ids: frozenset[int]  # controller ids of packed MTP draft layers
    page_indices: bool = False  # DSA indexer: transfers move whole pages, one row each


def _dev_of(buffers: Mapping[str, Sequence[torch.Tensor | None]]) -> torch.device:
    for layers in buffers.values():
        for t in layers:
            if t is not None:
                return t.device
    raise Unsupported("the device pool holds no layer on this rank")


def _common_checks(host: Any) -> None:
    if getattr(host, "_is_dummy", False):
        raise Unsupported("allocator-only (dummy) host pool")
    if getattr(host, "dcp_size", 1) != 1:
        raise Unsupported(f"decode context parallelism (dcp_size={host.dcp_size}) is left to SGLang")


def _owned_range(device_pool: Any) -> tuple[int, int] | None:
    if device_pool is None or not getattr(device_pool, "layer_shard_enabled", False):
        return None
    start, end = device_pool._owned_local_layer_range()
    return int(start), int(end)


def _describe_mla(host: Any, device_pool: Any) -> Described:
    if getattr(host, "_native_buffers", None) is not None:
        raise Unsupported("NPU-native MLA buffers (MLASplitBuffers) are left to SGLang")
    n_dev, n_draft = int(host._device_layer_num), int(host._draft_layer_num)
    owned = tuple(int(x) for x in host._target_layer_indices)
    sharded = bool(host._layer_shard_enabled)
    if device_pool is not None:
        if device_pool.layer_num != n_dev:
            raise Unsupported(f"device pool has {device_pool.layer_num} layers, the host pool was built for {n_dev}")
        rng = _owned_range(device_pool)
        if bool(rng) != sharded or (rng and tuple(range(*rng)) != owned):
            raise Unsupported(f"device pool ownership {rng} disagrees with the host pool's layers {owned}")
        if sharded and host.target_layer_num != math.ceil(n_dev / device_pool.layer_shard_size):
            raise Unsupported("host target_layer_num is not ceil(layers / shards)")
    layers: list[torch.Tensor | None] = [None] * (n_dev + n_draft)
    for i, layer in enumerate(owned):
        layers[layer] = device_pool.kv_buffer[layer] if device_pool is not None else host.device_kv_buffers[i]
    for d in range(n_draft):
        layers[n_dev + d] = host.device_kv_buffers[len(owned) + d]
    # packed drafts sit after SGLang's target_layer_num host layers, past any padding slot
    slots = tuple(range(len(owned))) + tuple(int(host.target_layer_num) + d for d in range(n_draft))
    lmap = LayerMap(owned + tuple(range(n_dev, n_dev + n_draft)), int(host.layer_num), n_dev + n_draft, sharded,
                    host_slots=slots)
    item = host.dtype.itemsize
    natural = host.kv_lora_rank + host.qk_rope_head_dim
    packed = host.kv_cache_dim != natural or bool(getattr(host, "dsa_kv_cache_store_fp8", False))
    spec = PoolSpec.mla(
        layer_map=lmap, kv_lora_rank=host.kv_lora_rank, qk_rope_head_dim=host.qk_rope_head_dim, dtype=host.dtype,
        page_size=host.page_size, capacity=host.size, row_bytes=host.kv_cache_dim * item if packed else None,
        device=_dev_of({"kv": layers}),
    )
    hb = {"kv": getattr(host, "kv_buffer", None)}
    if host.layout == "page_first_kv_split":
        hb = {"kv": host.k_buffer, "latent": host.k_buffer, "rope": getattr(host, "v_buffer", None)}
    return Described("mla", spec, {"kv": layers}, _host_buffers(host, hb),
                     frozenset(owned), frozenset(range(n_dev, n_dev + n_draft)))


def _host_buffers(host: Any, sglang: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Our host buffers: those we allocated for a plugin layout (:mod:`.plugin_layouts`), else SGLang's tensors."""
    ours = host.__dict__.get(HOST_BUFFERS_ATTR)
    return dict(ours) if ours is not None else {k: v for k, v in sglang.items() if v is not None}


def mha_spec(host: Any, device: torch.device) -> PoolSpec:
    """The spec of an SGLang MHA host pool (target layers then packed drafts) on ``device``."""
    n_dev = int(host.target_layer_num)
    return PoolSpec.mha(
        layer_map=LayerMap.unsharded(n_dev, draft_layers=int(host.layer_num) - n_dev), head_num=host.head_num,
        head_dim=host.head_dim, v_head_dim=host.v_head_dim, dtype=host.dtype, page_size=host.page_size,
        capacity=host.size, device=device,
    )


def _describe_mha(host: Any, device_pool: Any) -> Described:
    if getattr(host, "_buffer_infos", (None,))[0] is not None and host._buffer_infos[0].scales is not None:
        raise Unsupported("MHA pools with KV scales are left to SGLang")
    n_dev = int(host.target_layer_num)
    n_draft = int(host.layer_num) - n_dev
    if device_pool is not None:
        if getattr(device_pool, "layer_shard_enabled", False):
            raise Unsupported("SGLang 0.5.23 has no layer-sharded MHA host pool")
        if device_pool.layer_num != n_dev or getattr(device_pool, "k_buffer", None) is None:
            raise Unsupported("device pool does not match the host pool's target layers")
        k = list(device_pool.k_buffer[:n_dev]) + list(host.device_k_buffers[n_dev:])
        v = list(device_pool.v_buffer[:n_dev]) + list(host.device_v_buffers[n_dev:])
    else:
        k, v = list(host.device_k_buffers), list(host.device_v_buffers)
    spec = mha_spec(host, _dev_of({"k": k}))
    return Described("mha", spec, {"k": k, "v": v}, _host_buffers(host, {"k": host.k_buffer, "v": host.v_buffer}),
                     frozenset(range(n_dev)), frozenset(range(n_dev, n_dev + n_draft)))


def _describe_indexer(host: Any, device_pool: Any) -> Described:
    dp = host.device_pool
    if device_pool is not None and device_pool is not dp:
        raise Unsupported("device pool is not the indexer host pool's own device pool")
    live = tuple(int(x) for x in host._live_target_layers)
    drafts = tuple(host.mtp_draft_device_pools)
    n_dev = int(dp.layer_num)
    layers: list[torch.Tensor | None] = [None] * (n_dev + len(drafts))
    for layer in live:
        layers[layer] = dp.index_k_with_scale_buffer[layer]
    for d, pool in enumerate(drafts):
        if len(pool.index_k_with_scale_buffer) != 1:
            raise Unsupported("packed draft indexer pools must hold one layer")
        layers[n_dev + d] = pool.index_k_with_scale_buffer[0]
    lmap = LayerMap(live + tuple(range(n_dev, n_dev + len(drafts))), int(host.layer_num), n_dev + len(drafts),
                    bool(getattr(dp, "layer_shard_enabled", False)))
    width = int(host.indexer_page_stride_size) * host.indexer_dtype.itemsize
    comp = Component("index_k", width, host.indexer_dtype)
    spec = PoolSpec(MLA, (comp,), lmap, 1, int(host.indexer_page_num), _dev_of({"i": layers}))
    return Described("dsa_indexer", spec, {"index_k": layers}, {"index_k": host.index_k_with_scale_buffer},
                     frozenset(live), frozenset(range(n_dev, n_dev + len(drafts))), page_indices=True)


def describe(host: Any, device_pool: Any = None) -> Described:
    """Our view of ``host`` (and ``device_pool``; ``None``: the tensors the host pool captured).

    :raises Unsupported: the pool is outside what the bridge serves (the reason says why).
    """
    kind = pool_kind(host)
    if kind is None:
        raise Unsupported(f"{type(host).__qualname__} is not a pool class the bridge understands")
    _common_checks(host)
    return {"mla": _describe_mla, "mha": _describe_mha, "dsa_indexer": _describe_indexer}[kind](host, device_pool)


def _reshape_host(plan_buffers: Sequence[Any], found: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for b in plan_buffers:
        t = found.get(b.name)
        if t is None:
            raise Unsupported(f"SGLang host pool has no tensor for our buffer {b.name!r}")
        if t.dtype != b.dtype or not t.is_contiguous() or t.numel() != math.prod(b.shape):
            raise Unsupported(
                f"SGLang host tensor for {b.name!r} is {t.dtype} {tuple(t.shape)}, our layout plans {b.dtype} {b.shape}"
            )
        out[b.name] = t.view(b.shape)
    return out


@dataclass
class Bridge:
    """The outcome of resolving one (host pool, device pool, io_backend): a pool or a reason."""

    device_pool: Any
    described: Described | None = field(default=None, repr=False)
    pool: HostKVPool | None = None
    reason: str | None = None
    #: the operations whose outcome on this bridge's cell was logged (``hooks._serving``: once, not per call)
    told: set[str] = field(default_factory=set, repr=False)

    def device_layer(self, layer_id: int, is_draft: bool) -> int | None:
        """Our device layer id for SGLang's (``layer_id``, ``is_draft``); ``None`` when not owned here.

        Drafts keep SGLang's controller id ``target_device_layer_num + depth``
        (host slot ``target_layer_num + depth``, as DSA's ``_draft_host_layer``).
        """
        d = self.described
        assert d is not None
        if is_draft:
            return layer_id if layer_id in d.draft_ids else None
        return layer_id if layer_id in d.target_layers else None


def _validate_level() -> str:
    """The bridged pools' validation level: ``$HICACHE_VALIDATE`` (:func:`~hicache_core.pool.validate_level`), default
    :data:`ENV_VALIDATE_DEFAULT`; ``strict`` counts as ``full`` (SGLang allocates the host slots itself, so none is
    ever in hicache's allocator).  A value that names no level counts as the default, logged once at ERROR (as the
    bridge's other settings: a cell SGLang cannot serve keeps being served, rather than failing every call)."""
    raw = os.environ.get(ENV_VALIDATE, "")
    try:
        level = validate_level(raw.strip() or ENV_VALIDATE_DEFAULT)
    except SpecError:
        log_once(logger, logging.ERROR, f"hicache: {ENV_VALIDATE}={raw!r} is not a level: use 'shapes', 'full' or "
                 f"'strict'; bridged pools use {ENV_VALIDATE_DEFAULT!r}")
        return ENV_VALIDATE_DEFAULT
    if level == "strict":
        log_once(logger, logging.WARNING, f"hicache: {ENV_VALIDATE}=strict checks host slots against hicache's "
                 "allocator, but SGLang allocates them: bridged pools use 'full'")
        return "full"
    return level


def _build(host: Any, device_pool: Any, io_backend: str) -> Bridge:
    bridge = Bridge(device_pool)
    try:
        d = describe(host, device_pool)
        reg = default_registry()
        layout = reg.layout(host.layout)
        plan = layout.plan(d.spec)
        host_buffers = _reshape_host(plan.buffers, d.host_buffers)
        validate = _validate_level()
        bridge.described = d
        bridge.pool = HostKVPool(d.spec, host.layout, io_backend, d.device_buffers,
                                 host_buffers=host_buffers, registry=reg, validate=validate)
        logger.info("hicache: %s %s (layout=%s, hicache io_backend=%s, sharded=%s) served by %s",
                    type(host).__qualname__, d.spec.describe(), host.layout, io_backend, d.spec.sharded,
                    bridge.pool.strategy_name)
    except (Unsupported, HicacheError) as exc:
        bridge.pool, bridge.reason = None, f"{type(exc).__name__}: {exc}"
        # the user's setting (itself, or what made the strategy fail to load), not the cell: said where it is seen
        setting = isinstance(exc, ConfigError) or isinstance(exc.__cause__, ConfigError)
        logger.log(logging.WARNING if setting else logging.INFO, "hicache: %s (layout=%s): hicache io_backend %r "
                   "cannot serve this pool: %s", type(host).__qualname__, getattr(host, "layout", "?"), io_backend,
                   _without_inventory(bridge.reason))
    except Exception as exc:  # SGLang attribute drift, a failing kernel set-up: never break SGLang's transfer
        bridge.pool, bridge.reason = None, f"{type(exc).__name__}: {exc}"
        logger.warning("hicache: %s (layout=%s): hicache io_backend %r cannot serve this pool after an unexpected "
                       "error", type(host).__qualname__, getattr(host, "layout", "?"), io_backend, exc_info=True)
    return bridge


def _without_inventory(report: str) -> str:
    """A resolution report without its inventory of installed layouts and io_backends (20 lines in a log), keeping
    the rejections, the alternatives and a near match of an unknown name after it."""
    head, sep, rest = report.partition("\ninstalled layouts:")
    return head + "".join(f"\n{line}" for line in rest.splitlines() if line.startswith("did you mean")) if sep else report


def bridge_for(host: Any, device_pool: Any, io_backend: str) -> Bridge:
    """The cached :class:`Bridge` of ``host`` for ``device_pool`` and the hicache ``io_backend`` (built on first use).

    Cached on the SGLang object, keyed by the device pool's identity (``None``:
    the device tensors the host pool captured at construction).
    """
    cache = host.__dict__.setdefault(_CACHE_ATTR, {})
    key = (id(device_pool), io_backend)
    hit = cache.get(key)
    if hit is None or hit.device_pool is not device_pool:
        with _BUILD_LOCK:  # SGLang's load and backup threads may both arrive first
            hit = cache.get(key)
            if hit is None or hit.device_pool is not device_pool:
                hit = cache[key] = _build(host, device_pool, io_backend)
    return hit

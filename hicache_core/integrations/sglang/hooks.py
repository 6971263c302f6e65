"""AROUND hooks on SGLang's host-pool methods (registered by :mod:`.plugin`).

Each hook asks :func:`~.adapter.bridge_for` for our pool serving the call's
(host pool, device pool, io_backend); when the mode or the resolution says no,
SGLang's original method runs with the original arguments.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, cast

import torch

from ...errors import TransferArgumentError
from ...logonce import log_once
from ...pool import HostKVPool
from ...registry import Registry, default_registry
from .adapter import Bridge, bridge_for, pool_kind
from .buffers import init_kv_split_buffer, wants_kv_split_takeover
from .plugin_layouts import init_plugin_layout, wants_plugin_layout
from . import mode as _mode
from .mode import BACKUP, BACKUP_LAYER, ENV_KERNEL, ENV_MODE, IO_BACKENDS, LOAD, current_mode, hicache_io_backend, stock_serves
from .takeover import ENV_TABLE, Cell, TakeoverTableError, active_table, table_path

__all__ = ["backup_all", "load_layer", "backup_layer_mla", "backup_layer_indexer", "init_kv_buffer"]

logger = logging.getLogger(__name__)
_resolved: dict[tuple[Any, ...], str | None] = {}  # (registry, layout, chosen, io_backend, gap, sharded) -> io_backend
#: The hicache io_backend of last resort for cells SGLang cannot serve (generic: serves every layout).
GAP_FALLBACK = "direct"


def _sharded(host: Any, kind: str) -> bool:
    if kind == "mla":
        return bool(host._layer_shard_enabled)
    if kind == "dsa_indexer":
        return bool(getattr(host.device_pool, "layer_shard_enabled", False))
    return False


#: The decision of :func:`_backend` by everything it depends on (environment included): SGLang's own cells pay
#: one lookup per call, not the mode, table and registry walk (~5 us of Python per call otherwise).
_decided: dict[tuple[Any, ...], tuple[str | None, bool]] = {}
_ENV_NAMES = (ENV_MODE, ENV_KERNEL, ENV_TABLE)
_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's own dict behind os.environ (bytes keys on POSIX)
_ENV_KEYS = tuple(os.environ.encodekey(n) for n in _ENV_NAMES) if hasattr(os.environ, "encodekey") else ()


_FAST_ENV = isinstance(_ENV_DATA, dict) and len(_ENV_KEYS) == 3
#: Per host pool object: ``(io_backend, op)`` -> (everything the decision read, the decision): a call compares what it
#: reads with what the decision read, rather than hashing the global memo's key (the registry object among its parts).
_HOST_DECIDED = "_hicache_decided"


def _env_key() -> tuple[Any, ...]:
    """The environment variables the decision reads, as they are now (every os.environ write shows here)."""
    if _FAST_ENV:  # unrolled: this runs on every hooked call
        data, (a, b, c) = cast(dict, _ENV_DATA), _ENV_KEYS
        return data.get(a), data.get(b), data.get(c)
    return tuple(os.environ.get(n) for n in _ENV_NAMES)


def _backend(host: Any, kind: str, io_backend: str, op: str) -> str | None:
    """The hicache io_backend for this call per the mode (and table) (:func:`_decision`)."""
    return _decision(host, kind, io_backend, op)[0]


def _decision(host: Any, kind: str, io_backend: str, op: str) -> tuple[str | None, bool]:
    """The hicache io_backend for this call per the mode (and table), and whether the cell is one SGLang cannot serve.

    When the chosen one has no strategy for the layout: the exact mapping, then,
    for a cell SGLang cannot serve at all (a plugin layout with no kernel under
    SGLang's default ``kernel`` io, say), the core's generic ``direct``.  Decided once per cell, mode,
    environment, registry and availability of SGLang's stock kernels (under ``measured``, a broken takeover table
    is re-read on every call until it is fixed).
    """
    sharded = _sharded(host, kind)
    jit, packed = _jit_packed(host, kind)
    registry, layout = default_registry(), host.layout
    check = (layout, sharded, jit, packed, registry, _mode.stock_kernels_available(kind), _env_key())
    own = getattr(host, "__dict__", None)
    per_host = own.get(_HOST_DECIDED) if own is not None else None
    if per_host is not None and (seen := per_host.get((io_backend, op))) is not None and seen[0] == check:
        return seen[1]
    memo = (kind, io_backend, op, *check)
    try:
        decided = _decided[memo]
    except KeyError:
        pass
    else:
        _remember(own, io_backend, op, check, decided)
        return decided
    hit, gap = None, False
    mode = current_mode()
    chosen = hicache_io_backend(mode, kind, host.layout, io_backend, sharded, op, can_use_jit=jit, rows_packed=packed)
    if chosen is not None:
        gap = not stock_serves(kind, host.layout, io_backend, sharded, op, can_use_jit=jit, rows_packed=packed)
        key = (registry, host.layout, chosen, io_backend, gap, sharded)
        if key in _resolved:
            hit = _resolved[key]
        else:
            origin = _origin(mode, kind, host.layout, io_backend, sharded, op, chosen)
            hit = _resolved[key] = _registered(registry, host.layout, chosen, io_backend, gap, sharded, origin)
    if mode != "measured" or _table_readable():  # only "measured" reads the table
        _decided[memo] = (hit, gap)
        _remember(own, io_backend, op, check, (hit, gap))
    return hit, gap


def _remember(own: dict | None, io_backend: str, op: str, check: tuple[Any, ...],
              decided: tuple[str | None, bool]) -> None:
    """Keep ``decided`` on the host pool object (``own``: its ``__dict__``) for its next calls of ``(io_backend, op)``."""
    if own is None:
        return
    per_host = own.get(_HOST_DECIDED)
    if per_host is None:
        per_host = own[_HOST_DECIDED] = {}
    per_host[(io_backend, op)] = (check, decided)


def _jit_packed(host: Any, kind: str) -> tuple[bool, bool]:
    """The host pool's ``can_use_jit`` and ``device_rows_packed`` (SGLang 0.5.23; absent: no JIT, packed rows); for a
    DSA indexer pool, whether its page stride suits SGLang's indexer kernels (a multiple of 8 elements: ROCm's
    legacy DSA path with 1-token pages has 132)."""
    if kind == "dsa_indexer":
        stride = getattr(host, "indexer_page_stride_size", None)
        return False, stride is None or int(stride) % 8 == 0
    try:
        packed = bool(host.device_rows_packed)
    except AttributeError:
        packed = True
    return bool(getattr(host, "can_use_jit", False)), packed


def _table_readable() -> bool:
    try:
        active_table()
    except TakeoverTableError:
        return False
    return True


def _origin(mode: str, kind: str, layout: str, io_backend: str, sharded: bool, op: str, chosen: str) -> str:
    """Which setting named ``chosen`` for this cell, for the messages of :func:`_registered` ("" for the exact
    mapping)."""
    if mode == "measured":
        cell = Cell(kind, layout, io_backend, sharded, LOAD if op == LOAD else BACKUP)
        try:
            if active_table().serving(cell) == chosen:
                return f"the takeover table {table_path()} names it as this cell's hicache_io_backend"
        except TakeoverTableError:
            pass
    if io_backend == "kernel" and chosen != IO_BACKENDS[io_backend]:
        return f"{ENV_KERNEL} names it"
    return ""


def _registered(registry: Registry, layout: str, chosen: str, io_backend: str, gap: bool,
                sharded: bool, origin: str = "") -> str | None:
    """The hicache io_backend that serves: ``chosen`` where it has a strategy for the layout.  Else, for a cell SGLang
    cannot serve, the exact mapping of SGLang's io_backend, then the core's generic ``direct``; for a cell SGLang
    serves, ``None`` where ``chosen`` is other than the exact mapping (a takeover table's or
    ``HICACHE_SGLANG_KERNEL``'s choice, measured for that io_backend only: SGLang keeps the cell, with a warning)."""
    exact = IO_BACKENDS[io_backend]
    if not gap and chosen != exact and not registry.candidates(layout, chosen, sharded):
        installed = ", ".join(repr(b) for b in registry.io_backends if registry.candidates(layout, b, sharded))
        logger.warning("hicache: no %r strategy for layout %r (sharded=%s) is installed%s (installed: %s); SGLang %r "
                       "calls stay SGLang's (the takeover was measured for %r only)", chosen, layout, sharded,
                       f": {origin}" if origin else "", installed or "none", io_backend, chosen)
        return None
    for backend in dict.fromkeys((chosen, exact, GAP_FALLBACK if gap else chosen)):
        if registry.candidates(layout, backend, sharded):
            if backend != chosen:
                logger.info("hicache: no %r strategy for layout %r%s; SGLang %r calls use hicache %r", chosen,
                            layout, f" ({origin})" if origin else "", io_backend, backend)
            return backend
    return chosen  # nothing registered: the build fails, is logged, and SGLang's original runs


def _serving(host: Any, device_pool: Any, io_backend: str, op: str, *,
             is_draft: bool = False) -> tuple[Bridge | None, bool]:
    """The bridge serving this call, or ``None`` (SGLang's original runs), and whether SGLang cannot serve the cell.

    Draft transfers pass the draft's own device pool; the bridge of the target
    device pool (DSA indexer) or of the captured tensors (MLA/MHA, which SGLang
    itself uses for drafts) already holds the draft's layer.
    """
    kind = pool_kind(host)
    if kind is None:
        return None, False
    backend, gap = _decision(host, kind, io_backend, op)
    if backend is None:
        return None, gap
    if kind == "dsa_indexer" and any(p is device_pool for p in host.mtp_draft_device_pools):
        device_pool = host.device_pool
    elif is_draft and kind != "dsa_indexer":
        device_pool = None
    bridge = chosen = bridge_for(host, device_pool, backend)
    if bridge.pool is None and gap and backend != GAP_FALLBACK:
        # a cell SGLang cannot serve, whose chosen strategy is registered but cannot serve this pool (e.g. a kernel
        # without Triton here): the core's generic copy engine, rather than SGLang's certain error
        bridge = bridge_for(host, device_pool, GAP_FALLBACK)
    if chosen.pool is None and op not in chosen.told:  # what became of the cell, once per operation (not per call)
        chosen.told.add(op)
        cell = f"hicache: {type(host).__qualname__} (layout={getattr(host, 'layout', '?')}) SGLang {io_backend!r} {op}"
        if bridge.pool is not None:
            logger.info("%s calls: hicache %r cannot serve this pool and SGLang cannot serve the cell: hicache %r "
                        "serves them", cell, backend, GAP_FALLBACK)
        else:
            logger.info("%s calls left to SGLang: %s", cell, (chosen.reason or "no reason recorded").splitlines()[0])
    return (bridge, gap) if bridge.pool is not None else (None, gap)


def _indices(bridge: Bridge, host: Any, host_indices: torch.Tensor, device_indices: torch.Tensor):
    """DSA indexer transfers move one row per page: SGLang's ``_get_indexer_page_indices``."""
    if bridge.described is None or not bridge.described.page_indices or host_indices.numel() == 0:
        return host_indices, device_indices
    return host._get_indexer_page_indices(host_indices, device_indices)


def _pool(bridge: Bridge) -> HostKVPool:
    """The pool of a serving bridge (:func:`_serving` only returns bridges that have one)."""
    return cast(HostKVPool, bridge.pool)


def _or_original(run: Callable[[], object], original: Callable[[], Any], gap: bool) -> Any:
    """Run our transfer; on a call we cannot take (e.g. HiSparse's one-token, not-whole-page
    backups), SGLang's original runs instead.  Our argument checks raise before any byte
    moves, so nothing is moved twice.  On a cell SGLang cannot serve (``gap``) its original
    raises for the cell ('Unsupported layout'), not for the call: our error, which names the
    argument, is raised instead (SGLang's chained and noted)."""
    try:
        run()
    except TransferArgumentError as exc:
        logger.debug("hicache: call left to SGLang: %s", exc)
        try:
            return original()
        except Exception as theirs:
            if not gap:  # a cell SGLang serves: its own error is the one to read
                raise
            if hasattr(exc, "add_note"):  # Python >= 3.11
                text = str(theirs).splitlines()
                exc.add_note(f"(hicache handed the call to SGLang's own routine, which cannot serve this cell: "
                             f"{type(theirs).__name__}: {text[0] if text else ''})")
            raise exc from theirs
    return None


def backup_all(original: Callable, self: Any, device_pool: Any, host_indices: torch.Tensor,
               device_indices: torch.Tensor, io_backend: str) -> None:
    """``backup_from_device_all_layer``: every owned layer (and packed draft) in one call to our strategy."""
    bridge, gap = _serving(self, device_pool, io_backend, BACKUP)
    if bridge is None:
        return original(self, device_pool, host_indices, device_indices, io_backend)
    h, d = _indices(bridge, self, host_indices, device_indices)
    return _or_original(lambda: _pool(bridge).backup_all_layers(h, d),
                        lambda: original(self, device_pool, host_indices, device_indices, io_backend), gap)


def load_layer(original: Callable, self: Any, device_pool: Any, host_indices: torch.Tensor,
               device_indices: torch.Tensor, layer_id: int, io_backend: str, *, is_draft: bool = False) -> None:
    """``load_to_device_per_layer``: one layer; layers this rank does not own return without moving."""
    bridge, gap = _serving(self, device_pool, io_backend, LOAD, is_draft=is_draft)
    if bridge is None:
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)
    layer = bridge.device_layer(int(layer_id), is_draft)
    if layer is None:
        return _unmapped(is_draft, lambda: original(self, device_pool, host_indices, device_indices, layer_id,
                                                    io_backend, is_draft=is_draft))
    h, d = _indices(bridge, self, host_indices, device_indices)
    return _or_original(lambda: _pool(bridge).load_layer(layer, h, d),
                        lambda: original(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                         is_draft=is_draft), gap)


def _backup_one(bridge: Bridge, gap: bool, host: Any, host_indices, device_indices, layer_id: int, is_draft: bool,
                original: Callable[[], Any]) -> Any:
    layer = bridge.device_layer(int(layer_id), is_draft)
    if layer is None:
        return _unmapped(is_draft, original)
    h, d = _indices(bridge, host, host_indices, device_indices)
    return _or_original(lambda: _pool(bridge).backup_layer(layer, h, d), original, gap)


def _unmapped(is_draft: bool, original: Callable[[], Any]) -> Any:
    """A per-layer call naming no layer the bridge maps: a layer this rank does not own returns without moving
    (SGLang's pools return early for those too); a draft call naming no packed draft layer is SGLang's to answer
    (its MLA and MHA pools read the id as a host layer), not silently dropped."""
    if not is_draft:
        return None
    log_once(logger, logging.WARNING, "hicache: a draft transfer named a layer that is no packed draft layer of its "
             "host pool; SGLang's own code serves it")
    return original()


def backup_layer_mla(original: Callable, self: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                     layer_id: int, io_backend: str, *, is_draft: bool = False) -> None:
    """MLA ``_backup_from_device_per_layer`` (sharded path; no device pool is passed: captured tensors serve)."""
    bridge, gap = _serving(self, None, io_backend, BACKUP_LAYER, is_draft=is_draft)
    if bridge is None:
        return original(self, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)
    return _backup_one(bridge, gap, self, host_indices, device_indices, layer_id, is_draft,
                       lambda: original(self, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft))


def backup_layer_indexer(original: Callable, self: Any, device_pool: Any, host_indices: torch.Tensor,
                         device_indices: torch.Tensor, layer_id: int, io_backend: str, *, is_draft: bool = False) -> None:
    """DSA indexer ``_backup_from_device_per_layer`` (the sharded path; drafts pass their own device pool)."""
    bridge, gap = _serving(self, device_pool, io_backend, BACKUP_LAYER)
    if bridge is None:
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)
    return _backup_one(bridge, gap, self, host_indices, device_indices, layer_id, is_draft,
                       lambda: original(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                        is_draft=is_draft))


def init_kv_buffer(original: Callable, self: Any) -> Any:
    """``init_kv_buffer``: allocate ``page_first_kv_split`` where SGLang cannot (CUDA/CPU) and every
    hicache plugin layout SGLang does not know; else SGLang's."""
    if current_mode() == "off":
        return original(self)
    if wants_kv_split_takeover(self):
        return init_kv_split_buffer(self)
    if wants_plugin_layout(self):
        return init_plugin_layout(self)
    return original(self)

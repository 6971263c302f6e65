"""The takeover switch and SGLang 0.5.23's own support matrix.

``HICACHE_SGLANG`` (read at every call, so it can change at run time):

``measured`` (default)
    the cells SGLang cannot serve (as ``gaps``) plus the cells the takeover
    table (:mod:`.takeover`) marks as measured better; the table may also name
    the hicache io_backend that serves a cell (SGLang ``kernel`` served by
    hicache ``direct``, say).
``all``
    our strategies serve every (layout, io_backend, sharded) cell they resolve.
``gaps``
    only cells SGLang's stock code cannot serve: the ``ValueError`` cells of its
    dispatch matrix, plus every cell whose stock kernels are not importable on
    this platform (``sgl_kernel.kvcacheio`` is only imported on CUDA/HIP, so on
    a CPU-only host every stock transfer fails).
``off``
    SGLang's original methods run, unchanged (including ``init_kv_buffer``).

``HICACHE_SGLANG_KERNEL`` (read at every call) names the hicache io_backend that
serves SGLang ``kernel`` calls wherever the takeover table names none: ``kernel``
(default: hicache's Triton kernels, the same mechanism) or ``auto`` (the copy
engine where every block it would copy is large enough, as in the all-layer
backups of the benchmarked pools; the layout's kernel otherwise).
"""

from __future__ import annotations

import logging
import os
import sys

from ...envflags import OFF, ON
from ...logonce import log_once
from ...errors import ConfigError, TakeoverTableError
from .takeover import Cell, active_table

__all__ = [
    "ENV_MODE", "MODES", "DEFAULT_MODE", "IO_BACKENDS", "ENV_KERNEL", "KERNEL_BACKENDS", "parse_mode", "current_mode",
    "kernel_backend", "stock_serves", "stock_kernels_available", "hicache_io_backend",
]

logger = logging.getLogger(__name__)

ENV_MODE = "HICACHE_SGLANG"
MODES = ("measured", "all", "gaps", "off")
DEFAULT_MODE = "measured"

#: SGLang io_backend -> the hicache io_backend of the same mechanism (``all``/``gaps``,
#: and ``measured`` cells the table does not re-map).  ``kernel_ascend`` has none.
IO_BACKENDS = {"kernel": "kernel", "direct": "direct"}

ENV_KERNEL = "HICACHE_SGLANG_KERNEL"
#: What may serve SGLang ``kernel`` calls the takeover table does not assign (the first is the default).
KERNEL_BACKENDS = ("kernel", "auto")

#: Operations as the bridge names them.
BACKUP, BACKUP_LAYER, LOAD = "backup", "backup_layer", "load"

_POOL_MODULES = {
    "mla": "sglang.srt.mem_cache.pool_host.mla",
    "mha": "sglang.srt.mem_cache.pool_host.mha",
    "dsa_indexer": "sglang.srt.mem_cache.pool_host.dsa",
}
def _error_once(message: str) -> None:
    """Log ``message`` at ERROR the first time this process sees it (settings are read at every call)."""
    log_once(logger, logging.ERROR, message)


def parse_mode(value: str | None) -> str:
    """The mode named by ``value`` (case and surrounding blanks ignored; empty or ``None``: the default; ``0``,
    ``false``, ``no`` and ``off`` mean ``off``; ``1``, ``true``, ``yes`` and ``on`` the default).

    :raises ConfigError: ``value`` names no mode.
    """
    mode = (value or "").strip().lower() or DEFAULT_MODE
    if mode in OFF:  # 0, false, no: off, as every hicache on/off switch reads them
        mode = "off"
    elif mode in ON:  # 1, true, yes, on: hicache on, as it is by default
        mode = DEFAULT_MODE
    if mode not in MODES:
        raise ConfigError(f"{ENV_MODE}={value!r} is not a mode; use one of {', '.join(MODES)} (off: also 0, false, "
                          f"no; 1, true, yes, on: {DEFAULT_MODE})")
    return mode


def current_mode() -> str:
    """The takeover mode from :data:`ENV_MODE`; an unknown value counts as the default (logged once)."""
    value = os.environ.get(ENV_MODE)
    try:
        return parse_mode(value)
    except ConfigError as exc:
        _error_once(f"{exc}; using {DEFAULT_MODE!r}")
        return DEFAULT_MODE


def kernel_backend() -> str:
    """The hicache io_backend for SGLang ``kernel`` calls the table does not assign (:data:`ENV_KERNEL`);
    an unknown value counts as ``kernel`` (logged once)."""
    value = os.environ.get(ENV_KERNEL)
    choice = (value or "").strip().lower() or KERNEL_BACKENDS[0]
    if choice in KERNEL_BACKENDS:
        return choice
    _error_once(f"{ENV_KERNEL}={value!r}: use one of {', '.join(KERNEL_BACKENDS)}; using {KERNEL_BACKENDS[0]!r}")
    return KERNEL_BACKENDS[0]


def stock_kernels_available(kind: str) -> bool:
    """Whether the stock kvcacheio ops are bound in SGLang's pool module of ``kind``.

    SGLang imports them from ``sgl_kernel`` only when CUDA or HIP is present;
    otherwise the names are unbound and every stock transfer raises ``NameError``.
    """
    mod = sys.modules.get(_POOL_MODULES.get(kind, ""))
    return mod is not None and "transfer_kv_direct" in vars(mod)


def _strided_rows_cell(layout: str, io_backend: str, can_use_jit: bool) -> bool:
    """Whether SGLang 0.5.23 may serve a cell of an MLA/MHA pool whose device rows are strided: its JIT kernels
    (``kernel`` io; not ``page_head``, whose kernels need packed rows), or ``direct``'s ``layer_first`` (tensor copies);
    every other route raises ``NotImplementedError`` (``_require_packed_device_rows``)."""
    if io_backend == "kernel":
        return can_use_jit and layout != "page_head"
    return io_backend == "direct" and layout == "layer_first"


def _mla_cell(layout: str, io_backend: str, sharded: bool, op: str, can_use_jit: bool) -> bool:
    backup = op in (BACKUP, BACKUP_LAYER)
    if io_backend == "kernel":
        if layout == "layer_first":
            return True
        if layout == "page_first":
            return not (backup and sharded) or can_use_jit
        return False
    if io_backend == "direct":
        if layout == "layer_first":
            return True
        if layout == "page_first_direct":
            return not (backup and sharded)
    return False


def _mha_cell(layout: str, io_backend: str) -> bool:
    if io_backend == "kernel":
        return layout in ("layer_first", "page_first", "page_head")
    if io_backend == "direct":
        return layout in ("layer_first", "page_first_direct")
    return False


def _indexer_cell(layout: str, io_backend: str, sharded: bool, op: str) -> bool:
    backup = op in (BACKUP, BACKUP_LAYER)
    if layout == "layer_first":
        return io_backend in ("kernel", "direct")
    want = {"kernel": "page_first", "direct": "page_first_direct"}.get(io_backend)
    return layout == want and not (backup and sharded)


def stock_serves(
    kind: str, layout: str, io_backend: str, sharded: bool, op: str, *, can_use_jit: bool = False,
    kernels_available: bool | None = None, rows_packed: bool = True,
) -> bool:
    """Whether SGLang 0.5.23's stock code serves this cell on this platform.

    :param kind: ``mla``, ``mha`` or ``dsa_indexer``.
    :param op: ``backup`` (all layers), ``backup_layer`` (sharded per layer) or ``load``.
    :param can_use_jit: the host pool's ``can_use_jit`` (MLA sharded page_first backup needs it).
    :param kernels_available: override :func:`stock_kernels_available` (tests).
    :param rows_packed: the host pool's ``device_rows_packed`` (``False``: device rows strided, e.g. with
        ``--enable-unified-memory``: SGLang's AOT kernels then refuse, so only its JIT kernels and the tensor-based
        ``direct`` copy of ``layer_first`` serve).  For ``dsa_indexer``: whether its page stride is a multiple of 8
        elements, which SGLang's indexer kernels need (otherwise its ``kernel`` calls raise ``Unsupported IO backend``:
        ``dsa.py``'s ``use_kernel``).
    """
    avail = stock_kernels_available(kind) if kernels_available is None else kernels_available
    if not avail:
        return False
    if not rows_packed and kind in ("mla", "mha") and not _strided_rows_cell(layout, io_backend, can_use_jit):
        return False
    if kind == "mla":
        return _mla_cell(layout, io_backend, sharded, op, can_use_jit)
    if kind == "mha":
        return _mha_cell(layout, io_backend)
    if kind == "dsa_indexer":
        return _indexer_cell(layout, io_backend, sharded, op) and (rows_packed or io_backend != "kernel")
    return False


def _table_backend(cell: Cell) -> str | None:
    """What the takeover table assigns to ``cell``; a broken table assigns nothing (logged once per message)."""
    try:
        return active_table().serving(cell)
    except TakeoverTableError as exc:
        table_error(exc)
        return None


def table_error(exc: Exception) -> None:
    """Log a takeover table's error at ERROR, once per message (at the plugin's load and at every later call)."""
    _error_once(f"hicache: {exc}. The plugin is loaded: until the table is fixed it serves only the cells SGLang "
                "cannot")


def hicache_io_backend(
    mode: str, kind: str, layout: str, io_backend: str, sharded: bool, op: str, *, can_use_jit: bool = False,
    kernels_available: bool | None = None, rows_packed: bool = True,
) -> str | None:
    """The hicache io_backend that serves this call, or ``None`` (SGLang's original runs).

    :param mode: one of :data:`MODES`.
    :param io_backend: SGLang's io_backend of the call.
    :param op: ``backup``, ``backup_layer`` or ``load`` (the table's ``backup`` covers both backups).
    Other parameters as :func:`stock_serves`.  Where the table assigns nothing, SGLang ``kernel``
    maps to :func:`kernel_backend` and ``direct`` to ``direct``.  The caller falls back to
    :data:`IO_BACKENDS` when the chosen io_backend has no strategy for the key.
    """
    if mode == "off" or io_backend not in IO_BACKENDS:
        return None
    exact = kernel_backend() if io_backend == "kernel" else IO_BACKENDS[io_backend]
    if mode == "all":
        return exact
    gap = not stock_serves(kind, layout, io_backend, sharded, op, can_use_jit=can_use_jit,
                           kernels_available=kernels_available, rows_packed=rows_packed)
    if mode == "measured":
        cell = Cell(kind, layout, io_backend, sharded, LOAD if op == LOAD else BACKUP)
        chosen = _table_backend(cell)
        if chosen is not None:
            return chosen
    return exact if gap else None

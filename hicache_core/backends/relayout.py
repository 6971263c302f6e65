"""The staged route's relayout as one Triton launch per segment group per chunk.

The torch relayout of :mod:`.staging` issues two launches (gather, strided
copy) per layer entry and chunk; on an H200 host that is ~10 us each, so a
61-layer MLA backup spends over a millisecond of host time per chunk.  Here the
segments of a staged route are grouped by row chunk width, and one launch of
:func:`._relayout_kernel.relayout_kernel` moves every row of every entry of a
group between the device rows and the chunk's page image.

Per-entry tables (int64, on the pool's device) are built once per pool and
layer selection (cached in the binding's scratch): they do not depend on the
pages of a call; the chunk's pages, its image address and its pages per chunk
are launch arguments.

Addresses are int64 word offsets from an anchor tensor (the group's first
device rows, typed as the access word: :func:`~hicache_core.kernel_support.access_word`,
the widest power of two <= 8 bytes dividing every size, stride and address the
group uses).  The staging image is another offset from the same anchor (one
unified address space).

This module never imports Triton itself: the kernel module is loaded on the
first kernel relayout, once per Triton mode (compiled, or the CPU interpreter
under ``TRITON_INTERPRET=1``: Triton fixes the mode when it decorates a
kernel, so a copy decorated in the other mode is never reused).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..binding import PoolBinding
from ..errors import ConfigError
from ..kernel_support import word_anchor, access_word, interpreting, on_pool_device
from ..launch import Launcher

if TYPE_CHECKING:
    from .staging import _Image

__all__ = ["RELAYOUT_MODES", "ENV_RELAYOUT", "relayout_mode", "resolve_relayout", "kernel_unavailable",
           "KernelRelayout", "kernel_relayout", "block_shape", "TILE_BYTES", "MAX_TILE_ROWS", "MAX_BLOCK_BYTES", "NUM_WARPS"]

#: ``auto`` (the kernel on CUDA where Triton imports, else torch), ``kernel`` or ``torch``.
RELAYOUT_MODES = ("auto", "kernel", "torch")
#: The relayout of staged routes when the caller names none (default ``auto``).
ENV_RELAYOUT = "HICACHE_STAGED_RELAYOUT"

#: Grid: one program per (row tile, entry), ``cdiv(rows, tile rows) * entries`` programs, no
#: persistent loop.  A relayout is a device-to-device copy at HBM speed that should finish
#: fast, so the grid covers the work and the GPU's scheduler keeps every SM busy; the tile
#: (``TILE_BYTES`` per column step) keeps a program short.  Not measured yet: re-tune on the GPU.
TILE_BYTES = 8192
#: Most rows per tile (tiny chunks would otherwise make tall tiles).
MAX_TILE_ROWS = 64
#: Widest column step (bytes); longer row chunks take several steps.
MAX_BLOCK_BYTES = 1024
#: Column steps may leave at most this fraction of a chunk's lanes masked off.
MAX_BLOCK_WASTE = 0.125
#: Widest access the kernel is told about through ``tl.multiple_of`` (bytes).
MAX_VECTOR_BYTES = 16
#: Warps per program: short programs, many of them.
NUM_WARPS = 4

_NCOL = 9  # table columns, in the kernel's order
_CACHE = "staging.relayout"
_KERNEL_MODULE = __name__.rpartition(".")[0] + "._relayout_kernel"
_loaded: dict[bool, tuple[ModuleType, Launcher]] = {}
_load_lock = threading.Lock()


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def block_shape(chunk: int, word: int) -> tuple[int, int]:
    """``(rows, block)`` of the tile for row chunks of ``chunk`` words of ``word`` bytes.

    ``block`` is the widest power of two <= :data:`MAX_BLOCK_BYTES` whose steps
    over a chunk leave at most :data:`MAX_BLOCK_WASTE` of their lanes masked
    (a 1152-byte MLA row: 5 steps of 32 words, not 2 of 128); ``rows`` fills
    :data:`TILE_BYTES`, capped at :data:`MAX_TILE_ROWS`.
    """
    block = min(_next_pow2(chunk), max(1, MAX_BLOCK_BYTES // word))
    while block > 1 and -(-chunk // block) * block - chunk > MAX_BLOCK_WASTE * chunk:
        block //= 2
    return min(MAX_TILE_ROWS, max(1, TILE_BYTES // (block * word))), block


# -- which relayout -----------------------------------------------------------------------


def _is_interpreted(kernel: Any) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _load_module(interpret: bool) -> ModuleType:
    """The kernel module decorated in Triton mode ``interpret`` (a fresh copy when the imported one is not)."""
    mod = importlib.import_module(_KERNEL_MODULE)
    if _is_interpreted(mod.relayout_kernel) == interpret:
        return mod
    spec = importlib.util.find_spec(_KERNEL_MODULE)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)  # decorated now, in the mode now set
    if _is_interpreted(copy.relayout_kernel) != interpret:
        raise RuntimeError(f"Triton decorated the relayout kernel {'compiled' if interpret else 'interpreted'}, "
                           f"but TRITON_INTERPRET says {'interpreted' if interpret else 'compiled'}")
    return copy


def _kernel() -> tuple[ModuleType, Launcher]:
    """The kernel module and its launcher for the Triton mode now set (loaded once per mode)."""
    interpret = interpreting()
    hit = _loaded.get(interpret)
    if hit is None:
        with _load_lock:
            hit = _loaded.get(interpret)
            if hit is None:
                mod = _load_module(interpret)
                hit = _loaded[interpret] = (mod, Launcher(mod.relayout_kernel))
    return hit


def kernel_unavailable(device: torch.device) -> str | None:
    """``None`` when the relayout kernel can run on ``device`` now, else why not (loads it on success)."""
    if device.type == "cuda":
        if interpreting():
            return "the Triton interpreter (TRITON_INTERPRET=1) cannot address CUDA memory from one anchor"
    elif device.type != "cpu" or not interpreting():
        return f"the relayout kernel needs a CUDA device (or TRITON_INTERPRET=1 on CPU); the pool is on {device}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    try:
        _kernel()
    except Exception as exc:  # a broken Triton install: say so, the torch relayout still works
        return f"the relayout kernel does not load: {type(exc).__name__}: {exc}"
    return None


def relayout_mode(requested: str | None = None) -> str:
    """The requested relayout mode (default ``$HICACHE_STAGED_RELAYOUT``, else ``auto``), checked.

    :raises ConfigError: not one of :data:`RELAYOUT_MODES`."""
    mode = requested if requested is not None else (os.environ.get(ENV_RELAYOUT, "").strip().lower() or "auto")
    if mode not in RELAYOUT_MODES:
        raise ConfigError(f"staged relayout={mode!r} (or {ENV_RELAYOUT}): use one of {', '.join(RELAYOUT_MODES)}")
    return mode


def resolve_relayout(device: torch.device, requested: str | None = None) -> str:
    """``kernel`` or ``torch``: the relayout a staged route on ``device`` uses.

    ``requested`` (default ``$HICACHE_STAGED_RELAYOUT``, else ``auto``): ``auto``
    takes the kernel on CUDA when Triton imports, else torch; ``kernel`` insists
    (:class:`ConfigError` where it cannot run); ``torch`` keeps two torch ops per entry.
    """
    mode = relayout_mode(requested)
    if mode == "torch" or (mode == "auto" and device.type != "cuda"):
        return "torch"
    why = kernel_unavailable(device)
    if why is None:
        return "kernel"
    if mode == "kernel":
        raise ConfigError(f"staged relayout 'kernel': {why}")
    return "torch"


# -- tables and launches ------------------------------------------------------------------


@dataclass
class _Group:
    """Entries of images with one row chunk width: one launch per chunk."""

    word: int
    vec: int
    anchor: torch.Tensor
    table: torch.Tensor  # int64 [n_ent, _NCOL] on the pool's device
    n_ent: int
    chunk: int  # words
    tok: int
    block: int
    nch: int  # most row chunks of any entry
    keys: dict[bool, int] = field(default_factory=dict)  # static launch keys, per direction


def _chunking(im: _Image) -> tuple[int, int, int]:
    """``(chunk bytes, chunks, image stride of a chunk)``: a row contiguous in the image is one chunk."""
    a = im.seg.segment.addressing
    if a.whole_row(im.seg.width):
        return im.seg.width, 1, im.seg.width
    return a.chunk_bytes, a.chunks(im.seg.width), a.chunk_stride


def _group(device: torch.device, members: list[tuple[_Image, int]], chunk: int, per_page: int) -> _Group:
    """One :class:`_Group` of images ``(image, prefix bytes)`` with row chunks of ``chunk`` bytes."""
    anchor_src = members[0][0].seg.device_rows[members[0][0].entries[0]]
    quantities = [per_page, chunk, anchor_src.untyped_storage().data_ptr()]
    for im, prefix in members:
        a = im.seg.segment.addressing
        quantities += [prefix, im.span, a.token, _chunking(im)[2]] + [im.entry_offset(e) for e in im.entries]
        quantities += [im.seg.dev_ptrs[e] for e in im.entries] + [im.seg.dev_strides[e] for e in im.entries]
    word = access_word(*quantities)
    anchor = word_anchor(anchor_src, word)
    base = anchor.data_ptr()
    rows = []
    for im, prefix in members:
        a = im.seg.segment.addressing
        _, nch, cstride = _chunking(im)
        for e in im.entries:
            rows.append([(im.seg.dev_ptrs[e] - base) // word, im.seg.dev_strides[e] // word, im.seg.dev_lens[e],
                         im.entry_offset(e) // word, prefix // word,
                         im.span // word, a.token // word, cstride // word, nch])
    tok, block = block_shape(chunk // word, word)
    vec = min(block, access_word(*quantities, max_word=max(MAX_VECTOR_BYTES, word)) // word)
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    return _Group(word, vec, anchor, table, len(rows), chunk // word, tok, block, max(r[-1] for r in rows))


class KernelRelayout:
    """The relayout of one pool's staged routes for one layer selection: one launch per group and chunk."""

    def __init__(self, binding: PoolBinding, images: Sequence[_Image]) -> None:
        self.page_size = binding.spec.page_size
        self.device = binding.device
        per_page = sum(im.span for im in images)
        by_chunk: dict[int, list[tuple[_Image, int]]] = {}
        prefix = 0
        for im in images:
            by_chunk.setdefault(_chunking(im)[0], []).append((im, prefix))
            prefix += im.span
        self.groups = [_group(binding.device, members, chunk, per_page) for chunk, members in by_chunk.items()]

    @property
    def launches(self) -> int:
        """Kernel launches per chunk."""
        return len(self.groups)

    def run(self, staging: torch.Tensor, rows: torch.Tensor, npages: int, chunk_pages: int, *,
            to_image: bool) -> bool:
        """Relay ``rows`` (``npages`` pages) to or from the image at ``staging``; ``False`` (nothing
        launched) when the staging buffer is not aligned to some group's vector of access words (``word * vec`` bytes)."""
        base = staging.data_ptr()
        if any(base % (g.word * g.vec) for g in self.groups):
            return False
        mod, launch = _kernel()
        rows = rows if rows.is_contiguous() else rows.contiguous()
        n_rows = npages * self.page_size
        with on_pool_device(self.device):
            for g in self.groups:
                n_tiles = -(-n_rows // g.tok)
                args = (g.anchor, rows, g.table, n_rows, n_tiles, g.n_ent, self.page_size, chunk_pages,
                        (base - g.anchor.data_ptr()) // g.word, staging.numel() // g.word,
                        _NCOL, g.nch, g.chunk, g.tok, g.block, g.vec, to_image)
                key = g.keys.get(to_image)
                if key is None:
                    key = g.keys[to_image] = launch.static_key(args, mod.DYNAMIC_ARGS)
                launch(n_tiles * g.n_ent, args, num_warps=NUM_WARPS, static_key=key, dynamic=mod.DYNAMIC_ARGS)
        return True


def kernel_relayout(binding: PoolBinding, images: Sequence[_Image]) -> KernelRelayout:
    """The :class:`KernelRelayout` of ``binding`` for a staged route's ``images``, built once.

    Images depend on the binding and the layer selection only, so the routes
    of every call with that selection share the tables.
    """
    cache: dict[tuple, KernelRelayout] = binding.scratch.setdefault(_CACHE, {})
    key = tuple((id(im.seg), im.entries, im.lo, im.span, im.compact) for im in images)  # segments live as long as the binding
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = KernelRelayout(binding, images)
    return hit

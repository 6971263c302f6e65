"""TMA loads for row-copy strategies: host rows read by tensor-descriptor bulk copies (Hopper-class GPUs).

A register-staged load keeps one tile per program in flight, so a load needs
many programs to cover the link's latency.  With a tensor descriptor over the
pinned host layer, each program keeps ``stages`` bulk copies (TMA) in flight
and a handful of programs reach the link (docs/performance.md).  Device rows
are still written by ordinary stores through the pool's word-offset tables,
so device rows may be anywhere.

A plugin opts in by exporting ``TMA_LOAD_KERNEL`` from its kernel module (the
shared :data:`hicache_core.kernel_lib.PAGED_TMA_LOAD` serves any layout whose
host slot ``s`` is at ``page(s) * page_stride + slot_in_page(s) * token_stride``
with the page stride a whole multiple, at least ``page_size``, of the token stride)
and a ``tma_load`` :class:`~hicache_core.rowcopy.Tuning` in its
:class:`~hicache_core.rowcopy.KernelTuning`.  Per-layer loads of a launch group
then take one launch per (segment, layer) entry; backups, ``load_all_layers``,
fused groups (one device row split over two host buffers) and groups whose
host addressing a descriptor cannot express (:func:`group_reason`) keep the
row kernel.

Which loads use it (:func:`tma_mode`): the strategy option ``tma`` (``True``,
``False``, ``None``: automatic), else ``HICACHE_KERNEL_TMA`` (``1``/``0``),
else automatic: on CUDA devices of compute capability 9.x (Hopper: TMA and
~228 KiB of shared memory per SM; where it was measured), groups whose rows hold at least 1152 bytes
and whose boxes at least 16 KiB only, and where a group's host rows are strided
(token-major), calls of at most 8192 rows only (:func:`row_limit`).  Compute
capability 10.x (Blackwell) has TMA too but only by request (``tma=True`` or
``HICACHE_KERNEL_TMA=1``): unmeasured there, and its drivers up to 13.1 have a
known fault with descriptors of small extents that Triton's own encoder works
around and :mod:`.drvlaunch`'s does not.
Nothing here imports Triton at import time.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .envflags import OFF, ON
from .errors import ConfigError
from .kernel_support import interpreting, word_anchor

if TYPE_CHECKING:
    from .rowcopy_groups import RowGroup
    from .rowcopy_tuning import Tuning

__all__ = ["ENV_TMA", "AUTO_MIN_ROW_BYTES", "AUTO_MIN_BOX_BYTES", "AUTO_MAX_STRIDED_ROWS", "TMA_VALUES", "TmaLaunch",
           "tma_mode", "group_reason", "row_limit", "box_shape", "descriptor_rows", "plan_group"]

logger = logging.getLogger(__name__)

#: ``1`` / ``0``: TMA loads on / off for every row-copy strategy without an explicit ``tma`` option.
ENV_TMA = "HICACHE_KERNEL_TMA"
#: Largest box dimension a tensor descriptor allows (elements).
MAX_BOX = 256
#: Fewest tokens per box worth a bulk copy (smaller pages keep the row kernel).
MIN_TOKENS = 8
#: Shared memory the boxes in flight may take per program (Hopper has ~227 KiB per block; indices and
#: barriers take the rest).
SMEM_BYTES = 160 << 10
#: Narrowest row automatic TMA takes: on the H200, 1152- and 2048-byte rows load as fast through 4 TMA programs as
#: through 16 register-staged ones, 576-byte rows (a 64-byte tail box per row) 2-5% slower; rows in between are
#: unmeasured and keep the row kernel (docs/performance.md).
AUTO_MIN_ROW_BYTES = 1152
#: Smallest box automatic TMA takes: 16-18 KiB boxes (16 rows of 1152 bytes, 8 of 2 KiB) measured best on the H200,
#: 9 KiB ones (8 rows of 1152 bytes: pages of 8 tokens) 0.61-0.73 of memcpy in bursts (docs/performance.md).
AUTO_MIN_BOX_BYTES = 16 << 10
#: Most rows per call automatic TMA loads where a group's host rows are strided (token-major host layouts: one row
#: per slot, the other layers' rows between two slots).  On the H200 (MLA 1152-byte rows, page 64,
#: ``benchmarks/tma_span_probe.py``): TMA ahead of the row kernel at 4096 and 8192 rows per call (lone +0.02-0.03,
#: bursts +0.02-0.03 of memcpy, whatever the pool's capacity, 0.3 to 9.2 GB of host rows), behind it at 16384
#: (-0.02) and 32768 (-0.10); larger calls keep the row kernel.  Groups whose rows are contiguous per page are not
#: limited (TMA ahead at 32768 rows too).
AUTO_MAX_STRIDED_ROWS = 8192

#: Every name a TMA load kernel may declare, and what the launch passes for it.
TMA_VALUES = {
    "anchor": "tensor typed as the access word (as for the row kernel)",
    "host_desc": "2-D tensor descriptor over the entry's host layer: [rows, words] at the host token stride, slot s "
                 "at row page(s) * (host_page / host_tok) + slot_in_page(s)",
    "host_tail": "as host_desc with a TAIL-word box (None when TAIL is 0)",
    "host_idx": "int32|int64 [n] host slots (on the pool's device)",
    "dev_idx": "int32|int64 [n] device rows",
    "n": "index positions",
    "dev_base": "words from anchor to device row 0 of the entry's layer",
    "dev_stride": "device token stride (words)",
    "host_base": "words from anchor to host slot 0 of the entry's layer",
    "host_page": "host page stride (words)",
    "host_tok": "host token stride (words)",
    "host_desc_b": "as host_desc, for the launch's second entry (ENTRIES == 2; else None)",
    "host_tail_b": "as host_tail, second entry (None when ENTRIES == 1 or TAIL is 0)",
    "dev_base_b": "as dev_base, second entry",
    "dev_stride_b": "as dev_stride, second entry",
    "host_base_b": "as host_base, second entry",
    "host_page_b": "as host_page, second entry",
    "host_tok_b": "as host_tok, second entry",
    "page_size": "tokens per page",
    "PAGE_SIZE": "constexpr: tokens per page (slots split into page and row by a constant, not a 64-bit division)",
    "capacity": "host slots",
    "dev_rows": "device rows of the shortest layer",
    "WIDTH": "constexpr: row words",
    "BOX": "constexpr: words per box column step (a power of two <= 256)",
    "TAIL": "constexpr: words of the box for the rest of a row (a power of two; 0: none)",
    "TOKENS": "constexpr: index positions per tile, rows per box (a power of two)",
    "VEC": "constexpr: every row base is a multiple of VEC words",
    "STAGES": "constexpr: bulk copies in flight per program (tl.range num_stages)",
    "FLAT": "constexpr: host slots are uniformly strided (slot s is descriptor row s; page stride == page_size x "
            "token stride)",
    "ENTRIES": "constexpr: entries this launch loads (1 or 2: MHA k and v of a layer share a launch; a kernel that "
               "does not declare it is launched once per entry)",
}
DYNAMIC = ("host_idx", "dev_idx", "n")


def tma_mode(option: bool | None, device: torch.device) -> str | None:
    """Which per-layer loads use TMA: ``"all"`` groups a descriptor can address, ``"auto"`` the measured ones,
    or ``None``.

    ``option`` (``True``: all, ``False``: none), else ``HICACHE_KERNEL_TMA``
    (``1``: all, ``0``: none), else ``"auto"`` on CUDA devices of compute
    capability 9.x (10.x only by request: the module docstring): groups whose rows hold at least
    :data:`AUTO_MIN_ROW_BYTES` and whose boxes at least
    :data:`AUTO_MIN_BOX_BYTES` (:func:`group_reason`), where 4 TMA programs
    move a load burst at least as fast as 16 register-staged ones and slow a
    GEMM less (docs/perf/runs.md, "TMA loads").
    """
    if option is not None:
        return "all" if option else None
    env = os.environ.get(ENV_TMA, "").strip().lower()
    if env in ON:
        return "all"
    if env in OFF:
        return None
    if env:
        raise ConfigError(f"{ENV_TMA}={env!r}: use 1 (TMA loads on; or true, yes, on), 0 (off; or false, no, off) or "
                          "leave it unset (automatic)", setting=ENV_TMA)
    if device.type != "cuda" or interpreting() or not torch.cuda.is_available():
        return None
    return "auto" if torch.cuda.get_device_capability(device)[0] == 9 else None


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def box_shape(width: int, word: int, page_size: int, tile_bytes: int, *, stages: int = 1,
              capacity: int = 1 << 30) -> tuple[int, int, int]:
    """``(BOX, TAIL, TOKENS)`` for rows of ``width`` words: column step, tail box, rows per box.

    ``TOKENS`` fills ``tile_bytes`` with whole rows, and is at most :data:`MAX_BOX`,
    ``capacity``, the largest power of two dividing ``page_size`` (tiles of
    whole pages then never straddle two pages), and what fits ``stages - 1``
    buffers in :data:`SMEM_BYTES`.
    """
    box = min(MAX_BOX, _pow2_floor(width))
    rest = width % box
    tail = 0 if rest == 0 else max(1 << (rest - 1).bit_length(), 16 // word)
    row = (width - rest + tail) * word
    tokens = min(MAX_BOX, _pow2_floor(capacity), page_size & -page_size, _pow2_floor(max(1, tile_bytes // row)),
                 _pow2_floor(max(1, SMEM_BYTES // (row * max(1, stages - 1)))))
    return box, tail, tokens


def descriptor_rows(capacity: int, page_size: int, page_rows: int) -> int:
    """Rows of a layer's 2-D descriptor: slot ``s`` is row ``page(s) * page_rows + slot_in_page(s)``
    (``page_rows`` = page stride / token stride; ``page_size`` when slots are uniformly strided), and the
    last row is the layer's last slot."""
    return (capacity // page_size - 1) * page_rows + page_size


def group_reason(g: RowGroup, capacity: int, page_size: int, tuning: Tuning, *, automatic: bool = False) -> str | None:
    """Why ``g``'s loads cannot (or, ``automatic``, do not by default) go through tensor descriptors."""
    if g.split < g.width:
        return "its rows are split over two host buffers (a fused group)"
    word = g.word
    pages, toks, offs = (g.tables[k].tolist() for k in ("host_page", "host_tok", "host_off"))
    box, tail, tokens = box_shape(g.width, word, page_size, tuning.tile_bytes, stages=tuning.stages, capacity=capacity)
    if box * word < 16:
        return f"rows of {g.width * word} bytes are narrower than a 16-byte box"
    if (page_size & -page_size) < MIN_TOKENS:
        return f"pages of {page_size} tokens give boxes of fewer than {MIN_TOKENS} rows"
    if tokens < MIN_TOKENS:
        return f"rows of {g.width * word} bytes give boxes of fewer than {MIN_TOKENS} rows within tile_bytes and stages"
    for k, (page, tok, off) in enumerate(zip(pages, toks, offs)):
        addr = g.anchor.data_ptr() + off * word
        in_storage = addr - g.hosts[k].untyped_storage().data_ptr()
        if (tok * word) % 16 or (page * word) % 16 or addr % 16 or in_storage % word:
            return "host strides or layer bases are not multiples of 16 bytes"
        if tok <= 0 or page % tok or page < page_size * tok:
            return (f"its host page stride ({page} words) is not a whole multiple, at least page_size, of its "
                    f"token stride ({tok} words)")
        if descriptor_rows(capacity, page_size, page // tok) >= 2**31:
            return f"capacity {capacity} at this page stride exceeds 32-bit descriptor coordinates"
    if automatic and g.width * word < AUTO_MIN_ROW_BYTES:
        return (f"rows of {g.width * word} bytes are under {AUTO_MIN_ROW_BYTES} (automatic TMA takes the row sizes "
                "where it measured at least as fast as the row kernel; tma=True forces it)")
    box_bytes = tokens * (box * (g.width // box) + tail) * word
    if automatic and box_bytes < AUTO_MIN_BOX_BYTES:
        return (f"boxes of {tokens} rows ({box_bytes} bytes) are under {AUTO_MIN_BOX_BYTES} (automatic TMA takes the "
                "box sizes where it measured at least as fast as the row kernel; tma=True forces it)")
    return None


def row_limit(g: RowGroup, *, automatic: bool) -> int | None:
    """Most index positions per call ``g``'s loads take through TMA (``None``: any): automatic TMA limits groups
    whose host rows are strided (a host token stride other than the row width) to
    :data:`AUTO_MAX_STRIDED_ROWS`; forced TMA (``tma=True``) takes every call."""
    if not automatic:
        return None
    strided = any(int(t) != g.width for t in g.tables["host_tok"].tolist())
    return AUTO_MAX_STRIDED_ROWS if strided else None


@dataclass(frozen=True)
class TmaLaunch:
    """One entry's fixed load launch: positional args with per-call slots unset, static key, rows per tile."""

    tokens: int
    key: int
    args: tuple
    slots: tuple[tuple[str, int], ...]
    packs: dict = field(init=False, default_factory=dict, compare=False, repr=False)  # the launcher's packed parameters


def _host_base(g: RowGroup, k: int, off: int) -> torch.Tensor:
    """A one-word tensor at entry ``k``'s host slot 0 (a descriptor's base)."""
    host = g.hosts[k]
    return word_anchor(host[g.anchor.data_ptr() + off * g.word - host.data_ptr():], g.word)


def plan_group(g: RowGroup, *, capacity: int, page_size: int, tuning: Tuning, launcher: Any,
               dynamic: tuple[int, ...]) -> dict[int, tuple[TmaLaunch, ...]]:
    """Per device layer, the TMA launches loading ``g``'s entries of that layer (``group_reason`` must be ``None``):
    one per two entries of equal box shape (MHA ``k`` and ``v``), in entry order."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    word = g.word
    cols = {k: g.tables[k].tolist() for k in ("dev_off", "dev_stride", "host_off", "host_page", "host_tok")}
    box, tail, tokens = box_shape(g.width, word, page_size, tuning.tile_bytes, stages=tuning.stages,
                                  capacity=capacity)
    entries: dict[int, list[tuple[tuple, dict[str, Any]]]] = {}
    for k, layer in enumerate(g.layers):
        page, tok, off = cols["host_page"][k], cols["host_tok"][k], cols["host_off"][k]
        base = _host_base(g, k, off)
        shape, strides = [descriptor_rows(capacity, page_size, page // tok), g.width], [tok, 1]
        desc = TensorDescriptor(base, shape, strides, [tokens, box])
        one = dict(host_desc=desc, host_tail=TensorDescriptor(base, shape, strides, [tokens, tail]) if tail else None,
                   dev_base=cols["dev_off"][k], dev_stride=cols["dev_stride"][k], host_base=off, host_page=page,
                   host_tok=tok)
        entries.setdefault(layer, []).append((page == page_size * tok, one))
    slots = tuple((name, i) for i, name in enumerate(launcher.arg_names) if name in DYNAMIC)
    pairs = "ENTRIES" in launcher.arg_names  # a kernel without it loads one entry per launch
    per_layer: dict[int, tuple[TmaLaunch, ...]] = {}
    for layer, items in entries.items():
        launches = []
        i = 0
        while i < len(items):
            flat, a = items[i]
            pair = pairs and i + 1 < len(items) and items[i + 1][0] == items[i][0]
            b = items[i + 1][1] if pair else dict(a, host_desc=None, host_tail=None)  # None: nothing to encode
            values = dict(anchor=g.anchor, host_idx=None, dev_idx=None, n=None, **a,
                          **{f"{name}_b": v for name, v in b.items()}, page_size=page_size, PAGE_SIZE=page_size,
                          capacity=capacity, dev_rows=g.rows, WIDTH=g.width, BOX=box, TAIL=tail, TOKENS=tokens,
                          VEC=g.vec, STAGES=tuning.stages, FLAT=flat, ENTRIES=2 if pair else 1)
            args = launcher.bind(values)
            launches.append(TmaLaunch(tokens, launcher.static_key(args, dynamic), args, slots))
            i += 2 if pair else 1
        per_layer[layer] = tuple(launches)
    return per_layer

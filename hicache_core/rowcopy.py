"""Host side shared by row-copy kernel strategies: tables, groups, tuning and one launch per group.

A layout plugin that moves whole contiguous rows with its own Triton kernel
subclasses :class:`RowKernelStrategy` and sets four class attributes: ``name``,
``layouts`` (the layouts it serves), ``kernel_module`` (where its
``@triton.jit`` kernel ``KERNEL`` lives, built from :mod:`hicache_core.kernel_lib`)
and ``tuning`` (:class:`KernelTuning`, per direction).  Everything else is here:

* :meth:`RowKernelStrategy.prepare` (once per pool): pinning check, the
  per-entry word-offset tables (:func:`~hicache_core.kernel_support.segment_tables`)
  merged into :class:`RowGroup` s (segments of one access word and row width
  share a launch; with ``fuse_parts`` the two parts of a device row, MLA
  ``latent`` + ``rope``, are one group whose second part goes to other host
  buffers), the vector width, the tile, the static launch key;
* :meth:`RowKernelStrategy.transfer`: index placement, then one launch per group
  (per-layer loads on Hopper-class GPUs: one TMA launch per entry, see
  :mod:`hicache_core.rowcopy_tma`).

Launch values are passed to the kernel **by name**: a kernel declares the
parameters it uses from :data:`LAUNCH_VALUES`, in any order.  Nothing here
imports Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, cast

import torch

from . import claunch, replay
from .binding import PoolBinding
from .errors import ConfigError, HostBufferError
from .kernel_support import (
    SegmentTable,
    access_word,
    interpreting,
    kernel_unsupported_reason,
    on_pool_device,
    require_pinned,
    segment_tables,
    sm_budget,
    transfer_indices,
)
from .layout import Layout
from .replay import Batch, Lane, Replays, Step, replay_enabled, step as replay_step
from .spec import PoolSpec
from .strategy import DirectionalStrategy
from .rowcopy_tma import (AUTO_MAX_STRIDED_ROWS, AUTO_MIN_BOX_BYTES, AUTO_MIN_ROW_BYTES, DYNAMIC as TMA_DYNAMIC,
                          TMA_VALUES, TmaLaunch, group_reason, plan_group, row_limit, tma_mode)
from .validate import parse_programs
from . import rowcopy_pages

__all__ = ["Tuning", "KernelTuning", "TMA_LOAD_TUNING", "PAGE_LOAD_TUNING", "RowGroup", "RowKernelStrategy",
           "build_groups", "tile", "LAUNCH_VALUES", "DYNAMIC_VALUES", "MAX_BLOCK_BYTES", "MAX_TOKENS", "MAX_VECTOR_BYTES"]

logger = logging.getLogger(__name__)

#: Widest column step of a tile; longer rows take several steps.
MAX_BLOCK_BYTES = 4096
#: Most tokens per tile (rows of tiny components would otherwise make huge tiles).
MAX_TOKENS = 256
#: Widest access the kernels are told about through ``tl.multiple_of``.
MAX_VECTOR_BYTES = 16

#: Every name a row-copy kernel may declare, and what the launch passes for it.
LAUNCH_VALUES = {
    "anchor": "tensor typed as the access word: every address is anchor + int64 word offset",
    "host_idx": "int32|int64 [n] host slots (on the pool's device)",
    "dev_idx": "int32|int64 [n] device rows, paired with host_idx",
    "n": "index positions",
    "ents": "int64 [n_ents] entry positions this launch moves",
    "n_ents": "entries this launch moves",
    "dev_off": "int64 [entries] words from anchor to device row 0 of the entry's layer tensor",
    "dev_stride": "int64 [entries] device token stride (words)",
    "host_off": "int64 [entries] words from anchor to host slot 0 of the entry's host layer",
    "host_page": "int64 [entries] host page stride (words)",
    "host_tok": "int64 [entries] host token stride (words)",
    "host_off_b": "as host_off, for the row's second part (fused groups; else host_off)",
    "host_page_b": "as host_page, second part",
    "host_tok_b": "as host_tok, second part",
    "page_size": "tokens per page",
    "capacity": "host slots: host indices outside 0..capacity-1 move nothing",
    "dev_rows": "device rows of the shortest layer: device indices outside move nothing",
    "WIDTH": "constexpr: row words (both parts; page loads: the words of the host part loaded)",
    "SPLIT": "constexpr: words of the first part (== WIDTH when the group has one part)",
    "BLOCK": "constexpr: column step (words, power of two) of the first part",
    "BLOCK_B": "constexpr: column step of the second part",
    "TOKENS": "constexpr: index positions per tile (power of two)",
    "VEC": "constexpr: every row base is a multiple of VEC words",
    "TO_HOST": "constexpr: True backup (device to host), False load",
    "STAGES": "constexpr: software-pipelining depth of the work-item loop (tl.range num_stages; 1: none)",
    "ENTRIES_INNER": "constexpr: the strategy's entries_inner (work-item order, see kernel_lib.work_item)",
    "PAGE_TOKENS": "constexpr: page loads: a power of two >= page_size (one vector checks a page's indices)",
    "PART": "constexpr: words per part of a page (page loads, see rowcopy_pages.pieces)",
    "PARTS": "constexpr: whole parts per page",
    "R1": "constexpr: words of the page's first piece after its parts (0: none)",
    "R2": "constexpr: second piece (0: none)",
    "R3": "constexpr: third piece (0: none)",
    "R4": "constexpr: masked tail piece covering the rest of the page (0: none)",
    "STRIDED": "constexpr: page loads: device rows are wider than the part loaded (dev_stride != WIDTH)",
}
#: The launch values that change from call to call (the rest is fixed per pool, group and direction).
DYNAMIC_VALUES = ("host_idx", "dev_idx", "n", "ents", "n_ents")


#: The largest ``tile_bytes``: a page load's piece is ``tile_bytes`` over the access word (1 byte at the least) words,
#: and Triton refuses a tensor of more than 2**20 elements (16x the page loads' default, 64 KiB).
MAX_TILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Tuning:
    """Launch shape of one direction: programs (the persistent grid, an SM budget), warps per program,
    the bytes one program moves per tile, and how many work items the loop keeps in flight
    (``stages``, software pipelining); ``maxnreg`` caps registers per thread."""

    programs: int
    num_warps: int
    tile_bytes: int
    stages: int = 1
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        for name in ("programs", "num_warps", "tile_bytes", "stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if self.tile_bytes > MAX_TILE_BYTES:
            raise ConfigError(f"tile_bytes must be at most {MAX_TILE_BYTES} (a page load's piece of more than 2**20 "
                              f"elements exceeds Triton's largest tensor), got {self.tile_bytes}")
        if self.num_warps & (self.num_warps - 1):
            raise ConfigError(f"num_warps must be a power of two (1, 2, 4, ...), got {self.num_warps}")
        if self.maxnreg is not None and (isinstance(self.maxnreg, bool) or not isinstance(self.maxnreg, int)
                                         or self.maxnreg < 1):
            raise ConfigError(f"maxnreg must be a positive int (registers per thread) or None, got {self.maxnreg!r}")


@dataclass(frozen=True)
class KernelTuning:
    """A strategy's :class:`Tuning` per direction; ``tma_load``: per-layer loads through tensor
    descriptors (``None``: the strategy has no TMA loads); ``page_load``: loads of whole pages as flat
    words (``tile_bytes``: the largest part of a page one work item reads; ``None``: no page loads)."""

    backup: Tuning
    load: Tuning
    tma_load: Tuning | None = None
    page_load: Tuning | None = None

    def direction(self, to_host: bool) -> Tuning:
        return self.backup if to_host else self.load


#: Launch shape of the shared TMA load kernel (``kernel_lib.PAGED_TMA_LOAD``), for a plugin's
#: ``KernelTuning.tma_load``.  H200 2026-11-30 (docs/performance.md, "TMA loads for every host layout";
#: sweeps in docs/perf/tune-tma-*-2026-11-30.json): 4 programs move a load burst of 1152- or 2048-byte rows
#: as fast as the row kernel at 16, with a GEMM beside them -0.9% to +1% instead of up to +6%; boxes of
#: ~20 KiB (16 rows of 1152 bytes, 8 of 2 KiB) beat ~40 KiB by 0.01-0.025 at the same GEMM cost.
TMA_LOAD_TUNING = Tuning(programs=4, num_warps=4, tile_bytes=20480, stages=4)
#: Launch shape of the shared page load kernel (``kernel_lib.PAGE_LOAD``), for a plugin's
#: ``KernelTuning.page_load``: parts of up to 64 KiB (a 64 x 656-byte page is one item).
PAGE_LOAD_TUNING = Tuning(programs=16, num_warps=16, tile_bytes=65536)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def tile(width: int, split: int, word: int, tile_bytes: int) -> tuple[int, int, int]:
    """``(BLOCK, BLOCK_B, TOKENS)`` for rows of ``width`` words (``split`` in the first part).

    Column steps are the next power of two of each part, capped at
    :data:`MAX_BLOCK_BYTES`; ``TOKENS`` fills ``tile_bytes`` (capped at
    :data:`MAX_TOKENS`).  All powers of two (Triton block shapes).
    """
    cap = _pow2_floor(MAX_BLOCK_BYTES // word)
    block = min(_pow2_ceil(split), cap)
    block_b = min(_pow2_ceil(max(1, width - split)), cap)
    step = block + (block_b if split < width else 0)
    return block, block_b, max(1, min(MAX_TOKENS, _pow2_floor(tile_bytes // (step * word))))


@dataclass(frozen=True)
class RowGroup:
    """Segments moved by one launch, as per-entry tables (int64, on the pool's device, words from ``anchor``).

    An entry is one (segment, device layer).  ``split < width``: a fused row;
    words ``0..split-1`` of a device row go to ``host_*`` and the rest to
    ``host_*_b``.  ``layers[e]`` is entry ``e``'s device layer and ``hosts[e]``
    its segment's host buffer (flat bytes).
    """

    names: tuple[str, ...]
    anchor: torch.Tensor
    word: int
    width: int
    split: int
    vec: int
    rows: int
    tables: dict[str, torch.Tensor]  # dev_off, dev_stride, host_off, host_page, host_tok and the _b parts
    all_layers: torch.Tensor
    per_layer: dict[int, torch.Tensor]
    layers: tuple[int, ...]
    hosts: tuple[torch.Tensor, ...]

    def entries(self, layer: int | None) -> torch.Tensor | None:
        """Entry positions a transfer of ``layer`` (``None``: every owned layer) moves, or ``None``."""
        ents = self.all_layers if layer is None else self.per_layer.get(layer)
        return ents if ents is not None and ents.numel() else None


def _fusable(a: SegmentTable, b: SegmentTable) -> bool:
    """Whether ``b`` is the part right after ``a`` in the same device rows."""
    sa, sb = a.segment, b.segment
    if sa.segment.component != sb.segment.component or sa.segment.part is None or sb.segment.part is None:
        return False
    if not sa.device_layers or sa.device_layers != sb.device_layers or sa.dev_strides != sb.dev_strides:
        return False
    return all(pb == pa + sa.width for pa, pb in zip(sa.dev_ptrs, sb.dev_ptrs))


def _host_tables(t: SegmentTable, shift: int) -> dict[str, torch.Tensor]:
    n = t.dev_off.numel()
    full = lambda v: torch.full((n,), v, dtype=torch.int64, device=t.dev_off.device)  # noqa: E731
    return {"host_off": t.host_off + shift, "host_page": full(t.page), "host_tok": full(t.token)}


def _group(members: list[tuple[SegmentTable, SegmentTable | None]]) -> RowGroup:
    """One group from ``(part a, part b or None)`` members sharing word and widths."""
    a0, b0 = members[0]
    word, anchor = a0.word, a0.anchor
    base = anchor.data_ptr()
    parts: dict[str, list[torch.Tensor]] = {}
    layers: list[int] = []
    hosts: list[torch.Tensor] = []
    names: list[str] = []
    quantities = [base, a0.width * word]
    for a, b in members:
        shift = (a.anchor.data_ptr() - base) // word  # anchors are word-aligned
        cols = {"dev_off": a.dev_off + shift, "dev_stride": a.dev_stride, **_host_tables(a, shift)}
        bt = _host_tables(b, (b.anchor.data_ptr() - base) // word) if b is not None else _host_tables(a, shift)
        cols.update({k + "_b": v for k, v in bt.items()})
        for k, v in cols.items():
            parts.setdefault(k, []).append(v)
            quantities += [int(x) * word for x in v.tolist()]
        layers += list(a.segment.device_layers)
        hosts += [a.segment.host_flat] * len(a.segment.device_layers)
        names += [a.segment.segment.buffer] + ([b.segment.segment.buffer] if b is not None else [])
    width = a0.width + (b0.width if b0 is not None else 0)
    quantities.append(width * word)
    vec = access_word(*quantities, max_word=max(MAX_VECTOR_BYTES, word)) // word
    device = a0.dev_off.device
    per_layer = {d: torch.tensor([i for i, x in enumerate(layers) if x == d], dtype=torch.int64, device=device)
                 for d in sorted(set(layers))}
    # device rows every member with device layers here has (a member holding no layer of this rank, e.g. a component
    # of other layers on a sharded rank, moves nothing and bounds nothing: its 0 rows would mask the whole group)
    rows = min((min(a.rows, b.rows if b is not None else a.rows) for a, b in members if a.segment.device_layers),
               default=0)
    return RowGroup(names=tuple(names), anchor=anchor, word=word, width=width, split=a0.width, vec=vec, rows=rows,
                    tables={k: torch.cat(v) for k, v in parts.items()},
                    all_layers=torch.arange(len(layers), dtype=torch.int64, device=device), per_layer=per_layer,
                    layers=tuple(layers), hosts=tuple(hosts))


def build_groups(binding: PoolBinding, *, fuse_parts: bool, strategy: str) -> tuple[RowGroup, ...]:
    """The launch groups of ``binding``: fused part pairs (when ``fuse_parts``), then other segments
    merged by (access word, width), in first-seen order.

    :raises HostBufferError: a segment whose rows are not whole and contiguous in host memory.
    """
    tables = segment_tables(binding)
    for t in tables:
        if t.chunk != t.width:
            raise HostBufferError(
                f"{strategy}: segment {t.segment.segment.buffer!r} splits rows into chunks of {t.chunk} words; "
                "this kernel moves whole rows, use io_backend 'direct'")
    members: dict[tuple, list[tuple[SegmentTable, SegmentTable | None]]] = {}
    i = 0
    while i < len(tables):
        a = tables[i]
        if fuse_parts and i + 1 < len(tables) and _fusable(a, tables[i + 1]):
            b = tables[i + 1]
            if a.word != b.word:  # one access word for the whole row
                narrow = segment_tables(binding, max_word=min(a.word, b.word))
                a, b = narrow[i], narrow[i + 1]
            members.setdefault(("fused", i), []).append((a, b))
            i += 2
            continue
        members.setdefault((a.word, a.width), []).append((a, None))
        i += 1
    return tuple(_group(m) for m in members.values())


#: One Launcher (compiled-handle cache) per kernel object, shared by every pool.
_LAUNCHERS: dict[Any, Any] = {}


@dataclass(frozen=True)
class _Launch:
    """A group's fixed launch for one direction: static key, tuning, tokens per tile.

    ``args`` is the kernel's positional argument list with the per-call values
    unset; ``slots`` maps each per-call name the kernel declares to its position
    (a transfer copies the list and fills those slots: no dict work per call).
    """

    tokens: int
    key: int
    tuning: Tuning
    args: tuple
    slots: tuple[tuple[str, int], ...]
    packs: dict = field(init=False, default_factory=dict, compare=False, repr=False)  # the launcher's packed parameters


@dataclass(frozen=True)
class Prepared:
    """What :meth:`RowKernelStrategy.prepare` leaves in ``binding.scratch[strategy.name]``."""

    groups: tuple[RowGroup, ...]
    launches: tuple[dict[bool, _Launch], ...]  # per group, by to_host
    launcher: Any  # hicache_core.launch.Launcher of the plugin's kernel
    dynamic: tuple[int, ...]
    tuning: KernelTuning
    tma: tuple[dict[int, tuple[TmaLaunch, ...]] | None, ...] = ()  # per group: TMA loads by layer, or None
    tma_launcher: Any = None
    tma_dynamic: tuple[int, ...] = ()
    tma_rows: tuple[int | None, ...] = ()  # per group: most index positions a call loads through TMA (None: any)
    replays: Replays | None = None  # CUDA pools with index memos: repeated driver launches (hicache_core.replay)
    pages: tuple[tuple[tuple[_Launch, int], ...] | None, ...] = ()  # per group: page loads (one per host part, with
    #                                                                  its parts per page), or None
    page_launcher: Any = None
    page_dynamic: tuple[int, ...] = ()


class RowKernelStrategy(DirectionalStrategy):
    """A zero-copy Triton strategy moving whole contiguous rows; subclasses name the kernel and tuning.

    Class attributes a subclass sets: ``name``; ``layouts`` (layout names served);
    ``kernel_module`` (import path of the module whose ``KERNEL`` is the kernel);
    ``tuning`` (:class:`KernelTuning`); optionally ``fuse_parts`` and
    :meth:`layout_reason` for layout constraints beyond whole rows, and ``entries_inner`` (the
    work-item order handed to kernels that declare ``ENTRIES_INNER``).

    :param programs: programs per launch (SM budget), both directions.  ``None``:
        ``HICACHE_KERNEL_PROGRAMS`` when set, else the tuning's per-direction value.
    :param backup_programs: programs per backup launch, over ``programs`` and the environment (``None``:
        as ``programs``).  Fewer programs slow a concurrent GEMM less per byte backed up, at a lower
        rate (docs/performance.md: backups of one-token pages); loads keep their budget.
    :param num_warps: warps per program, both directions (``None``: the tuning's).
    :param tile_bytes: bytes per program per tile, both directions (``None``: the tuning's).
    :param num_stages: work items in flight per program (software pipelining), both directions.
    :param maxnreg: register cap per thread, both directions (``None``: the tuning's).
    :param fuse_parts: move a row split over two host buffers in one launch (``None``: the class default).
    :param tma: per-layer loads through tensor descriptors (TMA bulk copies) where the host addressing
        allows: ``True``, ``False``, or ``None`` for ``HICACHE_KERNEL_TMA`` when set, else on CUDA compute
        capability 9.x for rows of >= 1152 bytes in boxes of >= 16 KiB, when the strategy has a TMA load
        kernel
        (:func:`hicache_core.rowcopy_tma.tma_mode`).
    :param pages: loads of whole pages as flat words where the layout keeps a layer's page contiguous
        (:mod:`hicache_core.rowcopy_pages`): ``True``/``False``, or ``None`` for
        ``HICACHE_KERNEL_PAGES`` (unset: on), when the strategy has a page load kernel; calls TMA takes stay TMA's.
    """

    name: ClassVar[str]
    layouts: ClassVar[tuple[str, ...]]
    kernel_module: ClassVar[str]
    tuning: ClassVar[KernelTuning]
    fuse_parts: ClassVar[bool] = False
    entries_inner: ClassVar[bool] = False

    def __init__(self, programs: int | None = None, *, backup_programs: int | None = None,
                 num_warps: int | None = None, tile_bytes: int | None = None, num_stages: int | None = None,
                 maxnreg: int | None = None, fuse_parts: bool | None = None, tma: bool | None = None,
                 pages: bool | None = None) -> None:
        self.programs = None if programs is None else parse_programs(programs, "programs")
        self.backup_programs = None if backup_programs is None else parse_programs(backup_programs,
                                                                                     "backup_programs")
        if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)
                                       or num_stages < 1):  # (Tuning's own check would name its field, stages)
            raise ConfigError(f"num_stages must be a positive int, got {num_stages!r}")
        self._overrides = {k: v for k, v in (("num_warps", num_warps), ("tile_bytes", tile_bytes),
                                             ("stages", num_stages), ("maxnreg", maxnreg)) if v is not None}
        Tuning(1, self._overrides.get("num_warps", 1), self._overrides.get("tile_bytes", 1),
               self._overrides.get("stages", 1), self._overrides.get("maxnreg"))  # validates
        if fuse_parts is not None:
            self.fuse = bool(fuse_parts)
        else:
            self.fuse = type(self).fuse_parts
        if tma is not None and not isinstance(tma, bool):
            raise ConfigError(f"tma must be True, False or None (automatic), got {tma!r}")
        self.tma = tma
        if pages is not None and not isinstance(pages, bool):
            raise ConfigError(f"pages must be True, False or None (HICACHE_KERNEL_PAGES, else on), got {pages!r}")
        self.pages = pages

    # -- resolution -----------------------------------------------------------------------------
    def layout_reason(self, spec: PoolSpec, layout: Layout) -> str | None:
        """Why this kernel cannot address ``layout``'s plan beyond the checks every row kernel makes."""
        return None

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        """``None`` when a Triton kernel can run here and ``layout`` stores whole contiguous rows."""
        why = kernel_unsupported_reason(spec)
        if why:
            return why
        if layout.name not in self.layouts:
            return f"{self.name} serves layout(s) {', '.join(map(repr, self.layouts))}, not {layout.name!r}"
        for seg in layout.plan(spec).segments:
            a = seg.addressing
            if not a.whole_row(seg.width):  # one chunk (whatever its chunk_stride) or chunks that follow each other
                return (f"segment {seg.buffer!r} stores its {seg.width}-byte rows in {a.chunk_bytes}-byte chunks "
                        f"{a.chunk_stride} bytes apart (start to start); "
                        f"{self.name} moves whole contiguous rows: a Segment per chunk (its src_offset and width) "
                        f"makes each chunk such a row")
        return self.layout_reason(spec, layout)

    def describe(self, spec: PoolSpec, layout: Layout) -> list[str]:
        """The launch shape per direction on ``spec``'s device, for ``hicache explain``."""
        t = self.effective_tuning(spec.device)
        def one(d: Tuning) -> str:
            extra = (f", {d.stages} stages" if d.stages > 1 else "") + (f", maxnreg {d.maxnreg}" if d.maxnreg else "")
            return f"{d.programs} programs x {d.num_warps} warps, {d.tile_bytes} B tiles{extra}"
        tma = ""
        mode = tma_mode(self.tma, spec.device)
        if t.tma_load is not None and mode is not None:
            where = ("where a descriptor can address the host rows" if mode == "all" else
                     f"of rows of >= {AUTO_MIN_ROW_BYTES} bytes in boxes of >= {AUTO_MIN_BOX_BYTES // 1024} KiB "
                     f"(rows strided on the host: calls of <= {AUTO_MAX_STRIDED_ROWS} rows)")
            tma = f"; per-layer loads {where} by TMA {one(t.tma_load)}"
        pages = ""
        if t.page_load is not None and rowcopy_pages.pages_enabled(self.pages):
            pages = (f"; loads of whole pages where a layer's host page is a packed run (per host buffer of a "
                     f"split row; the rest gathered by rows) {one(t.page_load)}")
        lines = [f"{self.name}: backups {one(t.backup)}; loads {one(t.load)}{tma}{pages} (options programs, "
                 "backup_programs, num_warps, tile_bytes, num_stages, maxnreg, tma, pages; HICACHE_KERNEL_PROGRAMS, "
                 "HICACHE_KERNEL_TMA, HICACHE_KERNEL_PAGES)"]
        if spec.device.type == "cuda" and not interpreting():
            from .launch import driver_launch_enabled

            lines.append(f"{self.name}: launches " + (
                "through cuLaunchKernel with parameters packed once per pool, where the compiled kernel's parameters "
                "verify against its PTX (else Triton's launcher; HICACHE_DRIVER_LAUNCH=0 turns it off); calls passing "
                "the same index tensors, unchanged, on the same stream replay their launches ("
                + ("on" if replay_enabled() else "off") + ", HICACHE_REPLAY); the driver is called "
                + ("through a compiled call" if claunch.module() is not None else "through ctypes")
                + " (HICACHE_C_LAUNCH)"
                if driver_launch_enabled() else
                "through Triton's launcher (HICACHE_DRIVER_LAUNCH=0 or fast launch off)"))
        return lines

    # -- set-up -----------------------------------------------------------------------------------
    def effective_tuning(self, device: torch.device) -> KernelTuning:
        """The tuning after options and ``HICACHE_KERNEL_PROGRAMS`` (the environment and the defaults capped at 4x
        the SM count; options taken as given)."""
        def one(t: Tuning, option: int | None) -> Tuning:
            programs = option if option is not None else sm_budget(t.programs, device)
            return replace(t, programs=programs, **self._overrides)
        backup = self.backup_programs if self.backup_programs is not None else self.programs
        tma, page, both = self.tuning.tma_load, self.tuning.page_load, self.programs
        return KernelTuning(one(self.tuning.backup, backup), one(self.tuning.load, both),
                            None if tma is None else one(tma, both), None if page is None else one(page, both))

    def prepare(self, binding: PoolBinding) -> None:
        """Check pinning, import the kernel, build groups, fixed launch values and keys (once per pool)."""
        require_pinned(binding, self.name)
        module = importlib.import_module(self.kernel_module)
        launcher = _launcher(module.KERNEL, LAUNCH_VALUES, f"{self.kernel_module}.KERNEL", "rowcopy.LAUNCH_VALUES")
        tuning = self.effective_tuning(binding.device)
        groups = build_groups(binding, fuse_parts=self.fuse, strategy=self.name)
        dynamic = launcher.positions(DYNAMIC_VALUES)
        launches = tuple({to_host: self._launch(binding.spec, g, tuning.direction(to_host), to_host, launcher, dynamic)
                          for to_host in (True, False)} for g in groups)
        prep = Prepared(groups, launches, launcher, dynamic, tuning)
        mode = tma_mode(self.tma, binding.device)
        if mode is not None:
            prep = self._prepare_tma(binding.spec, module, prep, automatic=mode == "auto")
        if rowcopy_pages.pages_enabled(self.pages):
            prep = self._prepare_pages(binding.spec, module, prep)
        if Replays.usable(binding) and not interpreting():
            # calls on either side of a TMA row limit take other launches: their steps are recorded apart
            splits = sorted({lim for lim in prep.tma_rows if lim is not None})
            prep = replace(prep, replays=Replays(binding, splits=tuple(splits)))
        if binding.device.type in replay.DEVICE_TYPES and not interpreting():  # where driver launches are made
            claunch.module()  # built (once per machine) with the pool, not inside its first transfer
        binding.scratch[self.name] = prep
        logger.debug("%s: groups %s, tuning %s, TMA loads %s, page loads %s", self.name,
                     [(g.names, g.width, g.word, g.vec) for g in groups], tuning, [t is not None for t in prep.tma],
                     [p is not None for p in prep.pages])

    def _optional_kernel(self, module: Any, tuning: KernelTuning, field: str, *, option: str,
                         what: str) -> tuple[Any, Tuning | None]:
        """The plugin's optional load kernel (``FIELD_KERNEL`` in its kernel module, e.g. ``TMA_LOAD_KERNEL``) and
        ``tuning.<field>``; either may be ``None`` (the path is skipped), but not while the strategy option
        ``option`` is ``True``: that is a :class:`ConfigError`."""
        attr = f"{field.upper()}_KERNEL"
        kernel, t = getattr(module, attr, None), getattr(tuning, field)
        if (kernel is None or t is None) and getattr(self, option):
            raise ConfigError(f"{self.name} has no {what} kernel ({attr} in {self.kernel_module} and a {field} "
                              f"tuning); leave the {option} option unset")
        return kernel, t

    def _prepare_tma(self, spec: PoolSpec, module: Any, prep: Prepared, *, automatic: bool) -> Prepared:
        """``prep`` with TMA load launches for every group a descriptor can address (``automatic``: those
        :func:`~hicache_core.rowcopy_tma.group_reason` takes by default)."""
        kernel, t = self._optional_kernel(module, prep.tuning, "tma_load", option="tma", what="TMA load")
        if kernel is None or t is None:
            return prep
        if importlib.util.find_spec("triton.tools.tensor_descriptor") is None:
            if self.tma:
                raise ConfigError(f"{self.name}: tma=True needs Triton tensor descriptors (Triton >= 3.4)")
            logger.info("%s: this Triton has no tensor descriptors; loads keep the row kernel", self.name)
            return prep
        launcher = _launcher(kernel, TMA_VALUES, f"{self.kernel_module}.TMA_LOAD_KERNEL", "rowcopy_tma.TMA_VALUES")
        dynamic = launcher.positions(TMA_DYNAMIC)
        plans: list[dict[int, tuple[TmaLaunch, ...]] | None] = []
        limits: list[int | None] = []
        for g in prep.groups:
            why = group_reason(g, spec.capacity, spec.page_size, t, automatic=automatic)
            if why:
                logger.info("%s: loads of %s keep the row kernel: %s", self.name, "/".join(g.names), why)
                plans.append(None)
                limits.append(None)
            else:
                plans.append(plan_group(g, capacity=spec.capacity, page_size=spec.page_size, tuning=t,
                                        launcher=launcher, dynamic=dynamic))
                limits.append(row_limit(g, automatic=automatic))
        return replace(prep, tma=tuple(plans), tma_launcher=launcher, tma_dynamic=dynamic, tma_rows=tuple(limits))

    def _prepare_pages(self, spec: PoolSpec, module: Any, prep: Prepared) -> Prepared:
        """``prep`` with a page load launch for every group :func:`~hicache_core.rowcopy_pages.group_reason`
        accepts."""
        kernel, t = self._optional_kernel(module, prep.tuning, "page_load", option="pages",
                                          what="page load")
        if kernel is None or t is None:
            return prep
        launcher = _launcher(kernel, LAUNCH_VALUES, f"{self.kernel_module}.PAGE_LOAD_KERNEL", "rowcopy.LAUNCH_VALUES")
        dynamic = launcher.positions(DYNAMIC_VALUES)
        launches: list[tuple[tuple[_Launch, int], ...] | None] = []
        page_tokens = 1 << (spec.page_size - 1).bit_length()
        for g in prep.groups:
            why = rowcopy_pages.group_reason(g, spec.page_size, strided_ok="STRIDED" in launcher.arg_names)
            if why:
                logger.info("%s: loads of %s keep the row kernel: %s", self.name, "/".join(g.names), why)
                launches.append(None)
                continue
            parts = []
            for part in rowcopy_pages.page_parts(g):
                part_words, n_parts, r1, r2, r3, r4 = rowcopy_pages.pieces(spec.page_size * part.width,
                                                                           max(1, t.tile_bytes // g.word), g.vec)
                block, _, tokens = tile(part.width, part.width, g.word, t.tile_bytes)
                tables = {**g.tables, **part.host, "dev_off": g.tables["dev_off"] + part.col}
                values = _fixed_values(spec, g, tables, t) | dict(
                    WIDTH=part.width, SPLIT=part.width, BLOCK=block, BLOCK_B=block, TOKENS=min(tokens, page_tokens),
                    PAGE_TOKENS=page_tokens, TO_HOST=False, ENTRIES_INNER=self.entries_inner, PART=part_words,
                    PARTS=n_parts, R1=r1, R2=r2, R3=r3, R4=r4, STRIDED=rowcopy_pages.strided(g, part))
                parts.append((_bound(launcher, dynamic, t, spec.page_size, values), n_parts))
            launches.append(tuple(parts))
        return replace(prep, pages=tuple(launches), page_launcher=launcher, page_dynamic=dynamic)

    def _launch(self, spec: PoolSpec, g: RowGroup, t: Tuning, to_host: bool, launcher: Any,
                dynamic: tuple[int, ...]) -> _Launch:
        block, block_b, tokens = tile(g.width, g.split, g.word, t.tile_bytes)
        values = _fixed_values(spec, g, g.tables, t) | dict(
            WIDTH=g.width, SPLIT=g.split, BLOCK=block, BLOCK_B=block_b, TOKENS=tokens, TO_HOST=to_host,
            ENTRIES_INNER=self.entries_inner)
        return _bound(launcher, dynamic, t, tokens, values)

    # -- transfers ----------------------------------------------------------------------------------
    def lane(self, binding: PoolBinding, to_host: bool) -> Lane | None:
        """The replay fast path of one direction (:meth:`hicache_core.replay.Replays.lane`), ``None`` where this
        pool does not replay (see :class:`hicache_core.strategy.Strategy` for how a pool calls it)."""
        prep: Prepared = binding.scratch[self.name]
        return None if prep.replays is None else prep.replays.lane(to_host, prep.launcher)

    def fast_load(self, binding: PoolBinding, layer: int, n: int) -> bool:
        """Whether a ``load`` of ``layer`` moving ``n`` positions goes through TMA or page loads only, no row
        kernel launch (they reach the link within microseconds, and a GEMM beside them loses nothing measurable:
        ``docs/performance.md``).  ``auto`` sends a lone per-layer load here."""
        prep: Prepared | None = binding.scratch.get(self.name)
        if prep is None or not (prep.tma or prep.pages):
            return False
        for gi, g in enumerate(prep.groups):
            by_pages = bool(prep.pages) and prep.pages[gi] is not None
            if _tma_plan(prep, gi, n) is None and not by_pages and g.entries(layer) is not None:
                return False
        return True

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        n = int(host_indices.numel())
        if n == 0:
            return
        prep: Prepared = binding.scratch[self.name]
        rp = prep.replays
        b = None if rp is None else rp.batch(host_indices, device_indices, n, to_host, prep.launcher)
        if b is not None:
            if rp.run(b, layer, to_host):  # type: ignore[union-attr]
                return
            h, d = b.h, b.d
        else:
            h, d = transfer_indices(binding, host_indices, device_indices)
        steps: list[Step] | None = [] if b is not None else None  # recorded when every launch took the driver
        with on_pool_device(binding.device):
            for gi in range(len(prep.groups)):
                route = _route(prep, gi, n, layer, to_host)
                if route is None:
                    continue
                tma, runs, ents = route
                if tma is not None:
                    steps = self._tma_loads(prep, tma, h, d, n, steps)
                    continue
                call = {"host_idx": h, "dev_idx": d, "n": n, "ents": ents, "n_ents": cast(torch.Tensor, ents).numel()}
                for lv, launcher, dyn, per_tile in runs:
                    args = _fill(lv.args, lv.slots, call)
                    kw = dict(num_warps=lv.tuning.num_warps, static_key=lv.key, dynamic=dyn,
                              maxnreg=lv.tuning.maxnreg, packs=lv.packs)
                    used = launcher(_grid(lv.tuning.programs, n, lv.tokens, per_tile), args, **kw)
                    steps = _keep(steps, used, launcher, args, lv.slots, lv.tuning.programs, lv.tokens, per_tile, kw)
        if steps is not None:  # only made with a batch, hence replays
            rp.record(cast(Batch, b), layer, to_host, steps)  # type: ignore[union-attr]

    def launch_grid(self, binding: PoolBinding, n: int, layer: int | None, *, to_host: bool) -> int:
        """The most programs one launch of a transfer of ``n`` index positions of ``layer`` (``None``: every layer)
        in this direction runs on this pool: its path's budget (``programs`` option, else the tuning, else
        ``HICACHE_KERNEL_PROGRAMS``) capped by the call's work; ``0`` where it launches nothing.  For benchmarks:
        what a GEMM beside the call competes with."""
        prep: Prepared = binding.scratch[self.name]
        most = 0
        for gi in range(len(prep.groups)) if n > 0 else ():
            route = _route(prep, gi, n, layer, to_host)
            if route is None:
                continue
            tma, runs, _ = route
            t = prep.tuning.tma_load
            grids = ([_grid(t.programs, n, lv.tokens, 1) for lv in tma] if tma is not None and t is not None else
                     [_grid(lv.tuning.programs, n, lv.tokens, per_tile) for lv, _, _, per_tile in runs])
            most = max([most, *grids])
        return most

    @staticmethod
    def _tma_loads(prep: Prepared, launches: tuple[TmaLaunch, ...], h: torch.Tensor, d: torch.Tensor, n: int,
                   steps: list[Step] | None) -> list[Step] | None:
        """One TMA launch per (pair of) entries of the layer (:func:`hicache_core.rowcopy_tma.plan_group`);
        returns ``steps`` with them appended (``None`` once one did not take the driver)."""
        t = prep.tuning.tma_load
        assert t is not None  # plans exist only with a tma_load tuning
        call = {"host_idx": h, "dev_idx": d, "n": n}
        for lv in launches:
            args = _fill(lv.args, lv.slots, call)
            kw = dict(num_warps=t.num_warps, static_key=lv.key, dynamic=prep.tma_dynamic, maxnreg=t.maxnreg,
                      packs=lv.packs)
            used = prep.tma_launcher(_grid(t.programs, n, lv.tokens, 1), args, **kw)
            steps = _keep(steps, used, prep.tma_launcher, args, lv.slots, t.programs, lv.tokens, 1, kw)
        return steps


def _grid(programs: int, n: int, tokens: int, per_tile: int) -> int:
    """The programs a launch runs: its budget, capped by its work items (tiles of ``tokens`` positions of ``n``,
    ``per_tile`` items each), at least one."""
    return max(1, min(programs, -(-n // tokens) * per_tile))


_Run = tuple["_Launch", Any, tuple[int, ...], int]  # launch, launcher, dynamic positions, work items per tile


def _route(prep: Prepared, gi: int, n: int, layer: int | None,
           to_host: bool) -> tuple[tuple[TmaLaunch, ...] | None, tuple[_Run, ...], torch.Tensor | None] | None:
    """How group ``gi`` moves a call of ``n`` positions of ``layer`` (``None``: every layer): ``(tma, (), None)``
    with the group's TMA launches of the layer, ``(None, runs, entries)`` with its row or page launches and the
    entries they cover, or ``None`` where the group holds no row of the layer.  :meth:`RowKernelStrategy.transfer`
    launches what this names."""
    plan = _tma_plan(prep, gi, n) if layer is not None and not to_host else None
    if plan is not None:
        return plan.get(cast(int, layer), ()), (), None
    ents = prep.groups[gi].entries(layer)
    if ents is None:
        return None
    n_ents = ents.numel()
    pages = prep.pages[gi] if prep.pages and not to_host else None
    if pages is None:
        return None, ((prep.launches[gi][to_host], prep.launcher, prep.dynamic, n_ents),), ents
    # work items: parts of each page of each entry, one launch per host part of the rows
    return None, tuple((lv, prep.page_launcher, prep.page_dynamic, n_ents * n_parts) for lv, n_parts in pages), ents


def _fixed_values(spec: PoolSpec, g: RowGroup, tables: dict[str, torch.Tensor], t: Tuning) -> dict[str, Any]:
    """The launch values every launch of ``g`` shares (per-call ones ``None``), with entry ``tables``."""
    return dict(anchor=g.anchor, host_idx=None, dev_idx=None, n=None, ents=None, n_ents=None, **tables,
                page_size=spec.page_size, capacity=spec.capacity, dev_rows=g.rows, VEC=g.vec, STAGES=t.stages)


def _bound(launcher: Any, dynamic: tuple[int, ...], t: Tuning, tokens: int, values: dict[str, Any]) -> _Launch:
    """A fixed launch: ``values`` bound by ``launcher``'s parameter names, its static key and per-call slots."""
    args = launcher.bind(values)
    slots = tuple((name, i) for i, name in enumerate(launcher.arg_names) if name in DYNAMIC_VALUES)
    return _Launch(tokens, launcher.static_key(args, dynamic), t, args, slots)


def _tma_plan(prep: Prepared, gi: int, n: int) -> dict[int, tuple[TmaLaunch, ...]] | None:
    """Group ``gi``'s TMA load launches by layer when TMA takes a per-layer load of ``n`` positions, else ``None``."""
    plan = prep.tma[gi] if prep.tma else None
    limit = prep.tma_rows[gi] if plan is not None else None
    return plan if plan is not None and (limit is None or n <= limit) else None


def _keep(steps: list[Step] | None, used: Any, launcher: Any, args: list, slots: tuple[tuple[str, int], ...],
          programs: int, tokens: int, per_tile: int, kw: dict) -> list[Step] | None:
    """``steps`` with this launch's :class:`~hicache_core.replay.Step` appended, or ``None`` when it did not
    go through the driver (``used`` is ``None``) or does not take all three batch values."""
    if steps is None or used is None:
        return None
    pos = dict(slots)
    if not {"host_idx", "dev_idx", "n"} <= pos.keys():
        return None
    steps.append(replay_step(used, launcher, args, (pos["host_idx"], pos["dev_idx"], pos["n"]), programs=programs,
                             tokens=tokens, per_tile=per_tile, fallback=kw))
    return steps


def _fill(fixed: tuple, slots: tuple[tuple[str, int], ...], call: dict[str, Any]) -> list:
    """A launch's positional arguments: ``fixed`` with each per-call slot set from ``call``."""
    args = list(fixed)
    for name, i in slots:
        args[i] = call[name]
    return args


def _launcher(kernel: Any, names: dict[str, str], where: str, table: str) -> Any:
    """The shared :class:`~hicache_core.launch.Launcher` of ``kernel``, after checking its parameter names."""
    from .launch import Launcher

    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = Launcher(kernel)
    unknown = set(launcher.arg_names) - set(names)
    if unknown:
        from .registry import did_you_mean

        hints = [h for u in sorted(unknown) if (h := did_you_mean(u, names))]
        raise ConfigError(f"{where} declares {sorted(unknown)}, which the row-copy launch does not provide; "
                          f"use names from hicache_core.{table}" + "".join(f" ({h})" for h in hints))
    return launcher

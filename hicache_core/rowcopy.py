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
parameters it uses from :data:`LAUNCH_VALUES`, in any order.  Importing this
module imports no Triton (``prepare``, and ``describe`` on CUDA, import the
plugin's kernel module).

This module keeps :class:`RowKernelStrategy`; the rest of the host side lives by role in
:mod:`hicache_core.rowcopy_tuning` (tunings, tiles), :mod:`hicache_core.rowcopy_groups` (row groups) and
:mod:`hicache_core.rowcopy_launch` (launch values, the prepared record, routing and launch helpers), and every
name is importable from here too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from dataclasses import replace
from typing import Any, ClassVar, cast

import torch

from . import claunch, replay
from .binding import PoolBinding
from .errors import ConfigError
from .kernel_support import (
    dependent_launches,
    interpreting,
    kernel_unsupported_reason,
    on_pool_device,
    require_pinned,
    sm_budget,
    transfer_indices,
)
from .layout import Layout
from .replay import Batch, Lane, Replays, Step, replay_enabled
from .spec import PoolSpec
from .strategy import DirectionalStrategy
from .rowcopy_tma import (AUTO_MAX_STRIDED_ROWS, AUTO_MIN_BOX_BYTES, AUTO_MIN_ROW_BYTES, DYNAMIC as TMA_DYNAMIC,
                          TMA_VALUES, TmaLaunch, group_reason, plan_group, row_limit, tma_mode)
from .validate import parse_programs
from . import rowcopy_pages

# Every name of the former single module stays importable from here.  Names the strategy uses are looked up here (a
# test that replaces tma_mode or interpreting patches them here); the launcher cache _LAUNCHERS is rowcopy_launch's.
from .rowcopy_groups import RowGroup, _fusable, _group, _host_tables, build_groups  # noqa: F401
from .rowcopy_launch import (  # noqa: F401
    DYNAMIC_VALUES, LAUNCH_VALUES, _LAUNCHERS, Prepared, _bound, _fill, _fixed_values, _grid, _keep,
    _Launch, _launcher, _route, _Run, _split_plan, _splits, _tma_plan, entry_tails, exact_shape, split_shape)
from .rowcopy_tuning import (  # noqa: F401
    BACKUP_LAUNCH_BYTES, MAX_BLOCK_BYTES, MAX_TILE_BYTES, MAX_TOKENS, MAX_VECTOR_BYTES, PAGE_BACKUP_TUNING,
    PAGE_LOAD_TUNING, TMA_LOAD_TUNING, KernelTuning, Tuning, _pow2_ceil, _pow2_floor, tile)

__all__ = ["Tuning", "KernelTuning", "TMA_LOAD_TUNING", "PAGE_LOAD_TUNING", "PAGE_BACKUP_TUNING", "BACKUP_LAUNCH_BYTES",
           "RowGroup", "RowKernelStrategy", "build_groups", "tile", "LAUNCH_VALUES", "DYNAMIC_VALUES", "MAX_BLOCK_BYTES",
           "MAX_TOKENS", "MAX_VECTOR_BYTES"]

logger = logging.getLogger(__name__)


def _splitting(tuning: KernelTuning) -> tuple[bool, bool]:
    """By ``to_host``: whether a direction's tunings split calls (``launch_bytes``: loads' row or page loads, backups)."""
    return (any(t is not None and bool(t.launch_bytes) for t in (tuning.load, tuning.page_load)),
            bool(tuning.backup.launch_bytes))


def _size(nbytes: int) -> str:
    """``nbytes`` as ``explain`` prints a size: whole MiB as such, else bytes."""
    return f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{nbytes} B"


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
    :param backup_fence: each backup program waits after each tile until the GPU has taken the tile's host writes
        (:func:`hicache_core.kernel_lib.tile_done`), which bounds the writes in flight that slow a concurrent GEMM:
        ``True`` (every group), ``False``, or ``None`` for the tuning's (``backup.fence`` for rows of at least
        ``backup.fence_min_row_bytes``); kernels that do not declare ``FENCE`` ignore it.
    :param backup_launch_bytes: the most bytes one backup launch moves (``Tuning.launch_bytes``): a backup of more
        is split into launches back to back (some layers each; with ``entries_inner``, every layer of a run of
        positions), so that a GEMM beside it gets the SMs back between them; a launch still moves at least one
        layer's rows, or one aligned run of positions, even where those are more; ``0``: one launch; ``None``: the
        tuning's.
    :param backup_pdl: a backup's launches after its first are programmatic dependent launches (``Tuning.pdl``; CUDA
        devices of compute capability 9.0 and later, kernels that declare ``PDL``): each may begin while the one
        before drains its last tiles; ``None``: the tuning's.
    :param fuse_parts: move a row split over two host buffers in one launch (``None``: the class default).
    :param tma: per-layer loads through tensor descriptors (TMA bulk copies) where the host addressing
        allows: ``True``, ``False``, or ``None`` for ``HICACHE_KERNEL_TMA`` when set, else on CUDA compute
        capability 9.x for rows of >= 1152 bytes in boxes of >= 16 KiB, when the strategy has a TMA load
        kernel
        (:func:`hicache_core.rowcopy_tma.tma_mode`).
    :param pages: loads of whole pages as flat words where the layout keeps a layer's page contiguous
        (:mod:`hicache_core.rowcopy_pages`): ``True`` (every group whose host rows allow it), ``False``, or ``None``
        for ``HICACHE_KERNEL_PAGES`` when set, else automatic: groups whose pages hold at least
        :data:`~hicache_core.rowcopy_pages.AUTO_MIN_PART_BYTES` per host part; when the strategy has a page load
        kernel; calls TMA takes stay TMA's.
    :param page_backups: backups of whole pages as flat words (:func:`hicache_core.rowcopy_pages.backup_reason`;
        ``KernelTuning.page_backup``, a kernel that declares ``PAGES``): ``True`` (every group whose rows allow it),
        ``False``, or ``None`` for automatic where :data:`~hicache_core.rowcopy_pages.AUTO_PAGE_BACKUPS` is on (on
        in this release: rows of at most
        :data:`~hicache_core.rowcopy_pages.PAGE_BACKUP_MAX_ROW_BYTES` in pages of at least
        :data:`~hicache_core.rowcopy_pages.PAGE_BACKUP_MIN_PAGE_BYTES`).  Page backups take ``backup_programs``,
        ``programs`` and ``backup_launch_bytes`` as row backups do; they neither fence nor chain launches.
    """

    name: ClassVar[str]
    layouts: ClassVar[tuple[str, ...]]
    kernel_module: ClassVar[str]
    tuning: ClassVar[KernelTuning]
    fuse_parts: ClassVar[bool] = False
    entries_inner: ClassVar[bool] = False
    #: Whether the ``page_backups`` option unset takes page backups automatically (with
    #: :data:`~hicache_core.rowcopy_pages.AUTO_PAGE_BACKUPS`): a plugin keeps its page backups opt-in (``False``) until
    #: they have run bit-exact on a GPU and measured ahead of its row backups.
    auto_page_backups: ClassVar[bool] = True

    def __init__(self, programs: int | None = None, *, backup_programs: int | None = None,
                 num_warps: int | None = None, tile_bytes: int | None = None, num_stages: int | None = None,
                 maxnreg: int | None = None, backup_fence: bool | None = None,
                 backup_launch_bytes: int | None = None, backup_pdl: bool | None = None,
                 fuse_parts: bool | None = None,
                 tma: bool | None = None, pages: bool | None = None, page_backups: bool | None = None) -> None:
        self.programs = None if programs is None else parse_programs(programs, "programs")
        self.backup_programs = None if backup_programs is None else parse_programs(backup_programs,
                                                                                     "backup_programs")
        if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)
                                       or num_stages < 1):  # (Tuning's own check would name its field, stages)
            raise ConfigError(f"num_stages must be a positive int, got {num_stages!r}")
        self._overrides: dict[str, Any] = {
            k: v for k, v in (("num_warps", num_warps), ("tile_bytes", tile_bytes), ("stages", num_stages),
                              ("maxnreg", maxnreg)) if v is not None}
        Tuning(1, self._overrides.get("num_warps", 1), self._overrides.get("tile_bytes", 1),
               self._overrides.get("stages", 1), self._overrides.get("maxnreg"))  # validates
        if backup_fence is not None and not isinstance(backup_fence, bool):
            raise ConfigError(f"backup_fence must be True, False or None (the tuning's), got {backup_fence!r}")
        self.backup_fence = backup_fence
        if backup_launch_bytes is not None and (isinstance(backup_launch_bytes, bool)
                                                or not isinstance(backup_launch_bytes, int) or backup_launch_bytes < 0):
            raise ConfigError(f"backup_launch_bytes must be an int >= 0 (0: one launch per call) or None (the "
                              f"tuning's), got {backup_launch_bytes!r}")
        self.backup_launch_bytes = backup_launch_bytes
        if backup_pdl is not None and not isinstance(backup_pdl, bool):
            raise ConfigError(f"backup_pdl must be True, False or None (the tuning's), got {backup_pdl!r}")
        self.backup_pdl = backup_pdl
        if fuse_parts is not None:
            self.fuse = bool(fuse_parts)
        else:
            self.fuse = type(self).fuse_parts
        if tma is not None and not isinstance(tma, bool):
            raise ConfigError(f"tma must be True, False or None (automatic), got {tma!r}")
        self.tma = tma
        if pages is not None and not isinstance(pages, bool):
            raise ConfigError(f"pages must be True, False or None (HICACHE_KERNEL_PAGES, else automatic), got "
                              f"{pages!r}")
        self.pages = pages
        if page_backups is not None and not isinstance(page_backups, bool):
            raise ConfigError(f"page_backups must be True, False or None (automatic), got {page_backups!r}")
        self.page_backups = page_backups

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

    def _kernel_params(self) -> tuple[str, ...]:
        """The parameter names of ``kernel_module``'s ``KERNEL`` (none where it cannot be imported: the first transfer
        raises that error with its fix)."""
        try:
            kernel = importlib.import_module(self.kernel_module).KERNEL
        except Exception as exc:  # noqa: BLE001 - explain describes; the transfer reports it
            logger.debug("describe: %s.KERNEL not importable (%s)", self.kernel_module, exc)
            return ()
        return tuple(getattr(kernel, "arg_names", ()))

    def describe(self, spec: PoolSpec, layout: Layout) -> list[str]:
        """The launch shape per direction on ``spec``'s device, for ``hicache explain``."""
        t = self.effective_tuning(spec.device)
        # the launch passes FENCE on CUDA only, PDL on compute capability >= 9.0 only, to kernels that declare them:
        # where either could apply, the kernel module is imported to read its parameters (as the first call would)
        cuda = spec.device.type == "cuda" and not interpreting()
        params = self._kernel_params() if cuda else ()
        fences = cuda and "FENCE" in params
        dependents = cuda and dependent_launches(spec.device) and "PDL" in params

        def one(d: Tuning) -> str:
            extra = ((f", {d.stages} stages" if d.stages > 1 else "") + (f", maxnreg {d.maxnreg}" if d.maxnreg else "")
                     + (", each tile's writes awaited (fenced)" + (f" for rows of >= {d.fence_min_row_bytes} B"
                                                                  if d.fence_min_row_bytes else "")
                        if d.fence and fences else "")
                     + (f", launches of up to {_size(d.launch_bytes)} (a call of more: "
                        + ("every layer of a run of whole pages" if self.entries_inner else "some layers") + " per launch)"
                        + (", each after the first a programmatic dependent launch" if d.pdl and dependents else "")
                        if d.launch_bytes else ""))
            return f"{d.programs} programs x {d.num_warps} warps, {d.tile_bytes} B tiles{extra}"
        tma = ""
        mode = tma_mode(self.tma, spec.device)
        if t.tma_load is not None and mode is not None:
            where = ("where a descriptor can address the host rows" if mode == "all" else
                     f"of rows of >= {AUTO_MIN_ROW_BYTES} bytes in boxes of >= {AUTO_MIN_BOX_BYTES // 1024} KiB "
                     f"(rows strided on the host: calls of <= {AUTO_MAX_STRIDED_ROWS} rows)")
            tma = f"; per-layer loads {where} by TMA {one(t.tma_load)}"
        pages = ""
        page_mode = rowcopy_pages.pages_mode(self.pages)
        if t.page_load is not None and page_mode is not None:
            floor = ("" if page_mode == "all" else
                     f" of >= {rowcopy_pages.AUTO_MIN_PART_BYTES} bytes per host buffer")
            pages = (f"; loads of whole pages{floor} where a layer's host page is a packed run (per host buffer of a "
                     f"split row; the rest gathered by rows) {one(t.page_load)}")
        page_backups = ""
        automatic = self.page_backups is None and self.auto_page_backups and rowcopy_pages.AUTO_PAGE_BACKUPS
        # (host rows not packed, or pages of one token or of more than MAX_PAGE_TOKENS: never taken)
        plan = None if layout is None else layout.plan(spec)
        takes = (2 <= spec.page_size <= rowcopy_pages.MAX_PAGE_TOKENS
                 and (plan is None or rowcopy_pages.packed_host_rows(plan)))
        if t.page_backup is not None and (self.page_backups or automatic) and takes:
            held = {c.name for c in spec.components if spec.component_map(c.name).device_layers}
            which = ("where" if self.page_backups else
                     f"of rows of <= {rowcopy_pages.PAGE_BACKUP_MAX_ROW_BYTES} B in pages of >= "
                     f"{rowcopy_pages.PAGE_BACKUP_MIN_PAGE_BYTES // 1024} KiB"
                     + (f" ({rowcopy_pages.automatic_backup_fit(plan, spec.page_size, held)})"
                        if plan is not None else "") + " where")
            page_backups = f"; backups of whole pages {which} host and device rows are packed {one(t.page_backup)}"
        lines = [f"{self.name}: backups {one(t.backup)}; loads {one(t.load)}{tma}{pages}{page_backups} (options "
                 "programs, backup_programs, num_warps, tile_bytes, num_stages, maxnreg, backup_fence, "
                 "backup_launch_bytes, backup_pdl, tma, pages, page_backups; "
                 "HICACHE_KERNEL_PROGRAMS, "
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
        backups = one(self.tuning.backup, backup)
        if self.backup_fence is not None:
            backups = replace(backups, fence=self.backup_fence, fence_min_row_bytes=0)
        if self.backup_launch_bytes is not None:
            backups = replace(backups, launch_bytes=self.backup_launch_bytes)
        if self.backup_pdl is not None:
            backups = replace(backups, pdl=self.backup_pdl)
        page_backups = self.tuning.page_backup
        if page_backups is not None:
            page_backups = one(page_backups, backup)
            if self.backup_launch_bytes is not None:
                page_backups = replace(page_backups, launch_bytes=self.backup_launch_bytes)
        return KernelTuning(backups, one(self.tuning.load, both),
                            None if tma is None else one(tma, both), None if page is None else one(page, both),
                            page_backups)

    def prepare(self, binding: PoolBinding) -> None:
        """Check pinning, import the kernel, build groups, fixed launch values and keys (once per pool)."""
        require_pinned(binding, self.name)
        module = importlib.import_module(self.kernel_module)
        launcher = _launcher(module.KERNEL, LAUNCH_VALUES, f"{self.kernel_module}.KERNEL", "rowcopy.LAUNCH_VALUES")
        tuning = self.effective_tuning(binding.device)
        groups = build_groups(binding, fuse_parts=self.fuse, strategy=self.name)
        dynamic = launcher.positions(DYNAMIC_VALUES)
        if self.page_backups and (tuning.page_backup is None or "PAGES" not in launcher.arg_names):
            raise ConfigError(f"{self.name} has no page backups (a KERNEL in {self.kernel_module} declaring PAGES and "
                              "a page_backup tuning); leave the page_backups option unset")
        launches = tuple({to_host: self._launch(binding.spec, g, tuning, to_host, launcher, dynamic)
                          for to_host in (True, False)} for g in groups)
        splitting = _splitting(tuning)
        prep = Prepared(groups, launches, launcher, dynamic, tuning,
                        tails=entry_tails(groups, binding.device) if any(splitting) else {})
        mode = tma_mode(self.tma, binding.device)
        if mode is not None:
            prep = self._prepare_tma(binding.spec, module, prep, automatic=mode == "auto")
        pages = rowcopy_pages.pages_mode(self.pages)
        if pages is not None:
            prep = self._prepare_pages(binding.spec, module, prep, automatic=pages == "auto")
        if Replays.usable(binding) and not interpreting():
            prep = replace(prep, replays=self._replays(binding, prep, splitting))
        if binding.device.type in replay.DEVICE_TYPES and not interpreting():  # where driver launches are made
            claunch.module()  # built (once per machine) with the pool, not inside its first transfer
        binding.scratch[self.name] = prep
        logger.debug("%s: groups %s, tuning %s, TMA loads %s, page loads %s", self.name,
                     [(g.names, g.width, g.word, g.vec) for g in groups], tuning, [t is not None for t in prep.tma],
                     [p is not None for p in prep.pages])

    def _replays(self, binding: PoolBinding, prep: Prepared, splitting: tuple[bool, bool]) -> Replays:
        """The pool's :class:`~hicache_core.replay.Replays`: calls on either side of a TMA row limit take other launches,
        and in a direction whose tuning sets ``launch_bytes`` (``splitting``, by ``to_host``: :func:`_splitting`)
        calls whose counts split otherwise: each records its steps apart (runs of positions per exact count, a bounded
        number of counts: :func:`exact_shape`).  A direction that never splits keys its steps without working out a
        split (its shape is ``None``): its replays, per-layer loads above all, pay nothing for the other's."""
        splits = tuple(sorted({lim for lim in prep.tma_rows if lim is not None}))
        if not any(splitting):
            return Replays(binding, splits=splits)
        split = functools.partial(split_shape, prep, self.entries_inner, binding.spec.page_size)

        def shape(n: int, layer: int | None, to_host: bool) -> tuple | None:
            return split(n, layer, to_host) if splitting[to_host] else None
        return Replays(binding, splits=splits, shape=shape, exact=exact_shape)

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

    def _prepare_pages(self, spec: PoolSpec, module: Any, prep: Prepared, *, automatic: bool) -> Prepared:
        """``prep`` with a page load launch for every group :func:`~hicache_core.rowcopy_pages.group_reason`
        accepts (``automatic``: those it takes by default)."""
        kernel, t = self._optional_kernel(module, prep.tuning, "page_load", option="pages",
                                          what="page load")
        if kernel is None or t is None:
            return prep
        launcher = _launcher(kernel, LAUNCH_VALUES, f"{self.kernel_module}.PAGE_LOAD_KERNEL", "rowcopy.LAUNCH_VALUES")
        dynamic = launcher.positions(DYNAMIC_VALUES)
        launches: list[tuple[tuple[_Launch, int], ...] | None] = []
        page_tokens = 1 << (spec.page_size - 1).bit_length()
        for g in prep.groups:
            why = rowcopy_pages.group_reason(g, spec.page_size, strided_ok="STRIDED" in launcher.arg_names,
                                             automatic=automatic)
            if why:
                logger.info("%s: loads of %s keep the row kernel: %s", self.name, "/".join(g.names), why)
                launches.append(None)
                continue
            parts = []
            for part in rowcopy_pages.page_parts(g):
                group, part_words, n_parts, r1, r2, r3, r4 = rowcopy_pages.launch_pieces(
                    spec.page_size * part.width, g.word, g.vec, page_tokens, t.tile_bytes,
                    grouping="GROUP" in launcher.arg_names)
                block, _, tokens = tile(part.width, part.width, g.word, t.tile_bytes)
                tables = {**g.tables, **part.host, "dev_off": g.tables["dev_off"] + part.col}
                values = _fixed_values(spec, g, tables, t) | dict(
                    WIDTH=part.width, SPLIT=part.width, BLOCK=block, BLOCK_B=block, TOKENS=min(tokens, page_tokens),
                    PAGE_TOKENS=page_tokens, TO_HOST=False, ENTRIES_INNER=self.entries_inner, PART=part_words,
                    PARTS=n_parts, R1=r1, R2=r2, R3=r3, R4=r4, STRIDED=rowcopy_pages.strided(g, part), GROUP=group)
                # a grid covers cdiv(n, page_size * group) items per entry and part
                parts.append((_bound(launcher, dynamic, t, spec.page_size * group, values, part.width * g.word),
                              n_parts))
            launches.append(tuple(parts))
        return replace(prep, pages=tuple(launches), page_launcher=launcher, page_dynamic=dynamic)

    def _page_backups(self, spec: PoolSpec, g: RowGroup, tuning: KernelTuning, launcher: Any) -> bool:
        """Whether ``g``'s backups copy whole pages (``page_backups`` option, the kernel and tuning, and
        :func:`~hicache_core.rowcopy_pages.backup_reason`)."""
        if self.page_backups is False or tuning.page_backup is None or "PAGES" not in launcher.arg_names:
            return False
        automatic = self.page_backups is None
        if automatic and not self.auto_page_backups:
            logger.info("%s: backups of %s go by rows: its page backups are opt-in (page_backups=True)", self.name,
                        "/".join(g.names))
            return False
        why = rowcopy_pages.backup_reason(g, spec.page_size, automatic=automatic)
        if why:
            logger.info("%s: backups of %s go by rows: %s", self.name, "/".join(g.names), why)
        return why is None

    def _launch(self, spec: PoolSpec, g: RowGroup, tuning: KernelTuning, to_host: bool, launcher: Any,
                dynamic: tuple[int, ...]) -> _Launch:
        pages = to_host and self._page_backups(spec, g, tuning, launcher)
        t = cast(Tuning, tuning.page_backup) if pages else tuning.direction(to_host)
        block, block_b, tokens = tile(g.width, g.split, g.word, t.tile_bytes)
        values = _fixed_values(spec, g, g.tables, t) | dict(
            WIDTH=g.width, SPLIT=g.split, BLOCK=block, BLOCK_B=block_b, TOKENS=tokens, TO_HOST=to_host,
            ENTRIES_INNER=self.entries_inner, PAGES=pages, PAGE_TOKENS=1, PAGE_CHUNK=1)
        if pages:  # (row launches pass 1 for these two; PAGE_SIZE, bound for every launch, keys them per page size)
            page_words = spec.page_size * g.width  # a step of at most a page (padded to a power of two)
            values |= dict(PAGE_TOKENS=1 << (spec.page_size - 1).bit_length(),
                           PAGE_CHUNK=max(g.vec, min(_pow2_floor(t.tile_bytes // g.word), _pow2_ceil(page_words))))
        return _bound(launcher, dynamic, t, tokens, values, g.width * g.word)

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
                ents = cast(torch.Tensor, ents)
                for lv, launcher, dyn, per_tile in runs:
                    kw = dict(num_warps=lv.tuning.num_warps, static_key=lv.key, dynamic=dyn,
                              maxnreg=lv.tuning.maxnreg, packs=lv.packs)
                    # one launch, unless the tuning's launch_bytes splits the call (rowcopy_launch._split_plan); with
                    # lv.pdl, each after the first a programmatic dependent launch, each but the last letting the next
                    # begin (_Launch.split_launch; recorded and replayed as any other)
                    start = 0  # where the launch's positions start (a call split by positions; else it moves all n)
                    split = _splits(prep, ents, lv, h, d, n, self.entries_inner, binding.spec.page_size)
                    for i, (sub, hs, ds) in enumerate(split):
                        m = hs.numel()
                        call = {"host_idx": hs, "dev_idx": ds, "n": m, "ents": sub, "n_ents": sub.numel()}
                        args = _fill(lv.args, lv.slots, call)
                        kw_i = lv.split_launch(args, i, len(split) - 1, kw)
                        items = per_tile // ents.numel() * sub.numel()
                        used = launcher(_grid(lv.tuning.programs, m, lv.tokens, items), args, **kw_i)
                        steps = _keep(steps, used, launcher, args, lv.slots, lv.tuning.programs, lv.tokens, items,
                                      kw_i, None if m == n else (start, m))
                        start += m
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
            tma, runs, ents = route
            t = prep.tuning.tma_load
            if tma is not None and t is not None:
                most = max([most, *(_grid(t.programs, n, lv.tokens, 1) for lv in tma)])
                continue
            k = cast(torch.Tensor, ents).numel()
            for lv, _, _, per_tile in runs:  # a split's first launch holds the most work (its last may hold less)
                per, step = _split_plan(lv, k, n, self.entries_inner, binding.spec.page_size)
                most = max(most, _grid(lv.tuning.programs, min(step, n), lv.tokens, per_tile // k * min(per, k)))
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

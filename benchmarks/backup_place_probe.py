"""Why did the page-major kernels back fp8 656-byte rows up at half the link? Host placement or page arithmetic (GPU).

Usage: ``python benchmarks/backup_place_probe.py --out place.json [--gemm]``, or, for Nsight Compute, one
variant's backups only: ``ncu ... -k regex:^KERNEL python benchmarks/backup_place_probe.py --profile LABEL``.

On the H200 (2026-12-06) ``page_first_direct``'s kernel moved one-layer and all-layer backups of MLA fp8 656-byte
rows at 0.47-0.49 of memcpy where ``layer_first``'s moved them at 0.77-0.90, at the same launch values.  The two
kernels differed in two ways, and each variant here isolates one:

* **where the host rows are**: a layer's 64 pages lie 2.56 MB apart in ``page_first_direct`` and side by side in
  ``layer_first``.  ``layer_first ... spread K`` puts ``layer_first``'s host pages K pages apart (a pool of K times
  the tokens, host page ``i`` at page ``i * K``): at K = 61 a layer's pages span what ``page_first_direct``'s span;
* **the page arithmetic**: every thread computes the host offsets of all its tile's rows
  (:func:`hicache_core.kernel_lib.paged_rows`).  The plugins' kernels now divide by the constexpr ``PAGE_SIZE``
  (a shift); ``... runtime page_size`` is the kernel as it was, dividing by the runtime ``page_size`` (a 64-bit
  division per row: this module's ``KERNEL``, the strategy ``probe.runtime_page``, io_backend ``probe``).

With ``--loads`` each row also gives one-layer loads and load bursts (every layer in turn), with the GEMM beside
the bursts: ``... runtime page_size`` then loads whole pages through the page-load kernel as it was too (the
module's ``PAGE_LOAD_KERNEL``, runtime page size; ``layer_first``'s through the strategy ``probe.runtime_page_lf``,
whose row kernel is the plugin's), beside :data:`hicache_core.kernel_lib.PAGE_LOAD` (constexpr ``PAGE_SIZE``).
That compares the two page-load kernels only where loads take them: rows narrower than automatic TMA takes (the
fp8 variants); wider rows (bf16 576, MHA) load through the shared TMA kernel in both.

Launch-shape variants (more programs, more stages) and the other row widths stand beside them, and
``page_first_kv_split``'s kernel in the order ``page_first_direct``'s walks (``... layer-major``: the strategy
``probe.kv_layer_major``, io_backend ``probe``) and with 8 warps instead of its 4 (``... 4 warps`` variants name
its default); ``... unfenced`` variants back up without the per-tile fence the plugins' backups now keep
(``backup_fence=False``; :func:`hicache_core.kernel_lib.tile_done`), ``... fenced 64K`` ones fence every row with
tiles of 64 KiB; ``... one launch`` backs up every layer in one launch (``backup_launch_bytes=0``; the plugins split
an all-layer backup into launches of at most :data:`hicache_core.rowcopy.BACKUP_LAUNCH_BYTES`), ``... launches of N
MiB`` in launches of N MiB, ``... pdl`` with each launch after a backup's first a programmatic dependent launch
(``backup_pdl=True``, sm_90+; the plugins' default since 2026-12-07, ``... no pdl`` without), ``... page backups``
(``layer_first`` rows) with the plugin's own backups of whole pages as flat words (``page_backups=True``,
:func:`hicache_core.kernel_lib.page_backup`, as ``... plugin page backups``: whether host lines written whole make
narrow rows such as fp8 656 B, which end mid-line, back up faster or steadier; the earlier records of these labels,
calls 68-69, came from a probe kernel of the same algorithm, since removed), ``... 16 programs`` with 16 backup
programs, and ``... 2 programs 32 warps 128K`` backs up with two wide fenced programs. Options (``programs``,
``num_warps``, ``num_stages``) apply to every direction: a variant's loads run with them too, page loads included.
Every variant is checked bit-exact first (:func:`hicache_core.bench._check`: a round trip from scrambled buffers);
each row gives the ratio to a pinned memcpy of the same bytes in this run, the host time of one all-layer backup
issued on an idle GPU (``host_all_layers_us``, median: e.g. ``... pdl`` against ``... no pdl`` in one process), and
with ``--gemm`` the slowdown of a bf16 8192^3 GEMM on another stream during all-layer backups (with ``--bursts`` also
a burst of one-layer backups, and the GEMM beside it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import statistics
import sys
import types
from pathlib import Path
from typing import Any, Callable

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core import StrategyInfo, hookimpl  # noqa: E402
from hicache_core import kernel_lib as kl, rowcopy_pages  # noqa: E402
from hicache_core.bench import _check, _gemm_slowdown, _host_us, _median_ms, _Memcpy, _workload  # noqa: E402
from hicache_core.bench.timing import _queue, _two_streams  # noqa: E402
from hicache_core.pool import HostKVPool  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402

#: This module's import name, where the variant strategy finds ``KERNEL`` (run as a script: its file name).
MODULE = __name__ if __name__ != "__main__" else "backup_place_probe"


@triton.jit(do_not_specialize=["n", "n_ents"])
def KERNEL(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok, page_size,
           capacity, dev_rows, WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr, VEC: tl.constexpr,
           TO_HOST: tl.constexpr, STAGES: tl.constexpr, ENTRIES_INNER: tl.constexpr):
    pid, nprog = kl.programs()
    n_tiles, n_items = kl.work_size(n, n_ents, TOKENS)
    for item in tl.range(pid, n_items, nprog, num_stages=STAGES):
        e, tile = kl.work_item(item, ents, n_tiles, n_ents, ENTRIES_INNER)
        h, d, ok = kl.index_tile(host_idx, dev_idx, tile, n, capacity, dev_rows, TOKENS)
        host_row = kl.paged_rows(host_off, host_page, host_tok, e, h, page_size)  # page_size: a runtime value
        kl.move_rows(anchor, kl.device_rows(dev_off, dev_stride, e, d), host_row, ok, WIDTH, BLOCK, VEC, TO_HOST)


@triton.jit(do_not_specialize=["n", "n_ents"])
def PAGE_LOAD_KERNEL(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
                     page_size, capacity, dev_rows, WIDTH: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
                     PAGE_TOKENS: tl.constexpr, VEC: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr,
                     R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr, R4: tl.constexpr, STAGES: tl.constexpr,
                     STRIDED: tl.constexpr):
    kl.page_load(anchor, host_idx, dev_idx, n, ents, n_ents, dev_off, dev_stride, host_off, host_page, host_tok,
                 capacity, dev_rows, page_size, WIDTH, BLOCK, TOKENS, PAGE_TOKENS, VEC, PART, PARTS, R1, R2, R3, R4,
                 STAGES, STRIDED)  # page_size: a runtime value


#: Per-layer TMA loads as the plugins have them (automatic TMA takes rows of >= 1152 bytes: the bf16 and MHA variants).
TMA_LOAD_KERNEL = kl.PAGED_TMA_LOAD
#: ``layer_first``'s row kernel with the page-load kernel as it was: a module of its own, as a strategy names one.
LF_MODULE = f"{MODULE}_layer_first_runtime"


def _lf_module() -> None:
    if LF_MODULE not in sys.modules:
        from hicache_layer_first import kernels as lf  # type: ignore[import-not-found]  # a plugin, not the core

        sys.modules[LF_MODULE] = types.SimpleNamespace(KERNEL=lf.KERNEL, TMA_LOAD_KERNEL=lf.TMA_LOAD_KERNEL,
                                                       PAGE_LOAD_KERNEL=PAGE_LOAD_KERNEL)  # type: ignore[assignment]


#: The probe's strategies: name -> (layout, the plugin strategy it subclasses (module, class), the class attributes
#: it changes, description).
STRATEGIES: dict[str, tuple[str, str, str, dict[str, Any], str]] = {
    "probe.runtime_page": ("page_first_direct", "hicache_page_first.strategy", "PageFirstDirectKernelStrategy",
                           {"kernel_module": MODULE}, "page_first_direct's kernels, runtime page size"),
    "probe.runtime_page_lf": ("layer_first", "hicache_layer_first.strategy", "LayerFirstKernelStrategy",
                              {"kernel_module": LF_MODULE}, "layer_first, page loads by runtime page size"),
    "probe.kv_layer_major": ("page_first_kv_split", "hicache_kv_split.strategy", "KVSplitKernelStrategy",
                             {"entries_inner": False}, "page_first_kv_split's kernel, layer-major"),
}


#: The io_backend the probe's strategies register under (one strategy per layout and io_backend).
BACKEND = "probe"


def _strategy(name: str, **options: Any) -> Any:
    """An instance of probe strategy ``name`` (:data:`STRATEGIES`)."""
    _, module, base, attrs, _ = STRATEGIES[name]
    _lf_module()
    cls = type(name, (getattr(importlib.import_module(module), base),), {"name": name, **attrs})
    return cls(**options)


class _Plugin:
    """Under their own io_backend, ``probe``: ``page_first_direct``'s kernels as they were, ``layer_first`` with the
    page-load kernel as it was, and ``page_first_kv_split``'s
    kernel walking the token tiles of one layer entry before the next (``ENTRIES_INNER`` off; its default is on)."""

    @staticmethod
    @hookimpl
    def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
        for name, (layout, _, _, _, what) in STRATEGIES.items():
            register(StrategyInfo(name, BACKEND, (layout,), functools.partial(_strategy, name),
                                  sharded=(False, True), description=f"probe: {what}"))


#: label -> (shape, layout, host page spread, strategy override, strategy options).  A label that names no option runs
#: the plugin's defaults of the day: whole-page backups for MLA rows in pages of 64 on `layer_first` (since
#: 2026-12-07) and `page_first_direct` (since 2026-12-08; rowcopy_pages.AUTO_PAGE_BACKUPS); `... row backups` keeps rows.
VARIANTS: dict[str, tuple[str, str, int, str | None, dict[str, int]]] = {
    "fp8-656 layer_first": ("mla61x656-fp8", "layer_first", 1, None, {}),
    "fp8-656 layer_first spread 16": ("mla61x656-fp8", "layer_first", 16, None, {}),
    "fp8-656 layer_first spread 61": ("mla61x656-fp8", "layer_first", 61, None, {}),
    # layer_first's own backups of whole pages as flat words (page_backups=True, kernel_lib.page_backup; the same as
    # "... plugin page backups"): every host line written whole, but a page's ends.  Their records of calls 68-69 came
    # from a probe kernel of the same algorithm, since removed, launched as row backups are (8 programs): these labels
    # keep 8 programs unless they name others (the plugin's own default, KernelTuning.page_backup, is 4)
    **{f"{lab} layer_first page backups": (shape, "layer_first", 1, None, {"page_backups": True, "backup_programs": 8})
       for lab, shape in (("fp8-656", "mla61x656-fp8"), ("fp8-576", "mla61x576-fp8"), ("bf16-576", "mla61x576-bf16"))},
    # the same with fewer programs, and split otherwise (the probe kernel: 0.93-0.94 but a GEMM +15-17% in the split
    # launches of 32 MiB and 8 programs, where the row kernel costs it +0.2% on 576-byte rows; H100 2026-12-07)
    **{f"{lab} layer_first page backups {what}": (shape, "layer_first", 1, None,
                                                   {"page_backups": True, "backup_programs": 8, **opts})
       for lab, shape in (("fp8-656", "mla61x656-fp8"), ("fp8-576", "mla61x576-fp8"), ("bf16-576", "mla61x576-bf16"))
       for what, opts in (("4 programs", {"backup_programs": 4}), ("2 programs", {"backup_programs": 2}),
                          ("launches of 8 MiB", {"backup_launch_bytes": 8 << 20}),
                          ("one launch", {"backup_launch_bytes": 0}))},
    # the page backups' like for like on rows the plugin fences (1152 B): no fence, no dependent launches
    "bf16-576 layer_first unfenced no pdl": ("mla61x576-bf16", "layer_first", 1, None,
                                             {"backup_fence": False, "backup_pdl": False, "page_backups": False}),
    "fp8-656 page_first_direct": ("mla61x656-fp8", "page_first_direct", 1, None, {}),
    "fp8-656 page_first_direct runtime page_size": ("mla61x656-fp8", "page_first_direct", 1, "probe.runtime_page",
                                                    {}),
    "fp8-656 page_first_direct programs 16": ("mla61x656-fp8", "page_first_direct", 1, None, {"programs": 16}),
    "fp8-656 page_first_direct stages 3": ("mla61x656-fp8", "page_first_direct", 1, None, {"num_stages": 3}),
    "fp8-656 page_first_kv_split": ("mla61x656-fp8", "page_first_kv_split", 1, None, {}),
    "fp8-656 page_first_kv_split layer-major": ("mla61x656-fp8", "page_first_kv_split", 1, "probe.kv_layer_major", {}),
    "fp8-656 page_first_kv_split 4 warps": ("mla61x656-fp8", "page_first_kv_split", 1, None, {"num_warps": 4}),
    "fp8-656 page_first_kv_split 8 warps": ("mla61x656-fp8", "page_first_kv_split", 1, None, {"num_warps": 8}),
    "fp8-576 page_first_kv_split": ("mla61x576-fp8", "page_first_kv_split", 1, None, {}),
    "fp8-576 page_first_kv_split 8 warps": ("mla61x576-fp8", "page_first_kv_split", 1, None, {"num_warps": 8}),
    # loads of a 64-byte second part (fp8 576 B rows split 512 + 64): 0.43-0.56 in pages of 16 (H100s, 2026-12-07);
    # page loads forced (automatic ones leave pages of < 2 KiB per host part to the row kernel)
    "fp8-576 page_first_kv_split programs 32": ("mla61x576-fp8", "page_first_kv_split", 1, None,
                                                {"programs": 32, "pages": True}),
    "fp8-576 page_first_kv_split programs 64": ("mla61x576-fp8", "page_first_kv_split", 1, None,
                                                {"programs": 64, "pages": True}),
    "fp8-576 page_first_kv_split stages 2": ("mla61x576-fp8", "page_first_kv_split", 1, None,
                                             {"num_stages": 2, "pages": True}),
    "fp8-576 page_first_kv_split stages 3": ("mla61x576-fp8", "page_first_kv_split", 1, None,
                                             {"num_stages": 3, "pages": True}),
    "fp8-656 page_first programs 32": ("mla61x656-fp8", "page_first", 1, None, {"programs": 32}),
    "fp8-656 page_first stages 2": ("mla61x656-fp8", "page_first", 1, None, {"num_stages": 2}),
    "bf16-576 page_first_kv_split 8 warps": ("mla61x576-bf16", "page_first_kv_split", 1, None, {"num_warps": 8}),
    "mha-bf16 page_first_kv_split 8 warps": ("mha80x8x128-bf16", "page_first_kv_split", 1, None, {"num_warps": 8}),
    "fp8-656 page_first_kv_split layer-major 4 warps": ("mla61x656-fp8", "page_first_kv_split", 1,
                                                        "probe.kv_layer_major", {"num_warps": 4}),
    "fp8-656 page_first": ("mla61x656-fp8", "page_first", 1, None, {}),
    "fp8-576 layer_first": ("mla61x576-fp8", "layer_first", 1, None, {}),
    "fp8-576 page_first_direct": ("mla61x576-fp8", "page_first_direct", 1, None, {}),
    "bf16-576 layer_first": ("mla61x576-bf16", "layer_first", 1, None, {}),
    "bf16-576 page_first_direct": ("mla61x576-bf16", "page_first_direct", 1, None, {}),
    "bf16-576 page_first_direct runtime page_size": ("mla61x576-bf16", "page_first_direct", 1, "probe.runtime_page",
                                                     {}),
    "mha-bf16 layer_first": ("mha80x8x128-bf16", "layer_first", 1, None, {}),
    "mha-bf16 page_first_direct": ("mha80x8x128-bf16", "page_first_direct", 1, None, {}),
    "mha-bf16 page_first_kv_split": ("mha80x8x128-bf16", "page_first_kv_split", 1, None, {}),
    "mha-bf16 page_first_kv_split layer-major": ("mha80x8x128-bf16", "page_first_kv_split", 1, "probe.kv_layer_major",
                                                 {}),
    "bf16-576 page_first_kv_split": ("mla61x576-bf16", "page_first_kv_split", 1, None, {}),
    "bf16-576 page_first_kv_split layer-major": ("mla61x576-bf16", "page_first_kv_split", 1, "probe.kv_layer_major",
                                                 {}),
    "fp8-656 layer_first runtime page_size": ("mla61x656-fp8", "layer_first", 1, "probe.runtime_page_lf", {}),
    "fp8-576 layer_first runtime page_size": ("mla61x576-fp8", "layer_first", 1, "probe.runtime_page_lf", {}),
    "fp8-576 page_first_direct runtime page_size": ("mla61x576-fp8", "page_first_direct", 1, "probe.runtime_page", {}),
}
# page loads forced (pages=True, whatever their pages' size) against the row kernel (pages=False), for every layout
# with page loads (automatic page loads take pages of >= rowcopy_pages.AUTO_MIN_PART_BYTES per host part)
# ("... grouped": small pages several per work item, rowcopy_pages.group_pages with GROUP_BYTES at 8192; "... one page
# per item": GROUP_BYTES at 0; the probe's own option page_group_bytes sets the constant while the pool is built)
for _label, _shape in (("fp8-576", "mla61x576-fp8"), ("fp8-656", "mla61x656-fp8"), ("bf16-576", "mla61x576-bf16")):
    for _layout in ("page_first_kv_split", "layer_first", "page_first_direct"):
        VARIANTS[f"{_label} {_layout} page loads"] = (_shape, _layout, 1, None, {"pages": True})
        VARIANTS[f"{_label} {_layout} page loads grouped"] = (_shape, _layout, 1, None,
                                                               {"pages": True, "page_group_bytes": 8192})
        VARIANTS[f"{_label} {_layout} page loads one page per item"] = (_shape, _layout, 1, None,
                                                                        {"pages": True, "page_group_bytes": 0})
        VARIANTS[f"{_label} {_layout} row loads"] = (_shape, _layout, 1, None, {"pages": False})
# backups fenced per tile (the plugins' default, kernel_lib.tile_done) against unfenced ones, every layout and shape
for _label, _shape in (("fp8-576", "mla61x576-fp8"), ("fp8-656", "mla61x656-fp8"), ("bf16-576", "mla61x576-bf16"),
                       ("mha-bf16", "mha80x8x128-bf16")):
    for _layout in ("layer_first", "page_first", "page_first_direct", "page_first_kv_split"):
        VARIANTS.setdefault(f"{_label} {_layout}", (_shape, _layout, 1, None, {}))
        VARIANTS[f"{_label} {_layout} unfenced"] = (_shape, _layout, 1, None, {"backup_fence": False})
        # fenced with tiles of twice the bytes (narrower rows lose speed fenced at 32 KiB: a tile too small to wait on)
        VARIANTS[f"{_label} {_layout} fenced 64K"] = (_shape, _layout, 1, None,
                                                      {"backup_fence": True, "tile_bytes": 65536})
        # all-layer backups in one launch (the tuning's launch_bytes off), and in launches of 8 MiB (the default: 32)
        VARIANTS[f"{_label} {_layout} one launch"] = (_shape, _layout, 1, None, {"backup_launch_bytes": 0})
        for _mib in (8, 16, 48, 64, 128):
            VARIANTS[f"{_label} {_layout} launches of {_mib} MiB"] = (_shape, _layout, 1, None,
                                                                      {"backup_launch_bytes": _mib << 20})
        # split backups whose launches after the first are programmatic dependent launches (sm_90+): each may begin
        # while the one before drains its last tiles (the split's cost: the link idle between launches?)
        VARIANTS[f"{_label} {_layout} pdl"] = (_shape, _layout, 1, None, {"backup_pdl": True})
        VARIANTS[f"{_label} {_layout} no pdl"] = (_shape, _layout, 1, None, {"backup_pdl": False})
        VARIANTS[f"{_label} {_layout} launches of 8 MiB pdl"] = (_shape, _layout, 1, None,
                                                                 {"backup_launch_bytes": 8 << 20, "backup_pdl": True})
        # split backups with twice the programs (a split costs a GEMM little: room for more in flight)
        VARIANTS[f"{_label} {_layout} 16 programs"] = (_shape, _layout, 1, None, {"backup_programs": 16})
        VARIANTS[f"{_label} {_layout} 4 programs"] = (_shape, _layout, 1, None, {"backup_programs": 4})
        # backups by rows where the plugin would back whole pages up (page_backups off: the default before them)
        VARIANTS[f"{_label} {_layout} row backups"] = (_shape, _layout, 1, None, {"page_backups": False})
        if _layout in ("layer_first", "page_first_direct"):  # the plugins' own page backups (kernel_lib.page_backup)
            VARIANTS[f"{_label} {_layout} plugin page backups"] = (_shape, _layout, 1, None, {"page_backups": True})
            # in one launch (4 programs: does the split, for a GEMM's sake, still pay? It costs the host a launch per
            # 32 MiB)
            VARIANTS[f"{_label} {_layout} plugin page backups one launch"] = (
                _shape, _layout, 1, None, {"page_backups": True, "backup_launch_bytes": 0})
        # two programs of 32 warps, 128 KiB tiles, fenced: holding an SM costs a GEMM by itself (the hint probe's
        # "hold N programs" floors: +5-7% for 1-2 programs, +11-12% for 4-8, H100 2026-12-07), so fewer and wider
        # programs; 128 bytes of a tile per thread, so that no row width spills
        VARIANTS[f"{_label} {_layout} 2 programs 32 warps 128K"] = (
            _shape, _layout, 1, None, {"backup_fence": True, "backup_programs": 2, "num_warps": 32,
                                       "tile_bytes": 131072})


def _build(label: str, tokens: int, page_size: int, reg: Any) -> tuple[HostKVPool, dict, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
    shape, layout, spread, override, options = VARIANTS[label]
    spec, dev, h, s, d = _workload(shape, tokens, page_size)
    if spread > 1:  # host page i -> page i * spread, in a pool of spread times the slots
        spec = dataclasses.replace(spec, capacity=spec.capacity * spread)
        h = (h // page_size) * (spread * page_size) + h % page_size
    options = dict(options)
    group_bytes = options.pop("page_group_bytes", rowcopy_pages.GROUP_BYTES)
    kept, rowcopy_pages.GROUP_BYTES = rowcopy_pages.GROUP_BYTES, group_bytes  # read when the pool is built
    try:
        pool = HostKVPool(spec, layout, "kernel" if override is None else BACKEND, dev, strategy=override,
                          strategy_options=options, registry=reg, pin_memory=True, validate="shapes")
    finally:
        rowcopy_pages.GROUP_BYTES = kept
    return pool, dev, h, s, d


def _ms_beside_gemm(transfer: Callable[[], object], reps: int = 5, size: int = 8192) -> float:
    """Median event-timed milliseconds of one ``transfer`` on its own stream while bf16 ``size``^3 GEMMs run back to
    back on another, queued first (every SM busy with the GEMM when the transfer's launches come): the transfer's own
    speed beside the model, where the GEMM slowdown is the model's beside the transfer.  The GEMMs queued cover four
    times the transfer's time alone; a transfer slowed more than that finishes partly alone (the figure flatters it)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    work, side, transfer_ms = _two_streams(transfer)
    with torch.cuda.stream(work):
        gemm_ms = _median_ms(lambda: a @ b, 3, warmup=1)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        _queue(work, lambda: a @ b, int(4 * transfer_ms / max(gemm_ms, 1e-3)) + 4)
        e0, e1 = _queue(side, transfer, 1, timed=True)
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    torch.cuda.synchronize()
    return statistics.median(times)


def _measure(label: str, args: argparse.Namespace, reg: Any, memcpy: _Memcpy) -> dict[str, Any]:
    """One variant's row, after its bit-exact check (an ``AssertionError`` when it fails)."""
    pool, dev, h, s, d = _build(label, args.tokens, args.page_size, reg)
    _check(pool, dev, h, s, d, ops=("backup_layer",))
    layers = pool.spec.layer_map.num_device_layers
    total = pool.spec.bytes_per_token * args.tokens
    one = total // layers
    layer_ms = _median_ms(lambda: pool.backup_layer(1, h, s), args.reps)
    backup = lambda: pool.backup_all_layers(h, s)  # noqa: E731
    all_ms = _median_ms(backup, args.reps)
    row: dict[str, Any] = {
        "variant": label, "strategy": pool.strategy_name, "tokens": args.tokens, "page_size": args.page_size,
        "backup_layer": one / layer_ms / 1e6 / memcpy.gbps(one, True, args.reps),
        "backup_all_layers": total / all_ms / 1e6 / memcpy.gbps(total, True, args.reps),
        # host time of one all-layer backup issued on an idle GPU (median): what its launches cost the caller's thread
        "host_all_layers_us": _host_us(backup, max(5, args.reps // 2)),
    }
    if args.gemm:
        row["gemm_all_layers"] = _gemm_slowdown(backup)
        # and the backup's own ratio while the GEMMs run (a kernel that leaves the GEMM its SMs waits for them)
        row["backup_all_layers_beside_gemm"] = total / _ms_beside_gemm(backup) / 1e6 / memcpy.gbps(total, True,
                                                                                                   args.reps)
    if args.bursts:  # one backup_layer per owned layer back to back, as a layer-by-layer write-back issues them
        owned = pool.spec.layer_map.device_layers
        burst_b = lambda: [pool.backup_layer(lay, h, s) for lay in owned]  # noqa: E731
        row["backup_burst"] = total / _median_ms(burst_b, args.reps) / 1e6 / memcpy.gbps(total, True, args.reps)
        if args.gemm:
            row["gemm_backup_burst"] = _gemm_slowdown(burst_b)
    if args.loads:  # the middle layer alone, then every layer in turn (a burst), as hicache bench times them
        owned = pool.spec.layer_map.device_layers
        mid = owned[len(owned) // 2]
        row["load_layer"] = one / _median_ms(lambda: pool.load_layer(mid, h, d), args.reps) / 1e6 / memcpy.gbps(
            one, False, args.reps)
        burst = lambda: [pool.load_layer(lay, h, d) for lay in owned]  # noqa: E731
        row["load_burst"] = total / _median_ms(burst, args.reps) / 1e6 / memcpy.gbps(total, False, args.reps)
        if args.gemm:
            row["gemm_load_burst"] = _gemm_slowdown(burst)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="backup_place.json")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemm", action="store_true", help="GEMM slowdown beside all-layer backups (and load bursts)")
    ap.add_argument("--loads", action="store_true", help="time one-layer loads and load bursts too")
    ap.add_argument("--bursts", action="store_true",
                    help="time backup bursts too (one backup_layer per layer, back to back; with --gemm, beside it)")
    ap.add_argument("--profile", default=None, metavar="LABEL", help="only three all-layer backups of one variant")
    args = ap.parse_args()
    labels = [v for v in args.variants.split(",") if v]
    unknown = [v for v in labels + ([args.profile] if args.profile is not None else []) if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(map(repr, unknown))}; the variants: {', '.join(VARIANTS)}")
    require_cuda(__file__)
    reg = create_registry(plugins=[("probe", _Plugin())])
    if args.profile is not None:
        pool, dev, h, s, d = _build(args.profile, args.tokens, args.page_size, reg)
        for _ in range(3):
            pool.backup_all_layers(h, s)
        torch.cuda.synchronize()
        return 0
    memcpy, rows, corrupt, failed = _Memcpy(), [], 0, 0
    for label in labels:
        try:
            row = _measure(label, args, reg, memcpy)
        except AssertionError as exc:
            corrupt += 1
            print(json.dumps({"variant": label, "CORRUPT": str(exc)}), flush=True)
            continue
        except Exception as exc:  # e.g. a probe kernel this Triton cannot compile: the other variants still run
            failed += 1
            print(json.dumps({"variant": label, "ERROR": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
            continue
        finally:
            torch.cuda.empty_cache()  # the variant's pool is gone: its pinned and device memory go back
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        with open(args.out, "w") as f:  # rewritten after every row: a killed run keeps its results
            json.dump(rows, f, indent=1)
    return 1 if corrupt or failed else 0


if __name__ == "__main__":
    sys.exit(main())

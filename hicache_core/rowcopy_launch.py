"""Launches of the row-copy kernel strategies: the launch values a kernel may declare (:data:`LAUNCH_VALUES`), the
fixed launches a pool prepares (``_Launch``, the :class:`Prepared` record), how a call's groups are routed to row, page
or TMA launches (``_route``), and the helpers that bind, fill and record them.

Part of the row-copy toolkit whose public face is :mod:`hicache_core.rowcopy` (every name here is importable from
there too); :class:`hicache_core.rowcopy.RowKernelStrategy` prepares and launches what this names.  Nothing here
imports Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .errors import ConfigError
from .kernel_support import dependent_launches, interpreting
from .replay import Replays, Step, step as replay_step
from .rowcopy_groups import RowGroup
from .rowcopy_tma import TmaLaunch
from .rowcopy_tuning import KernelTuning, Tuning
from .spec import PoolSpec

__all__ = ["LAUNCH_VALUES", "DYNAMIC_VALUES", "Prepared", "PDL_OFF", "PDL_LAST", "PDL_CHAIN"]

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
    "PAGE_SIZE": "constexpr: tokens per page (a row's page split by a constant: shifts, not a 64-bit division per row)",
    "capacity": "host slots: host indices outside 0..capacity-1 move nothing",
    "dev_rows": "device rows of the shortest layer: device indices outside move nothing",
    "WIDTH": "constexpr: row words (both parts; page loads: the words of the host part loaded)",
    "SPLIT": "constexpr: words of the first part (== WIDTH when the group has one part)",
    "BLOCK": "constexpr: column step (words, power of two) of the first part",
    "BLOCK_B": "constexpr: column step of the second part",
    "TOKENS": "constexpr: index positions per tile (power of two)",
    "VEC": "constexpr: every row base is a multiple of VEC words",
    "TO_HOST": "constexpr: True backup (device to host), False load",
    "FENCE": "constexpr: after each work item every thread waits until the GPU has taken its writes (kernel_lib."
             "tile_done; the direction's Tuning.fence for rows of >= its fence_min_row_bytes, on CUDA outside Triton's "
             "interpreter only)",
    "PDL": "constexpr int: how a launch of a split call takes part in programmatic dependent launches (the direction's "
           "Tuning.pdl, on CUDA devices of compute capability >= 9.0 only): 2 for every launch of the call but its last "
           "(each program signals the next launch at its last work item: kernel_lib.let_next_begin), 1 for its last, "
           "and 1 or 2 waits for the launch before at each program's end (kernel_lib.await_previous); 0: a call in one "
           "launch, or PDL off (PDL_OFF, PDL_LAST, PDL_CHAIN)",
    "STAGES": "constexpr: software-pipelining depth of the work-item loop (tl.range num_stages; 1: none)",
    "ENTRIES_INNER": "constexpr: the strategy's entries_inner (work-item order, see kernel_lib.work_item)",
    "PAGE_TOKENS": "constexpr: page loads and page backups: a power of two >= page_size (one vector checks a page's "
                   "indices)",
    "PAGES": "constexpr: backups of whole pages as flat words (kernel_lib.page_backup; rowcopy_pages.backup_reason), "
             "False for every other launch",
    "PAGE_CHUNK": "constexpr: page backups: words one step of a flat page copies (a power of two)",
    "PART": "constexpr: words per part of a page (page loads, see rowcopy_pages.pieces; GROUP > 1: a power of two "
            "covering the page, masked to it)",
    "PARTS": "constexpr: whole parts per page",
    "R1": "constexpr: words of the page's first piece after its parts (0: none)",
    "R2": "constexpr: second piece (0: none)",
    "R3": "constexpr: third piece (0: none)",
    "R4": "constexpr: masked tail piece covering the rest of the page (0: none)",
    "STRIDED": "constexpr: page loads: device rows are wider than the part loaded (dev_stride != WIDTH)",
    "GROUP": "constexpr: page loads: pages per work item (1, or a power of two for small pages: see "
             "rowcopy_pages.group_pages; PART then covers a page, PARTS is 1, R1..R4 are 0)",
}
#: ``PDL`` launch values: a plain call (one launch, or PDL off); the last launch of a split call; the others.
PDL_OFF, PDL_LAST, PDL_CHAIN = 0, 1, 2
#: The launch values that change from call to call (the rest is fixed per pool, group and direction).
DYNAMIC_VALUES = ("host_idx", "dev_idx", "n", "ents", "n_ents")


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
    row_bytes: int = 0  # bytes one index position moves per entry (the tuning's launch_bytes is counted in them)
    #: where PDL is on (the kernel declares it): the static key of each PDL value (PDL_OFF, PDL_LAST, PDL_CHAIN; ``args``
    #: holds PDL_OFF) and PDL's position in ``args``; a split call's launches after its first are dependent ones
    pdl_keys: tuple[int, ...] = ()
    pdl_at: int = -1
    packs: dict = field(init=False, default_factory=dict, compare=False, repr=False)  # the launcher's packed parameters

    @property
    def pdl(self) -> bool:
        """Whether a split call's launches after its first are programmatic dependent launches."""
        return bool(self.pdl_keys)

    def split_launch(self, args: list, i: int, last: int, kw: dict) -> dict:
        """Launch ``i`` of a call's ``0..last``: with PDL on and the call split, ``args``' PDL set (PDL_CHAIN, or PDL_LAST
        for the last) and the keyword arguments of that launch (its static key, and ``pdl`` after the first); else
        ``kw`` as it is."""
        if not self.pdl_keys or not last:
            return kw
        mode = PDL_LAST if i == last else PDL_CHAIN
        args[self.pdl_at] = mode
        return {**kw, "static_key": self.pdl_keys[mode], "pdl": i > 0}


@dataclass(frozen=True)
class Prepared:
    """What :meth:`hicache_core.rowcopy.RowKernelStrategy.prepare` leaves in ``binding.scratch[strategy.name]``."""

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
    #: entries tensor's address -> ``[2, k rounded up to even]`` int64: row 0 its entries, row 1 its entries from the
    #: second (16-byte aligned rows, so a run from an even entry is a view of row 0 and one from an odd entry of row 1,
    #: each starting 16-byte aligned), made with the pool where a direction's tuning splits calls (entry runs are views
    #: of it)
    tails: dict = field(default_factory=dict, compare=False, repr=False)
    slices: dict = field(default_factory=dict, compare=False, repr=False)  # (entries' address, per launch) -> runs


def entry_tails(groups: tuple[RowGroup, ...], device: torch.device) -> dict[int, torch.Tensor]:
    """:attr:`Prepared.tails` of ``groups``: for every entries tensor (all layers, each layer) a table of two rows, its
    entries and its entries from the second, so that a run of entries from any ``i`` is a view (:func:`entry_run`) that
    starts 16-byte aligned, as the whole tensor does (a slice would give the kernel another pointer specialisation),
    and is whole before any launch reads it (made once, with the pool, on the host then copied: no stream's pending
    copy to wait for)."""
    out: dict[int, torch.Tensor] = {}
    for g in groups:
        for layer in (None, *g.per_layer):
            ents = g.entries(layer)
            if ents is None:
                continue
            vals = ents.tolist()
            k = len(vals)
            table = torch.zeros((2, k + k % 2), dtype=torch.int64)
            table[0, :k] = torch.tensor(vals, dtype=torch.int64)
            table[1, :k - 1] = torch.tensor(vals[1:], dtype=torch.int64)
            out[ents.data_ptr()] = table.to(device)
    return out


def entry_run(table: torch.Tensor, i: int, length: int) -> torch.Tensor:
    """Entries ``i .. i+length-1`` of an :func:`entry_tails` table: a view starting 16-byte aligned (an even ``i`` in its
    first row, an odd one in its second, one entry on)."""
    return table[0, i:i + length] if i % 2 == 0 else table[1, i - 1:i - 1 + length]


def _split_plan(lv: _Launch, k: int, n: int, by_positions: bool, page_size: int) -> tuple[int, int]:
    """``(entries, positions)`` per launch of a call moving ``n`` positions of ``k`` entries through ``lv``: ``(k, n)``,
    one launch, when its tuning sets no ``launch_bytes`` or the call fits.  Else launches of at most ``launch_bytes``
    where the call can be cut that fine: with ``by_positions`` (kernels whose work items walk a tile's entries
    together: token-major host pages) every entry of a run of positions, a multiple of 16, of the launch's tokens per
    work item and of ``page_size`` long, at least one such multiple (a run's index tensors start as aligned as the
    call's, and it holds whole pages: its host writes sweep whole pages of every layer, as one launch's would);
    otherwise some entries at every position, at least one entry (whose rows may be more than ``launch_bytes``)."""
    cap = lv.tuning.launch_bytes
    if not cap or not lv.row_bytes or n * k * lv.row_bytes <= cap:
        return k, n
    if by_positions:
        align = math.lcm(16, lv.tokens, page_size)
        return k, max(align, cap // (k * lv.row_bytes) // align * align)
    return max(1, cap // (n * lv.row_bytes)), n


def _splits(prep: Prepared, ents: torch.Tensor, lv: _Launch, h: torch.Tensor, d: torch.Tensor, n: int,
            by_positions: bool, page_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """``(entries, host indices, device indices)`` of each launch ``lv`` makes of a call moving the ``n`` positions
    ``h``/``d`` of ``ents``, as :func:`_split_plan` plans them: views of ``h`` and ``d`` for runs of positions; for runs
    of entries, views of :attr:`Prepared.tails` (kept per entries tensor and run length)."""
    k = ents.numel()
    per, step = _split_plan(lv, k, n, by_positions, page_size)
    if step < n:
        return tuple((ents, hs, ds) for hs, ds in zip(h.split(step), d.split(step)))
    if per >= k:
        return ((ents, h, d),)
    key = (ents.data_ptr(), per)
    runs = prep.slices.get(key)
    if runs is None:
        tails = prep.tails[ents.data_ptr()]
        runs = prep.slices[key] = tuple(entry_run(tails, i, min(per, k - i)) for i in range(0, k, per))
    return tuple((e, h, d) for e in runs)


def split_shape(prep: Prepared, by_positions: bool, page_size: int, n: int, layer: int | None,
                to_host: bool) -> tuple:
    """How a call of ``n`` positions of ``layer`` in this direction splits, group by group and launch by launch
    (:func:`_split_plan`): ``None`` in one launch, the entries per launch of runs of entries, ``("positions", n)`` for
    runs of positions (the count itself: it fixes every run's start and length, which the recorded steps hold);
    ``None`` for a group TMA or nothing moves.  The key replays record steps under beyond the count's traits
    (:class:`~hicache_core.replay.Replays`' ``shape``), so steps recorded for a call that fit one launch are never
    replayed for one that splits, nor entry runs of one length for a count that takes another, nor runs of positions
    for another count; calls in one launch share their key whatever their count, as before any split."""
    out: list = []
    for gi in range(len(prep.groups)):
        route = _route(prep, gi, n, layer, to_host)
        if route is None or route[0] is not None:
            out.append(None)
            continue
        k = cast(torch.Tensor, route[2]).numel()
        plans = [_split_plan(lv, k, n, by_positions, page_size) for lv, _, _, _ in route[1]]
        out.append(tuple(("positions", n) if step < n else per if per < k else None for per, step in plans))
    return tuple(out)


def exact_shape(shape: Any) -> bool:
    """Whether a :func:`split_shape` names one exact count (a group split by runs of positions): replays keep a
    bounded number of those (:attr:`~hicache_core.replay.Replays.exact`); ``None`` (a direction that never splits)
    names none."""
    return shape is not None and any(isinstance(plan, tuple) and any(isinstance(p, tuple) for p in plan)
                                     for plan in shape)


def _grid(programs: int, n: int, tokens: int, per_tile: int) -> int:
    """The programs a launch runs: its budget, capped by its work items (tiles of ``tokens`` positions of ``n``,
    ``per_tile`` items each), at least one."""
    return max(1, min(programs, -(-n // tokens) * per_tile))


_Run = tuple["_Launch", Any, tuple[int, ...], int]  # launch, launcher, dynamic positions, work items per tile


def _route(prep: Prepared, gi: int, n: int, layer: int | None,
           to_host: bool) -> tuple[tuple[TmaLaunch, ...] | None, tuple[_Run, ...], torch.Tensor | None] | None:
    """How group ``gi`` moves a call of ``n`` positions of ``layer`` (``None``: every layer): ``(tma, (), None)``
    with the group's TMA launches of the layer, ``(None, runs, entries)`` with its row or page launches and the
    entries they cover, or ``None`` where the group holds no row of the layer.
    :meth:`hicache_core.rowcopy.RowKernelStrategy.transfer` launches what this names."""
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
    # work items: parts of each page (or groups of small pages) of each entry, one launch per host part of the rows
    return None, tuple((lv, prep.page_launcher, prep.page_dynamic, n_ents * n_parts) for lv, n_parts in pages), ents


def _fixed_values(spec: PoolSpec, g: RowGroup, tables: dict[str, torch.Tensor], t: Tuning) -> dict[str, Any]:
    """The launch values every launch of ``g`` shares (per-call ones ``None``), with entry ``tables``."""
    return dict(anchor=g.anchor, host_idx=None, dev_idx=None, n=None, ents=None, n_ents=None, **tables,
                page_size=spec.page_size, PAGE_SIZE=spec.page_size, capacity=spec.capacity, dev_rows=g.rows,
                VEC=g.vec, STAGES=t.stages, FENCE=fenced(t, g),
                PDL=PDL_CHAIN if dependent(t, g) else PDL_OFF)  # PDL_CHAIN: _bound keys and sets each value


def fenced(t: Tuning, g: RowGroup) -> bool:
    """Whether launches of ``g`` under ``t`` fence each tile (``FENCE``): the tuning fences, the group's rows hold at
    least its ``fence_min_row_bytes``, and the group is on CUDA outside Triton's interpreter (no inline PTX there)."""
    return (t.fence and g.width * g.anchor.element_size() >= t.fence_min_row_bytes and g.anchor.is_cuda
            and not interpreting())


def dependent(t: Tuning, g: RowGroup) -> bool:
    """Whether a call's launches of ``g`` under ``t`` after its first are programmatic dependent launches (``PDL``):
    the tuning asks for them (``pdl``) and the group is on a CUDA device of compute capability 9.0 or later outside
    Triton's interpreter (``griddepcontrol`` is sm_90 PTX)."""
    return t.pdl and dependent_launches(g.anchor.device)


def _bound(launcher: Any, dynamic: tuple[int, ...], t: Tuning, tokens: int, values: dict[str, Any],
           row_bytes: int = 0) -> _Launch:
    """A fixed launch: ``values`` bound by ``launcher``'s parameter names, its static key and per-call slots
    (``row_bytes``: what one index position moves per entry)."""
    args = launcher.bind(values)
    slots = tuple((name, i) for i, name in enumerate(launcher.arg_names) if name in DYNAMIC_VALUES)
    if not (values.get("PDL") and "PDL" in launcher.arg_names):
        return _Launch(tokens, launcher.static_key(args, dynamic), t, args, slots, row_bytes)
    at = launcher.arg_names.index("PDL")  # a call in one launch passes PDL_OFF; split calls the others (split_launch)
    keys = tuple(launcher.static_key(args[:at] + (mode,) + args[at + 1:], dynamic)
                 for mode in (PDL_OFF, PDL_LAST, PDL_CHAIN))
    return _Launch(tokens, keys[PDL_OFF], t, args[:at] + (PDL_OFF,) + args[at + 1:], slots, row_bytes, keys, at)


def _tma_plan(prep: Prepared, gi: int, n: int) -> dict[int, tuple[TmaLaunch, ...]] | None:
    """Group ``gi``'s TMA load launches by layer when TMA takes a per-layer load of ``n`` positions, else ``None``."""
    plan = prep.tma[gi] if prep.tma else None
    limit = prep.tma_rows[gi] if plan is not None else None
    return plan if plan is not None and (limit is None or n <= limit) else None


def _keep(steps: list[Step] | None, used: Any, launcher: Any, args: list, slots: tuple[tuple[str, int], ...],
          programs: int, tokens: int, per_tile: int, kw: dict,
          span: tuple[int, int] | None = None) -> list[Step] | None:
    """``steps`` with this launch's :class:`~hicache_core.replay.Step` appended, or ``None`` when it did not
    go through the driver (``used`` is ``None``) or does not take all three batch values (``span``: the run of the
    batch's positions it moved, ``(start, count)``; ``None``: all)."""
    if steps is None or used is None:
        return None
    pos = dict(slots)
    if not {"host_idx", "dev_idx", "n"} <= pos.keys():
        return None
    steps.append(replay_step(used, launcher, args, (pos["host_idx"], pos["dev_idx"], pos["n"]), programs=programs,
                             tokens=tokens, per_tile=per_tile, fallback=kw, span=span))
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

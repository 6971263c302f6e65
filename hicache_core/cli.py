"""The ``hicache`` command: ``plugins``, ``matrix``, ``explain``, ``verify``, ``doctor`` (and ``bench``).

Results go to stdout, diagnostics through :mod:`logging` (stderr); ``verify``
shows progress on stderr when it is a terminal.  Every command builds a fresh
registry from the environment, so ``HICACHE_PLUGINS``, ``HICACHE_DISABLE_PLUGINS``,
``HICACHE_STRATEGY`` and ``HICACHE_TRACE`` apply (``HICACHE_TRACE=1`` prints
each resolution on stderr).

Exit codes: 0 success; 1 ``verify`` found a failing cell; 2 a usage, registry
or resolution error (unknown names, ``explain`` on a miss, no CUDA for ``bench``, ``verify`` with
nothing left to verify).

Each subcommand is one ``_cmd_<name>(args) -> int`` plus one ``_parser_<name>(sub)``
listed in :data:`SUBCOMMANDS`; adding a subcommand is adding such a pair.

Examples::

    hicache plugins
    hicache matrix --kind mla
    hicache explain --layout page_first --io-backend kernel --sharded --kind mla
    hicache verify --tokens 4096
    hicache doctor
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable, Sequence, TextIO

import torch

from .envflags import OFF
from .errors import RegistryError, ResolutionError, UnknownLayoutError
from .kernel_support import interpreting
from .pool import HostKVPool
from . import __version__
from .registry import ENV_ALLOW, ENV_BLOCK, ENV_STRATEGY, ENV_TRACE, LOAD_FAILED, Registry, create_registry
from .spec import MHA, MLA, LayerMap, PoolSpec
from .strategy import OPERATIONS
from .testing.conformance import CASES, INDEX_VARIANTS, Case, check_load_all, check_strategy, make_device_buffers

__all__ = ["main", "build_parser", "representative_spec", "Cell", "matrix_cells", "VerifyRow", "verify_cells",
           "doctor_lines", "UsageError", "SUBCOMMANDS"]

logger = logging.getLogger(__name__)

KINDS = (MHA, MLA)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.uint8}
INSTALL_LAYOUTS = ("install a layout plugin from the hicache source tree (e.g. pip install ./plugins/layer_first "
                   "./plugins/page_first ./plugins/kv_split)")
NO_LAYOUT = f"no layout is installed: hicache-core alone gives generic backends and no layouts; {INSTALL_LAYOUTS}"


def no_layout(reg: Registry) -> str:
    """Why ``reg`` has no layout, and the fix: the installed ones left out by ``HICACHE_PLUGINS`` /
    ``HICACHE_DISABLE_PLUGINS``, none installed, and (either way) each plugin that failed to load or name that two
    plugins registered (:func:`install_problems`: a layout plugin among them registered nothing)."""
    problems = install_problems(reg)
    if reg.skipped:
        text = (f"no layout is loaded: {ENV_ALLOW}/{ENV_BLOCK} left out the installed plugins "
                f"{sorted(set(reg.skipped))}; unset them, or allow the plugins of the layouts you want")
        return text + "".join(f"; also: {p}" for p in problems)
    if problems:  # a layout plugin may be among them: "none is installed" may not be true
        return f"no layout is loaded: {'; '.join(problems)}; mend that, or where no layout plugin is installed, " + \
            INSTALL_LAYOUTS
    return NO_LAYOUT


#: Exit code when the reader of the output went away (``hicache plugins | head -1``): 128 + SIGPIPE, as a shell
#: reports a process that signal ends; never 1 (a failing ``verify`` cell).
BROKEN_PIPE = 141
#: What a PASS of ``verify`` proved.
PASS_MEANS = (
    "A PASS means: random KV backed up through the strategy is byte-identical to the reference backend's host buffers "
    "(canary-filled slots and the guard bytes around each host buffer untouched), and loading every layer back into "
    "other device slots returns the original rows and leaves the guard bytes around the device rows untouched (small "
    "pools, shuffled int64 and device-resident int32 indices; --all-cases runs the whole kit)."
)
CPU_GBPS = "GB/s on cpu time host-memory copies in Python; they say nothing about GPU transfer speed."
INTERPRET_EXTRA = "pip install 'hicache-core[interpret]'"
#: Layers of every representative pool; the sharded one is rank 1 of 2 (layers 2-3).
LAYERS = 4
#: Default tokens of the timed pool in ``verify`` (CPU copies are Python loops: keep them small).
VERIFY_TOKENS = {"cpu": 1024, "cuda": 8192}
VERIFY_REPS = {"cpu": 2, "cuda": 5}


# -- pools -------------------------------------------------------------------------
def _layer_map(sharded: bool, layers: int = LAYERS) -> LayerMap:
    """The layer map of the CLI's pools: ``layers`` layers, sharded as rank 1 of 2 where ``sharded``."""
    return LayerMap.sharded_cp(layers, 2, 1) if sharded else LayerMap.unsharded(layers)


def representative_spec(
    kind: str, sharded: bool, device: torch.device | str = "cpu", *, dtype: torch.dtype | None = None,
    page_size: int = 16, tokens: int = 64, medium: bool = False,
) -> PoolSpec:
    """The pool a matrix cell is resolved (and verified) on.

    MHA: 4 layers, 2 heads x 8 (``medium``: 8 heads x 128), fp16.  MLA: 4 layers,
    512 + 64, bf16.  Sharded: ``LayerMap.sharded_cp(4, 2, 1)``.  ``tokens`` is
    rounded up to whole pages.
    """
    lmap = _layer_map(sharded)
    capacity = max(1, -(-tokens // page_size)) * page_size
    if kind == MHA:
        heads, dim = (8, 128) if medium else (2, 8)
        return PoolSpec.mha(layer_map=lmap, head_num=heads, head_dim=dim, dtype=dtype or torch.float16,
                            page_size=page_size, capacity=capacity, device=device)
    if kind == MLA:
        return PoolSpec.mla(layer_map=lmap, kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype or torch.bfloat16,
                            page_size=page_size, capacity=capacity, device=device)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


# -- matrix ------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One (layout, io_backend, sharded, kind) cell: the serving strategy or why nothing serves it."""

    layout: str
    io_backend: str
    sharded: bool
    kind: str
    strategy: str | None
    provider: str | None
    candidates: tuple[str, ...]
    reasons: tuple[tuple[str, str], ...]

    @property
    def reason(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.reasons)

    @property
    def load_failed(self) -> bool:
        """Nothing serves the cell because a strategy's factory or ``supports()`` raised: a plugin's bug, which
        ``verify`` fails rather than skips."""
        return self.strategy is None and any(why.startswith(LOAD_FAILED) for _, why in self.reasons)


def _pick(values: Iterable[str], wanted: Sequence[str] | None) -> list[str]:
    return [v for v in values if not wanted or v in wanted]


def matrix_cells(
    reg: Registry, *, kinds: Sequence[str] = KINDS, device: torch.device | str = "cpu",
    layouts: Sequence[str] | None = None, io_backends: Sequence[str] | None = None,
) -> list[Cell]:
    """Resolve every cell on the representative pools, in a fixed order (layout, io_backend, sharded, kind)."""
    out = []
    for layout in _pick(sorted(reg.layouts), layouts):
        for backend in _pick(reg.io_backends, io_backends):
            for sharded in (False, True):
                for kind in kinds:
                    spec = representative_spec(kind, sharded, device)
                    res, rejected = reg.try_resolve(spec, layout, backend)
                    cands = tuple(c.name for c in reg.candidates(layout, backend, sharded))
                    out.append(Cell(layout, backend, sharded, kind, res.info.name if res else None,
                                    res.provider.label if res else None, cands, tuple(rejected) if not res else ()))
    return out


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


class _Notes:
    """Numbered footnotes, one per distinct text, in first-use order."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"[{i}] {t}" for i, t in enumerate(self.texts, 1)]


def _yn(b: bool) -> str:
    return "yes" if b else "no"


def _no_cuda_note(device: torch.device | str) -> str:
    """A note for tables computed for a CUDA device on a machine without one ('' otherwise)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return ("CUDA is not available on this machine, so none of this can run here, and what needs the CUDA runtime "
                "(the copy engine: direct, auto's copy-engine picks) shows as unavailable where a GPU machine serves "
                "it: run this on the GPU machine for its real picture")
    return ""


def _pool_lines(kinds: Sequence[str], device: torch.device | str) -> list[str]:
    no_cuda = "; CUDA is not available on this machine: see the note at the end" if _no_cuda_note(device) else ""
    lines = [f"pools (device {torch.device(device)}{no_cuda}):"]
    for kind in kinds:
        for sharded in (False, True):
            lines.append(f"  {kind}{' sharded' if sharded else ''}: {representative_spec(kind, sharded, device).describe()}")
    return lines


def render_matrix(cells: Sequence[Cell], kinds: Sequence[str], device: torch.device | str) -> str:
    """The fixed-width support table with a footnote per distinct reason."""
    notes = _Notes()
    rows = []
    for c in cells:
        ops = [c.strategy or "-"] * len(OPERATIONS)
        rows.append([c.layout, c.io_backend, _yn(c.sharded), c.kind, *ops, "" if c.strategy else notes.mark(c.reason)])
    lines = _pool_lines(kinds, device) + [""]
    lines += _table(["layout", "io_backend", "sharded", "kind", *OPERATIONS, ""], rows)
    served = sum(1 for c in cells if c.strategy)
    lines += ["", f"{served} of {_n(len(cells), 'cell')} served; '-': nothing serves the cell, because:"] if notes.texts else \
        ["", f"{served} of {_n(len(cells), 'cell')} served"]
    note = _no_cuda_note(device)
    return "\n".join(lines + notes.lines() + ([f"note: {note}"] if note else []))


# -- explain -------------------------------------------------------------------------
def explain_lines(reg: Registry, spec: PoolSpec, layout: str, io_backend: str, override: str | None) -> tuple[list[str], bool]:
    """The resolution trace of one key and whether it resolved.  Raises :class:`UnknownLayoutError`."""
    lay = reg.layout(layout)
    lay_rec = reg.layouts[layout][1]
    res, rejected = reg.try_resolve(spec, layout, io_backend, override=override)
    why = dict(rejected)
    cands = reg.candidates(layout, io_backend, spec.sharded)
    names = [c.name for c in cands]
    env_pick = reg.env.get(ENV_STRATEGY)
    pick, pick_src = (override, "--strategy") if override else (env_pick, ENV_STRATEGY)
    lines = [
        f"key: layout={layout!r} io_backend={io_backend!r} sharded={spec.sharded}",
        f"pool: {spec.describe()} (device {spec.device})",
        f"layout: {layout} from {lay_rec.label}: {lay.description}",
    ]
    layout_why = why.get(f"layout {layout}")
    if layout_why:
        lines.append(f"layout check: rejected: {layout_why}")
    if env_pick and not override and env_pick not in names and env_pick in reg.strategies:
        lines.append(f"{ENV_STRATEGY}={env_pick}: not a candidate for this key, ignored")
    lines.append("candidates, in order:" if cands else f"candidates: none; {why.get('(none)', '')}".rstrip("; "))
    chosen_at = names.index(res.info.name) if res is not None else len(names)
    for i, info in enumerate(cands, 1):
        if layout_why:
            state = "not tried (the layout rejects this pool)"
        elif pick and pick in names and info.name != pick:
            state = f"skipped ({pick_src}={pick})"
        elif override and override not in names:
            state = f"not tried (--strategy names {override!r}, not a candidate)"
        elif res is not None and info.name == res.info.name:
            state = "chosen"
        elif info.name in why:
            state = f"rejected: {why[info.name]}"
        elif i - 1 > chosen_at:
            state = "not tried (an earlier candidate serves)"
        else:
            state = "not tried"
        kind = "generic" if info.generic else "exact"
        lines.append(f"  {i}. {info.name} ({kind}; {reg.strategies[info.name][1].label}): {state}")
    if override and override not in names:
        lines.append(f"--strategy {override}: {why.get(override, 'not a candidate')}")
    if res is not None:
        lines.append(f"chosen: {res.info.name} from {res.provider.label}")
        describe = getattr(res.strategy, "describe", None)  # strategies that decide per call say how
        if callable(describe):
            try:
                lines += describe(spec, lay)
            except Exception as exc:  # a plugin's describe() that needs what this machine lacks: the rest stands
                lines.append(f"{res.info.name}: cannot describe itself for {spec.device} here "
                             f"({type(exc).__name__}: {exc})")
    return lines, res is not None


# -- verify --------------------------------------------------------------------------
@dataclass
class VerifyRow:
    """The verdict of one cell: ``PASS``, ``FAIL`` or ``SKIP``, with throughput when measured."""

    layout: str
    io_backend: str
    sharded: bool
    kind: str
    strategy: str | None
    result: str
    backup_gbps: float | None = None
    load_gbps: float | None = None
    note: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cases(reg: Registry, cell: Cell, device: torch.device, all_cases: bool) -> list[tuple[Case, tuple[str, ...]]]:
    """Small conformance cases for ``cell``, each with the index variants to run."""
    small = Case(f"{cell.kind}-small", lambda dev: representative_spec(cell.kind, cell.sharded, dev))
    out: list[tuple[Case, tuple[str, ...]]] = [(small, ("shuffled-i64", "last-page-i32-dev"))]
    if not all_cases:
        return out
    for case in CASES:
        spec = case.build(device)
        if spec.kind != cell.kind or spec.sharded != cell.sharded:
            continue
        res, _ = reg.try_resolve(spec, cell.layout, cell.io_backend)
        if res is not None and res.info.name == cell.strategy:
            out.append((case, INDEX_VARIANTS))
    return out


def _conformance(reg: Registry, cell: Cell, device: torch.device, all_cases: bool) -> None:
    for case, variants in _cases(reg, cell, device, all_cases):
        for variant in variants:
            check_strategy(reg, case, cell.layout, cell.io_backend, variant=variant, device=device, strategy=cell.strategy)
        check_strategy(reg, case, cell.layout, cell.io_backend, device=device, strategy=cell.strategy,
                       per_layer_backup=True)
        check_load_all(reg, case, cell.layout, cell.io_backend, device=device, strategy=cell.strategy)


def _timed(fn: Callable[[], None], reps: int, device: torch.device) -> float:
    fn()  # warm-up (first-call set-up, kernel compilation)
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def _throughput(reg: Registry, cell: Cell, device: torch.device, tokens: int, reps: int) -> tuple[float, float]:
    """GB/s of ``backup_all_layers`` and ``load_all_layers`` of every slot of a medium pool."""
    spec = representative_spec(cell.kind, cell.sharded, device, tokens=tokens, medium=True)
    gen = torch.Generator().manual_seed(0)
    dev = make_device_buffers(spec, Case("timed", lambda d: spec), gen)
    pool = HostKVPool(spec, cell.layout, cell.io_backend, dev, registry=reg, strategy=cell.strategy,
                      pin_memory=device.type == "cuda", validate="shapes")
    host = torch.arange(spec.capacity, dtype=torch.int64)
    pages = torch.randperm(2 * spec.num_pages, generator=gen)[: spec.num_pages]
    rows = ((pages.unsqueeze(1) * spec.page_size + torch.arange(spec.page_size)).reshape(-1) + spec.page_size).to(device)
    nbytes = spec.capacity * spec.bytes_per_token
    t_backup = _timed(lambda: pool.backup_all_layers(host, rows), reps, device)
    t_load = _timed(lambda: pool.load_all_layers(host, rows), reps, device)
    return nbytes / t_backup / 1e9, nbytes / t_load / 1e9


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def verify_cell(reg: Registry, cell: Cell, device: torch.device, *, tokens: int, reps: int, timing: bool,
                all_cases: bool) -> VerifyRow:
    """Round-trip random KV through ``cell``'s strategy, then time a medium pool."""
    row = VerifyRow(cell.layout, cell.io_backend, cell.sharded, cell.kind, cell.strategy, "SKIP")
    if cell.strategy is None:
        row.note = cell.reason
        if cell.load_failed:  # a broken strategy fails, it is not skipped
            row.result = "FAIL"
        return row
    try:
        _conformance(reg, cell, device, all_cases)
    except Exception as exc:  # any failure of the strategy is a FAIL of its cell, not of the run
        logger.debug("verify %s failed", cell, exc_info=True)
        row.result, row.note = "FAIL", _first_line(exc)
        return row
    row.result = "PASS"
    if not timing:
        return row
    if device.type == "cpu" and interpreting() and cell.io_backend == "kernel":
        row.note = "not timed: Triton interpreter (TRITON_INTERPRET=1)"
        return row
    try:
        row.backup_gbps, row.load_gbps = _throughput(reg, cell, device, tokens, reps)
    except Exception as exc:
        row.result, row.note = "FAIL", f"timed pool: {_first_line(exc)}"
    return row


def verified_cells(reg: Registry, cells: Sequence[Cell]) -> list[Cell]:
    """The cells ``verify`` reports: those with a candidate strategy, and those whose layout and io_backend have one for
    the other kind of pool (sharded or not: a SKIP that names it)."""
    return [c for c in cells if c.candidates or reg.candidates(c.layout, c.io_backend, not c.sharded)]


def verify_cells(reg: Registry, cells: Sequence[Cell], device: torch.device, *, tokens: int, reps: int,
                 timing: bool = True, all_cases: bool = False,
                 progress: Callable[[int, int, Cell], None] | None = None) -> list[VerifyRow]:
    """Verify every cell that has a candidate strategy; a cell with none is left out, but for one whose layout and
    io_backend have a strategy for the other kind of pool (sharded or not): it is a SKIP that names it.

    ``progress(done, total, cell)`` is called before each cell is verified.
    """
    todo = verified_cells(reg, cells)
    out = []
    for i, cell in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), cell)
        row = verify_cell(reg, cell, device, tokens=tokens, reps=reps, timing=timing, all_cases=all_cases)
        logger.info("verify %s: %s %s", _cell_name(cell), row.result, row.note)
        out.append(row)
    return out


def _cell_name(cell: Cell) -> str:
    return f"{cell.layout}/{cell.io_backend}/{'sharded' if cell.sharded else 'unsharded'}/{cell.kind}"


class _Progress:
    """``[ 3/68] layout/io_backend/sharded/kind`` rewritten in place on a terminal's stderr."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.width = 0

    def __call__(self, done: int, total: int, cell: Cell) -> None:
        text = f"[{done + 1:>{len(str(total))}}/{total}] verifying {_cell_name(cell)}"
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def clear(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def install_problems(reg: Registry) -> list[str]:
    """What no cell of verify can show: each plugin that failed to load (it registered nothing) and each layout,
    strategy name or key registered twice (disabled). Either fails ``verify`` and ``plugins`` (exit 1)."""
    lines = [f"plugin {p.name} ({p.label}) is BROKEN and registered nothing: {p.error}" for p in reg.plugins if p.error]
    return lines + [f"DISABLED: {c.message}" for c in reg.conflicts]


def render_verify(rows: Sequence[VerifyRow], device: torch.device, timed: Sequence[PoolSpec],
                  problems: Sequence[str] = ()) -> str:
    """The verify table with notes for skips and failures, the installation's problems, then what PASS means, then
    the summary line."""
    notes = _Notes()
    table = [[r.layout, r.io_backend, _yn(r.sharded), r.kind, r.strategy or "-", r.result,
              _gbps(r.backup_gbps), _gbps(r.load_gbps), notes.mark(r.note) if r.note else ""] for r in rows]
    counts = {k: sum(1 for r in rows if r.result == k) for k in ("PASS", "FAIL", "SKIP")}
    lines = [f"timed pool: {t.describe()}, {t.capacity} tokens (sharded cells: owned layers)" for t in timed] or \
        ["timing: off"]
    lines.append("")
    lines += _table(["layout", "io_backend", "sharded", "kind", "strategy", "result", "backup GB/s", "load GB/s", ""],
                    table)
    if notes.texts:
        lines += ["", "notes:"] + notes.lines()
    if counts["FAIL"]:
        lines.append("(-vv shows each failure's traceback)")
    if problems:
        lines += ["", "installation problems (their layouts and strategies are not verified; `hicache plugins` lists "
                  "what loaded):"] + [f"  {p}" for p in problems]
    lines += ["", PASS_MEANS]
    if timed and device.type == "cpu":
        lines.append(CPU_GBPS)
    lines.append(f"verify on {device}: {_n(len(rows), 'cell')}, {counts['PASS']} passed, {counts['FAIL']} failed, "
                 f"{counts['SKIP']} skipped" + (f"; {_n(len(problems), 'installation problem')}" if problems else ""))
    return "\n".join(lines)


# -- commands ------------------------------------------------------------------------
def _registry() -> Registry:
    return create_registry()


def _n(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _sharded_text(sharded: tuple[bool, ...]) -> str:
    return "both" if set(sharded) == {False, True} else _yn(sharded[0]) if sharded else "none"


def _conflict_text(reg: Registry, kind: str, name: str) -> str:
    conflict = next((c for c in reg.conflicts if c.kind == kind and c.name == name), None)
    return conflict.message if conflict is not None else f"{kind} {name!r} is not registered"


def _cmd_plugins(args: argparse.Namespace) -> int:
    reg = _registry()
    if args.json:
        data = [{**asdict(p), "layouts": sorted(p.layouts), "strategies": [
            {"name": n, "io_backend": reg.strategies[n][0].io_backend, "layouts": list(reg.strategies[n][0].layouts),
             "sharded": list(reg.strategies[n][0].sharded)} if n in reg.strategies else {"name": n, "disabled": True}
            for n in sorted(p.strategies)]} for p in reg.plugins]
        print(json.dumps({"plugins": data, "layouts": sorted(reg.layouts)}, indent=1))
        return _plugins_rc(reg)
    lines = []
    for p in reg.plugins:
        lines.append(f"{p.name} ({p.label})" + (f": BROKEN, {p.error}" if p.error else ""))
        # a name two plugins registered is listed, DISABLED, under each of them
        clashes = {kind: {c.name for c in reg.conflicts if c.kind == kind and any(q is p for q in c.plugins)}
                   for kind in ("layout", "strategy")}
        for name in sorted(set(p.layouts) | clashes["layout"]):
            if name not in reg.layouts:  # registered by another plugin too: disabled for both
                lines.append(f"  layout {name}: DISABLED, {_conflict_text(reg, 'layout', name)}")
                continue
            lines.append(f"  layout {name}: {reg.layouts[name][0].description}")
        for name in sorted(set(p.strategies) | clashes["strategy"]):
            if name not in reg.strategies:
                lines.append(f"  strategy {name}: DISABLED, {_conflict_text(reg, 'strategy', name)}")
                continue
            info = reg.strategies[name][0]
            desc = f": {info.description}" if info.description else ""
            lines.append(f"  strategy {name} [io_backend={info.io_backend} layouts={','.join(info.layouts)} "
                         f"sharded={_sharded_text(info.sharded)}]{desc}")
        # an exact key two plugins registered: their strategies stay listed (they serve their other keys), the key not
        lines += [f"  key {c.name}: DISABLED, {c.message}" for c in reg.conflicts
                  if c.kind == "key" and any(q is p for q in c.plugins)]
    if not reg.plugins:
        lines.append("no hicache plugin is loaded")
    broken = sum(1 for p in reg.plugins if p.error)
    lines.append("")
    lines.append(f"{_n(len(reg.plugins), 'plugin')} ({broken} broken), {_n(len(reg.layouts), 'layout')}, "
                 f"{_n(len(reg.strategies), 'strategy', 'strategies')}; "
                 f"io_backends: {', '.join(reg.io_backends) or '(none)'}")
    if not reg.layouts:
        lines.append(no_layout(reg))
    print("\n".join(lines))
    return _plugins_rc(reg)


def _plugins_rc(reg: Registry) -> int:
    """``hicache plugins`` exits 1 on :func:`install_problems`: a script that checks an installation fails on what
    makes ``verify`` fail, not just on a crash."""
    return 1 if install_problems(reg) else 0


def _kinds(args: argparse.Namespace) -> list[str]:
    return [k for k in KINDS if not args.kind or k in args.kind]


class UsageError(Exception):
    """A name or value the user passed that cannot be used; printed as ``hicache <cmd>: <message>``, exit 2."""


def _check_names(reg: Registry, what: str, given: Sequence[str] | None, known: Iterable[str]) -> None:
    """Raise :class:`UsageError` for the first name of ``given`` that is not in ``known``, with near matches."""
    known = list(known)
    clashes = {c.name: c for c in reg.conflicts if c.kind == "layout"} if what == "layout" else {}
    for name in given or ():
        if name in clashes:  # installed twice: disabled, not unknown
            raise UsageError(clashes[name].message)
        if name not in known:
            raise UsageError(reg.unknown_name(what, name, known))


def _check_filters(reg: Registry, args: argparse.Namespace) -> None:
    _check_names(reg, "layout", args.layout, reg.layouts)
    _check_names(reg, "io_backend", args.io_backend, reg.io_backends)


def _cmd_matrix(args: argparse.Namespace) -> int:
    reg = _registry()
    _check_filters(reg, args)
    kinds = _kinds(args)
    device = args.device
    cells = matrix_cells(reg, kinds=kinds, device=device, layouts=args.layout, io_backends=args.io_backend)
    if args.json:
        data = {"device": str(device), "cuda_available": torch.cuda.is_available(), "operations": list(OPERATIONS),
                "cells": [{**asdict(c), "operations": {op: c.strategy for op in OPERATIONS},
                           "reason": c.reason or None} for c in cells]}
        print(json.dumps(data, indent=1))
        return 0
    if not reg.layouts:
        print(no_layout(reg))
        return 0
    print(render_matrix(cells, kinds, device))
    return 0


def _explain_spec(args: argparse.Namespace) -> PoolSpec:
    """The pool ``explain`` resolves on: a model shape of ``hicache bench`` (``--shape``) at ``--tokens`` and
    ``--page-size``, or the small representative pool of ``--kind`` / ``--dtype``.

    :raises UsageError: ``--shape`` beside ``--kind`` or ``--dtype`` (the shape sets both)."""
    tokens, page_size = args.tokens, args.page_size
    if not args.shape:
        dtype = DTYPES[args.dtype] if args.dtype else None
        return representative_spec(args.kind or MHA, args.sharded, args.device, dtype=dtype,
                                   page_size=page_size or 16, tokens=tokens or 64)
    from .bench import SHAPES

    clash = [flag for flag, value in (("--kind", args.kind), ("--dtype", args.dtype)) if value]
    if clash:
        raise UsageError(f"--shape {args.shape} sets the pool's kind and dtype; leave out {' and '.join(clash)}")
    page_size = page_size or 64
    tokens = -(-(tokens or 4096) // page_size) * page_size  # whole pages
    spec = SHAPES[args.shape](tokens, page_size, args.device)
    return replace(spec, layer_map=_layer_map(True, spec.layer_map.num_device_layers)) if args.sharded else spec


def _cmd_explain(args: argparse.Namespace) -> int:
    reg = _registry()
    spec = _explain_spec(args)
    try:
        lines, ok = explain_lines(reg, spec, args.layout, args.io_backend, args.strategy)
    except UnknownLayoutError as exc:  # its message names near matches
        print(f"hicache explain: {exc}", file=sys.stderr)
        return 2
    note = _no_cuda_note(args.device)
    # flushed before the error below: one pipe taking both (2>&1) gets the report whole, then the error
    print("\n".join(lines + ([f"note: {note}"] if note else [])), flush=True)
    if ok:
        return 0
    try:
        reg.resolve(spec, args.layout, args.io_backend, override=args.strategy)
    except ResolutionError as exc:  # its message names near matches of an unknown io_backend
        print(f"hicache explain: {exc}", file=sys.stderr)
    return 2


def _interpreter_problem() -> str | None:
    """Why kernel cells cannot run in Triton's interpreter although ``TRITON_INTERPRET=1``, or ``None``."""
    if interpreting() and importlib.util.find_spec("numpy") is None:
        return f"TRITON_INTERPRET=1 needs numpy, which is not installed: {INTERPRET_EXTRA}"
    return None


def _cmd_verify(args: argparse.Namespace) -> int:
    reg = _registry()
    _check_filters(reg, args)
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device} but CUDA is not available")
    if device.type == "cpu":
        problem = _interpreter_problem()
        if problem:
            raise UsageError(problem)
    if "reference" not in reg.io_backends:  # every cell is compared with it
        raise UsageError(f"no reference io_backend to compare with: hicache's own plugin is not loaded; {reg.core_fix()}")
    if not reg.layouts:  # nothing to verify proves nothing (as when the filters leave no cell)
        if args.json:
            print(json.dumps({"device": str(device), "rows": [], "installation_problems": install_problems(reg)},
                             indent=1))
        print(f"hicache verify: {no_layout(reg)}", file=sys.stderr)
        return 1 if install_problems(reg) else 2  # a broken plugin fails; nothing installed is a usage problem
    kinds = _kinds(args)
    tokens = args.tokens or VERIFY_TOKENS.get(device.type, VERIFY_TOKENS["cpu"])
    reps = args.reps or VERIFY_REPS.get(device.type, VERIFY_REPS["cpu"])
    cells = matrix_cells(reg, kinds=kinds, device=device, layouts=args.layout, io_backends=args.io_backend)
    progress = _Progress(sys.stderr) if sys.stderr.isatty() and not args.json else None
    try:
        rows = verify_cells(reg, cells, device, tokens=tokens, reps=reps, timing=not args.no_timing,
                            all_cases=args.all_cases, progress=progress)
    finally:
        if progress is not None:
            progress.clear()
    problems = install_problems(reg)
    if args.json:
        print(json.dumps({"device": str(device), "tokens": tokens, "rows": [asdict(r) for r in rows],
                          "installation_problems": problems}, indent=1))
    else:
        timed = [] if args.no_timing else [representative_spec(k, False, device, tokens=tokens, medium=True)
                                           for k in kinds]
        print(render_verify(rows, device, timed, problems))
    if problems or any(r.result == "FAIL" for r in rows):
        return 1
    if not any(r.result == "PASS" for r in rows):  # filters or settings that leave nothing to verify prove nothing
        print(f"hicache verify: no cell was verified ({_n(len(rows), 'cell')}, all skipped: see the notes); check the "
              "filters and the HICACHE_* settings", file=sys.stderr)
        return 2
    return 0


# -- doctor --------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_version(module: str) -> str | None:
    """The installed version of ``module``, without importing it when its distribution says (importing
    Triton would fix its interpreter mode for the whole process), else from the imported module."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception as exc:  # a broken install is reported, not raised
        return f"installed but fails to import: {_first_line(exc)}"


def _copy_engine_runtime() -> str:
    """Which CUDA runtime the copy engine binds, whether it batches, and the other runtimes mapped beside it."""
    from .backends import cudart

    try:
        rt = cudart.runtime()
    except RuntimeError as exc:
        return f"unavailable ({_first_line(exc)})"
    how = "batched copies" if rt.has_batch else "one call per copy (no cudaMemcpyBatchAsync)"
    text = f"CUDA runtime {rt.path} (runtime {rt.version}, driver {rt.driver_version}: {how})"
    bound = os.path.realpath(rt.path)  # (a soname or a link next to torch; /proc/self/maps names the file)
    others = [p for p in cudart.loaded_cudart_paths() if os.path.realpath(p) != bound]
    return text + (f"; also mapped, unused: {', '.join(others)}" if others else "")


def _calibration_line() -> str:
    """The calibration ``auto`` reads for the first GPU, and whether it was measured on another model."""
    from .calibration import DEFAULT, calibration_path, load_calibration

    cal = load_calibration(torch.device("cuda", 0), warn_other_gpu=False)  # the line below says it, once
    text = (f"{cal.gpu}, {cal.source} (file: {calibration_path()}): copy engine from {cal.d2h_min_block} B blocks "
            f"(backups) / {cal.h2d_min_block} B (loads), {cal.submit_us:.2f} us per descriptor, {cal.call_us:g} us per "
            f"call, link {cal.link_gbps:.1f} GB/s")
    if cal.kernel_load_ratio is not None:
        from .backends.auto_rules import kernel_room

        room = kernel_room(cal)
        text += (f"; kernels' load bursts {cal.kernel_load_ratio:.2f} of memcpy"
                 + (f": auto's loads get {room:.2f}x room on the copy engine" if room > 1.0 else ""))
    elif cal is not DEFAULT:  # a file's entry written before calibrate measured the kernels, or with --no-kernel
        text += "; kernels' load speed not measured (taken as usual): `hicache calibrate` measures it"
    here = torch.cuda.get_device_name(0)
    if cal.gpu != here:
        text += f"; measured on another GPU than this {here}: run `hicache calibrate` here"
    return text


def doctor_lines(reg: Registry) -> list[str]:
    """The environment report of ``hicache doctor``: one fact per line, then the cells this machine skips."""
    cuda = torch.cuda.is_available()
    lines = [f"hicache-core {_version('hicache-core') or '(not installed as a distribution)'}, "
             f"Python {sys.version.split()[0]}, torch {torch.__version__} "
             f"(CUDA build: {torch.version.cuda or 'no'})"]
    if cuda:
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        lines.append(f"CUDA: available, {_n(torch.cuda.device_count(), 'device')} ({', '.join(names)})")
        torch.cuda.init()
        lines.append("copy engine (direct): " + _copy_engine_runtime())
        lines.append("auto's calibration: " + _calibration_line())
    else:
        lines.append("CUDA: not available (CPU pools only; the kernel io_backend needs TRITON_INTERPRET=1)")
        lines.append("copy engine (direct): memmove on CPU pools (no CUDA runtime needed)")
    from .calibration import file_report

    where, problems = file_report()
    lines.append(f"calibration file: {where}")
    lines += [f"  PROBLEM: {p}" for p in problems]
    triton = _module_version("triton")
    lines.append(f"Triton: {triton}" if triton else "Triton: not installed (pip install triton); kernel cells skip")
    numpy = _module_version("numpy")
    interp = "on (TRITON_INTERPRET=1)" if interpreting() else "off"
    lines.append(f"Triton interpreter: {interp}; numpy: {numpy or f'not installed (the interpreter needs it: {INTERPRET_EXTRA})'}")
    lines.append(f"plugins: {_n(len(reg.plugins), 'plugin')} ({sum(1 for p in reg.plugins if p.error)} broken), "
                 f"layouts: {', '.join(sorted(reg.layouts)) or '(none)'}; io_backends: {', '.join(reg.io_backends) or '(none)'}")
    lines += [f"  BROKEN {p.name} ({p.label}): {p.error}" for p in reg.plugins if p.error]
    lines += [f"  DISABLED: {c.message}" for c in reg.conflicts]
    if install_problems(reg):
        lines.append("  (verify and plugins exit 1 until these are mended)")
    if not reg.layouts:
        return lines + [no_layout(reg)]
    device = torch.device("cuda" if cuda else "cpu")
    cells = verified_cells(reg, matrix_cells(reg, device=device))
    unserved = [c for c in cells if c.strategy is None]
    failing = sum(c.load_failed for c in unserved)
    lines.append(f"verify on {device}: {len(cells) - len(unserved)} of {_n(len(cells), 'cell')} will run, "
                 f"{len(unserved) - failing} will be skipped" + (f", {failing} will fail" if failing else "")
                 + (":" if unserved else ""))
    by_reason: dict[str, list[Cell]] = {}
    for c in unserved:
        by_reason.setdefault(c.reason, []).append(c)
    for reason, group in by_reason.items():
        lines.append(f"  {_n(len(group), 'cell')} ({', '.join(sorted({f'{c.layout}/{c.io_backend}' for c in group}))}): "
                     f"{reason}")
    problem = _interpreter_problem()
    if problem and device.type == "cpu":
        lines.append(f"problem: {problem}")
    return lines


def _cmd_doctor(args: argparse.Namespace) -> int:
    print("\n".join(doctor_lines(_registry())))
    return 0


def _version_text() -> str:
    return f"hicache {_version('hicache-core') or __version__}"


# -- parser --------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu, cuda or cuda:N")
    return device


def _common() -> argparse.ArgumentParser:
    """Options every subcommand also accepts after its name (``hicache verify -v``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="log INFO (-v) or DEBUG (-vv) to stderr")
    return common


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", action="extend", nargs="+", choices=KINDS, help="pool kinds (default: all)")
    p.add_argument("--layout", action="append", help="only this layout (repeatable)")
    p.add_argument("--io-backend", action="append", help="only this io_backend (repeatable)")
    p.add_argument("--json", action="store_true", help="JSON instead of the table")


def _parser_plugins(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plugins", parents=[common], help="loaded plugins and what each registers (exit 1 when a "
                       "plugin is broken or a name or key registered twice is disabled)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)


def _parser_matrix(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("matrix", parents=[common],
                       help="support table: layout x io_backend x sharded x kind x operation")
    _add_filters(p)
    p.add_argument("--device", type=_device, default=torch.device("cpu"),
                   help="device of the representative pools (default: cpu)")
    p.set_defaults(func=_cmd_matrix)


def _parser_explain(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("explain", parents=[common], help="how one (layout, io_backend, sharded) key resolves, and why")
    p.add_argument("--layout", required=True)
    p.add_argument("--io-backend", required=True)
    p.add_argument("--sharded", action="store_true", help="layer-sharded device pool (rank 1 of 2)")
    p.add_argument("--kind", choices=KINDS, default=None, help="kind of the small representative pool (default: mha)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="pool dtype (default: fp16 for mha, bf16 for mla)")
    from .bench import SHAPES

    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="a model's pool instead of the small representative one (as hicache bench names them: "
                        "layers x row, dtype); auto's picks then show for calls of --tokens tokens")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help="host slots of the pool, and tokens per call in auto's estimate (default: 4096 with --shape, "
                        "else 64)")
    p.add_argument("--page-size", type=_positive_int, default=None,
                   help="tokens per page (default: 64 with --shape, else 16)")
    p.add_argument("--strategy", help="strategy name to use instead of the default pick")
    p.add_argument("--device", type=_device, default=torch.device("cpu"))
    p.set_defaults(func=_cmd_explain)


def _parser_verify(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("verify", parents=[common],
                       help="round-trip random KV through every resolvable cell; PASS/FAIL and GB/s")
    _add_filters(p)
    p.add_argument("--device", type=_device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help=f"tokens of the timed pool (default {VERIFY_TOKENS})")
    p.add_argument("--reps", type=_positive_int, default=None, help=f"timed repetitions (default {VERIFY_REPS})")
    p.add_argument("--no-timing", action="store_true", help="conformance only")
    p.add_argument("--all-cases", action="store_true", help="also every matching conformance-kit case and index variant")
    p.set_defaults(func=_cmd_verify)


def _parser_doctor(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("doctor", parents=[common],
                       help="torch/CUDA, Triton, interpreter, numpy, copy engine, and which verify cells will skip")
    p.set_defaults(func=_cmd_doctor)


def _needs_cuda(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap ``bench``: without CUDA it is a usage error, before anything is written."""
    def run(args: argparse.Namespace) -> int:
        asks_help = getattr(args, "peers", False) and bool({"-h", "--help"} & set(getattr(args, "peers_args", "").split()))
        if not getattr(args, "plot_only", "") and not asks_help and not torch.cuda.is_available():
            raise UsageError("needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)")
        return func(args)
    return run


def _parser_bench(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    if importlib.util.find_spec(f"{__package__}.bench") is None:
        return
    from . import bench

    bench.add_parser(sub)
    p = sub.choices["bench"]
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="log INFO (-v) or DEBUG (-vv) to stderr")
    p.set_defaults(func=_needs_cuda(p.get_default("func")))


def _parser_calibrate(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from . import calibration

    calibration.add_parser(sub)
    p = sub.choices["calibrate"]
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="log INFO (-v) or DEBUG (-vv) to stderr")
    p.set_defaults(func=_needs_cuda(p.get_default("func")))


#: One parser builder per subcommand, in ``--help`` order.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction, argparse.ArgumentParser], None], ...] = (
    _parser_plugins, _parser_matrix, _parser_explain, _parser_verify, _parser_doctor, _parser_bench,
    _parser_calibrate,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hicache`` (``bench`` is added when :mod:`hicache_core.bench` exists)."""
    parser = argparse.ArgumentParser(prog="hicache", description="hicache: KV cache host pools in any layout.")
    parser.add_argument("--version", action="version", version=_version_text())
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log INFO (-v) or DEBUG (-vv) to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common()
    for add in SUBCOMMANDS:
        add(sub, common)
    return parser


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if os.environ.get(ENV_TRACE, "").strip().lower() not in ("", *OFF):  # resolutions are INFO records of the registry
        logging.getLogger(f"{__package__}.registry").setLevel(min(level, logging.INFO))


def main(argv: list[str] | None = None) -> int:
    """Run ``hicache``; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # with the command's own usage (argparse gives the top-level one, which lists no option of the command)
        given = list(sys.argv[1:] if argv is None else argv)
        before = args.command in given and any(x in given[:given.index(args.command)] for x in extra)
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (parser if before else commands.choices[args.command]).error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging(args.verbose)
    try:
        return int(args.func(args))
    except (RegistryError, UsageError) as exc:
        print(f"hicache {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. ``hicache verify | head``: stop quietly, with the code of a process SIGPIPE ends
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

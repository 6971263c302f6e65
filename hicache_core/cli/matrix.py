"""``hicache matrix``: every (layout, io_backend, sharded, kind) cell resolved on the representative pools."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import torch

from ..registry import LOAD_FAILED, Registry
from ..strategy import OPERATIONS
from . import shared
from .args import _add_filters, _check_filters, _device, _kinds
from .shared import KINDS, _n, _no_cuda_note, _Notes, _table, _yn, no_layout, representative_spec


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


def _cmd_matrix(args: argparse.Namespace) -> int:
    reg = shared._registry()
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


def _parser_matrix(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("matrix", parents=[common],
                       help="support table: layout x io_backend x sharded x kind x operation")
    _add_filters(p)
    p.add_argument("--device", type=_device, default=torch.device("cpu"),
                   help="device of the representative pools (default: cpu)")
    p.set_defaults(func=_cmd_matrix)

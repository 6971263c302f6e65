"""The options and argument types the ``hicache`` subcommands share, and the checks of the names they filter by."""

from __future__ import annotations

import argparse
from typing import Iterable, Sequence

import torch

from ..registry import Registry
from .shared import KINDS, UsageError


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


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", action="extend", nargs="+", choices=KINDS, help="pool kinds (default: all)")
    p.add_argument("--layout", action="append", help="only this layout (repeatable)")
    p.add_argument("--io-backend", action="append", help="only this io_backend (repeatable)")
    p.add_argument("--json", action="store_true", help="JSON instead of the table")


def _kinds(args: argparse.Namespace) -> list[str]:
    return [k for k in KINDS if not args.kind or k in args.kind]


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

"""``hicache explain``: how one (layout, io_backend, sharded) key resolves on one pool, and why."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from ..errors import ResolutionError, UnknownLayoutError
from ..registry import ENV_STRATEGY, Registry
from ..spec import MHA, PoolSpec
from . import shared
from .args import _device, _positive_int
from .shared import DTYPES, KINDS, UsageError, _layer_map, _no_cuda_note, representative_spec


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


def _explain_spec(args: argparse.Namespace) -> PoolSpec:
    """The pool ``explain`` resolves on: a model shape of ``hicache bench`` (``--shape``) at ``--tokens`` and
    ``--page-size``, or the small representative pool of ``--kind`` / ``--dtype``.

    :raises UsageError: ``--shape`` beside ``--kind`` or ``--dtype`` (the shape sets both)."""
    tokens, page_size = args.tokens, args.page_size
    if not args.shape:
        dtype = DTYPES[args.dtype] if args.dtype else None
        return representative_spec(args.kind or MHA, args.sharded, args.device, dtype=dtype,
                                   page_size=page_size or 16, tokens=tokens or 64)
    from ..bench import SHAPES

    clash = [flag for flag, value in (("--kind", args.kind), ("--dtype", args.dtype)) if value]
    if clash:
        raise UsageError(f"--shape {args.shape} sets the pool's kind and dtype; leave out {' and '.join(clash)}")
    page_size = page_size or 64
    tokens = -(-(tokens or 4096) // page_size) * page_size  # whole pages
    spec = SHAPES[args.shape](tokens, page_size, args.device)
    return replace(spec, layer_map=_layer_map(True, spec.layer_map.num_device_layers)) if args.sharded else spec


def _cmd_explain(args: argparse.Namespace) -> int:
    reg = shared._registry()
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


def _parser_explain(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("explain", parents=[common], help="how one (layout, io_backend, sharded) key resolves, and why")
    p.add_argument("--layout", required=True)
    p.add_argument("--io-backend", required=True)
    p.add_argument("--sharded", action="store_true", help="layer-sharded device pool (rank 1 of 2)")
    p.add_argument("--kind", choices=KINDS, default=None, help="kind of the small representative pool (default: mha)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="pool dtype (default: fp16 for mha, bf16 for mla)")
    from ..bench import SHAPES

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

"""``hicache plugins``: the loaded plugins and what each registers; exit 1 on a broken plugin or a name or key two
plugins registered (disabled)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from ..registry import Registry
from . import shared
from .shared import _n, _yn, install_problems, no_layout


def _sharded_text(sharded: tuple[bool, ...]) -> str:
    return "both" if set(sharded) == {False, True} else _yn(sharded[0]) if sharded else "none"


def _conflict_text(reg: Registry, kind: str, name: str) -> str:
    conflict = next((c for c in reg.conflicts if c.kind == kind and c.name == name), None)
    return conflict.message if conflict is not None else f"{kind} {name!r} is not registered"


def _cmd_plugins(args: argparse.Namespace) -> int:
    reg = shared._registry()
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


def _parser_plugins(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plugins", parents=[common], help="loaded plugins and what each registers (exit 1 when a "
                       "plugin is broken or a name or key registered twice is disabled)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)


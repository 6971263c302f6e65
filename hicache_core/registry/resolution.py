"""Resolving a key in a registry: the layout's and the candidates' verdicts, the pick, the report of a miss.

The work of :meth:`Registry.try_resolve <hicache_core.registry.Registry.try_resolve>`, ``resolve`` and
``alternatives`` (whose docstrings are the contracts), given the registry as ``reg``: its other methods are called
through it, so a subclass's overrides apply as they did.  Part of :mod:`hicache_core.registry`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, NoReturn

from ..errors import ConfigError, DuplicateRegistrationError, ResolutionError
from ..spec import PoolSpec
from .checks import _contract_problem
from .records import (BUILTIN_PLUGIN, ENV_STRATEGY, LOAD_FAILED, NOT_A_CANDIDATE, PLUGINS_COME_FROM, Resolution,
                      did_you_mean)

if TYPE_CHECKING:
    from .core import Registry

#: The registry's logger (the package's name, which users configure; ``HICACHE_TRACE`` logs through it too).
logger = logging.getLogger("hicache_core.registry")


def _try_resolve(
    reg: Registry, spec: PoolSpec, layout: str, io_backend: str, override: str | None,
    options: Mapping[str, Any] | None, errors: list[Exception] | None,
) -> tuple[Resolution | None, list[tuple[str, str]]]:
    """:meth:`Registry.try_resolve`."""
    reg.check_key(spec, layout, io_backend, override)
    lay = reg.layout(layout)
    key_sharded = spec.sharded
    conflict = reg.conflict_for(layout, io_backend, key_sharded)
    if conflict is not None:
        raise DuplicateRegistrationError(conflict.message)
    cands = reg.candidates(layout, io_backend, key_sharded)
    rejected: list[tuple[str, str]] = []
    owner = reg.layouts[layout][1]
    try:
        reason = lay.check(spec)
        wrong = _contract_problem(reason, "check()")
        if wrong:  # True / False / 0 would be read as a reason / as "fits": neither is what the plugin meant
            reason = f"{wrong} (a bug of plugin {owner.name!r}, {owner.label})"
    except Exception as exc:  # a plugin's bug: a rejection naming it, as a raising supports() is
        reason = f"its check() raised {type(exc).__name__}: {exc} (a bug of plugin {owner.name!r}, {owner.label})"
    if reason:
        return None, [(f"layout {layout}", reason)]
    if override is None:
        env_pick = reg.env.get(ENV_STRATEGY, "").strip()
        if env_pick and env_pick not in reg.strategies and reg._conflict_on("strategy", env_pick) is None:
            return None, [(env_pick, f"{ENV_STRATEGY}={env_pick!r} names no registered strategy; registered: "
                                     f"{sorted(reg.strategies)}. Fix or unset {ENV_STRATEGY}")]
        if env_pick and any(c.name == env_pick for c in cands):
            cands = [c for c in cands if c.name == env_pick]
    else:
        picked = [c for c in cands if c.name == override]
        if not picked:
            refusal = f"{NOT_A_CANDIDATE}; candidates: {[c.name for c in cands]}"
            if not cands:
                refusal += f" ({_no_candidate(reg, layout, io_backend, key_sharded)})"
            return None, [(override, refusal)]
        cands = picked
    for info in cands:
        try:
            strategy = info.factory(**(options or {}))
            if hasattr(strategy, "use_registry"):  # composite strategies resolve their parts here
                strategy.use_registry(reg)
            why = strategy.supports(spec, lay)
            wrong = _contract_problem(why, "supports()")
            if wrong:
                prov = reg.strategies[info.name][1]
                why = f"{wrong} (a bug of plugin {prov.name!r}, {prov.label})"
        except Exception as exc:  # a broken factory rejects its strategy, not the registry
            why = f"{LOAD_FAILED}{type(exc).__name__}: {exc}"
            logger.debug("hicache: strategy %s %s", info.name, why, exc_info=True)  # the traceback, at -vv
            if errors is not None:
                errors.append(exc)
        if why:
            rejected.append((info.name, why))
            continue
        res = Resolution(lay, info, strategy, reg.strategies[info.name][1], tuple(rejected))
        if reg.trace:
            logger.info(
                "hicache: (%s, %s, sharded=%s) %s -> %s from %s",
                layout, io_backend, key_sharded, spec.describe(), info.name, res.provider.label,
            )
        return res, rejected
    if not cands:
        rejected.append(("(none)", _no_candidate(reg, layout, io_backend, key_sharded)))
    return None, rejected


def _no_candidate(reg: Registry, layout: str, io_backend: str, sharded: bool) -> str:
    """Why no strategy is a candidate for a key: no plugin provides the io_backend, or its strategies for the
    layout serve the other kind of pool only (their registration's ``sharded``), or none serves the layout."""
    if io_backend not in reg.io_backends:
        return f"no installed plugin provides io_backend {io_backend!r} {PLUGINS_COME_FROM}"
    other = [i.name for i in reg.candidates(layout, io_backend, not sharded)]
    if other:
        kind = "unsharded" if sharded else "sharded"
        return (f"{', '.join(other)} {'serves' if len(other) == 1 else 'serve'} {kind} pools only (registered "
                f"with sharded=({not sharded},)); add {sharded} to its registration's sharded to serve these")
    return f"no strategy is registered for io_backend {io_backend!r} and this layout"


def _unresolved(reg: Registry, spec: PoolSpec, layout: str, io_backend: str, options: Mapping[str, Any] | None,
                rejected: list[tuple[str, str]], errors: list[Exception]) -> NoReturn:
    """Raise what :meth:`Registry.resolve` raises where nothing serves the key: ``rejected`` and ``errors`` are what
    :meth:`Registry.try_resolve` gave."""
    lines = [f"no strategy serves (layout={layout!r}, io_backend={io_backend!r}, sharded={spec.sharded}) "
             f"for {spec.describe()}:"]
    lines += [f"  {name}: {why}" for name, why in rejected]
    alts = reg.alternatives(spec, layout, io_backend, options)
    if alts or not options:
        lines.append("nearest working alternatives: " + ("; ".join(alts) if alts else "(none)"))
    else:  # options are one strategy's own: a misspelt one fails every other key too
        alts = reg.alternatives(spec, layout, io_backend)
        lines.append(f"nearest working alternatives (none takes strategy_options {sorted(options)}; without them): "
                     + ("; ".join(alts) if alts else "(none)"))
    if BUILTIN_PLUGIN in reg.skipped:
        lines.append(f"note: {BUILTIN_PLUGIN!r}, the plugin of the generic backends (reference, direct, auto), is "
                     f"left out: {reg.core_fix()}")
    lines.append(reg.inventory())
    if io_backend not in reg.io_backends and (hint := did_you_mean(io_backend, reg.io_backends)):
        lines.append(hint)
    config = next((e for e in errors if isinstance(e, ConfigError)), None)
    # a setting that made a candidate fail to load is the cause (a caller may tell the user's setting apart)
    raise ResolutionError("\n".join(lines)) from config


def _alternatives(reg: Registry, spec: PoolSpec, layout: str, io_backend: str,
                  options: Mapping[str, Any] | None) -> list[str]:
    """:meth:`Registry.alternatives`."""
    reg.check_key(spec, layout, io_backend)
    out = []
    pairs = [(layout, b) for b in reg.io_backends if b != io_backend]
    pairs += [(lay, io_backend) for lay in sorted(reg.layouts) if lay != layout]
    for lay, backend in pairs:
        if lay not in reg.layouts or reg.conflict_for(lay, backend, spec.sharded) is not None:
            continue
        res, _ = reg.try_resolve(spec, lay, backend, options=options)
        if res is not None:
            out.append(f"layout={lay!r}, io_backend={backend!r} ({res.info.name})")
    return out

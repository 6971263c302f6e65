"""Checks of what plugins hand the registry: names, layouts, strategy registrations, hook functions, answers.

Each problem is told in words naming the plugin's mistake: the registry records a plugin broken with it, or (for a
``check()`` / ``supports()`` answer) rejects with it, naming the plugin's bug.  Part of :mod:`hicache_core.registry`.
"""

from __future__ import annotations

import difflib
import inspect
import types
from dataclasses import replace
from typing import Any

import pluggy

from .. import hookspecs
from ..layout import Layout
from ..strategy import ANY_LAYOUT, StrategyInfo
from .records import _key_name


def _name_problem(value: object) -> str | None:
    """Why ``value`` cannot be a layout, strategy or io_backend name (``None`` when it can): a non-empty string
    without whitespace, control characters or commas (names are typed on command lines and in comma lists), and not
    the layout wildcard ``"*"``."""
    if not isinstance(value, str) or not value:
        return f"must be a non-empty str, got {type(value).__name__} {value!r}"
    if value == ANY_LAYOUT:
        return f"must not be {ANY_LAYOUT!r} (the wildcard of generic strategies)"
    if any(c.isspace() or not c.isprintable() or c == "," for c in value):
        return f"must have no whitespace, control characters or commas, got {value!r}"
    return None


def _check_layout(lay: object) -> None:
    """Refuse what ``register()`` of ``hicache_register_layouts`` cannot take, naming the fix."""
    if isinstance(lay, type):
        raise TypeError(f"register() was given the class {lay.__name__}, not a layout: pass an instance "
                        f"(register({lay.__name__}()))")
    if not isinstance(lay, Layout):
        raise TypeError(f"register() was given {lay!r}: a hicache_core.Layout with a non-empty name "
                        "(name, description, check, plan)")
    why = _name_problem(getattr(lay, "name", None))
    if why:
        raise TypeError(f"register() was given a layout whose name {why}; give it a name such as 'my_layout'")
    if not isinstance(lay.description, str):
        raise TypeError(f"layout {lay.name!r}: description must be a str, got {type(lay.description).__name__}")
    for method in ("check", "plan"):
        if not callable(getattr(lay, method)):
            raise TypeError(f"layout {lay.name!r}: {method} must be a method, got "
                            f"{type(getattr(lay, method)).__name__}")


def _check_strategy(info: object) -> None:
    """Refuse a :class:`StrategyInfo` whose fields would break lookups of every strategy (a ``sharded=True`` is not
    iterable, ``layouts="x"`` would register one key per letter, a name of ``None`` does not sort)."""
    if not isinstance(info, StrategyInfo):
        raise TypeError(f"register() was given {info!r}: a hicache_core.StrategyInfo")
    for field_name in ("name", "io_backend"):
        why = _name_problem(getattr(info, field_name))
        if why:
            raise TypeError(f"StrategyInfo {field_name} {why}")
    if not isinstance(info.layouts, (tuple, list)) or not info.layouts:
        raise TypeError(f"strategy {info.name!r}: layouts must be a non-empty tuple of layout names (or "
                        f"({ANY_LAYOUT!r},) for every layout), got {type(info.layouts).__name__} {info.layouts!r}")
    for lay in info.layouts:
        why = None if lay == ANY_LAYOUT else _name_problem(lay)
        if why:
            raise TypeError(f"strategy {info.name!r}: a layouts entry {why}")
    if (not isinstance(info.sharded, (tuple, list)) or not info.sharded
            or not all(isinstance(x, bool) for x in info.sharded)):
        raise TypeError(f"strategy {info.name!r}: sharded must be a non-empty tuple of bools such as (False, True), "
                        f"got {type(info.sharded).__name__} {info.sharded!r}")
    if not callable(info.factory):
        raise TypeError(f"strategy {info.name!r}: factory must be callable (returning the strategy), got "
                        f"{type(info.factory).__name__} {info.factory!r}")
    if not isinstance(info.description, str):
        raise TypeError(f"strategy {info.name!r}: description must be a str, got {type(info.description).__name__}")


def _contract_problem(value: object, what: str) -> str | None:
    """A ``check()`` / ``supports()`` answer that is neither ``None`` nor a reason string, as a rejection reason."""
    if value is None or isinstance(value, str):
        return None
    return (f"its {what} returned {type(value).__name__} {value!r}; it must return None (supported) or a one-line "
            "reason (str)")



def _check_own_duplicates(layouts: list[Layout], infos: list[StrategyInfo]) -> None:
    """Raise ``ValueError`` where one plugin registers a layout name, a strategy name or an exact key twice itself: a
    bug of that plugin (a conflict's advice, uninstall one distribution or block one entry point, would not apply)."""
    names = [lay.name for lay in layouts]
    for name in dict.fromkeys(n for n in names if names.count(n) > 1):
        raise ValueError(f"layout {name!r} is registered twice by this plugin; call register() once per layout")
    names = [info.name for info in infos]
    for name in dict.fromkeys(n for n in names if names.count(n) > 1):
        raise ValueError(f"strategy name {name!r} is registered twice by this plugin; register each StrategyInfo "
                         "once, and give each its own name")
    owner: dict[tuple[str, str, bool], str] = {}
    for info in infos:
        if info.generic:
            continue
        for key in ((lay, info.io_backend, sh) for lay in dict.fromkeys(info.layouts) for sh in dict.fromkeys(info.sharded)):
            if key in owner:
                raise ValueError(
                    f"key {_key_name(key)} is registered by two strategies of this plugin, {owner[key]!r} and "
                    f"{info.name!r}; a key takes one exact registration: take {key[0]!r} out of one's layouts, or "
                    f"{key[2]} out of its sharded")
            owner[key] = info.name


def _hook_signature_error(name: str, func: Any) -> str | None:
    """Why the hook function ``func`` cannot be called as the core calls it, ``name(register=...)``, or ``None``."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # no signature to read: pluggy decides
        return None
    if params and not inspect.ismethod(func) and params[0].name in ("self", "cls"):  # as pluggy reads it
        params = params[1:]
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if required <= {"register"} and ("register" in named or any(p.kind is p.VAR_KEYWORD for p in params)):
        return None
    return (f"hook {name}{inspect.signature(func)} does not match its specification {name}(register): the core calls "
            f"it with one keyword argument, register; write `def {name}(register):` and call register(x) once per "
            f"{'layout' if name == 'hicache_register_layouts' else 'strategy'}")


def _hook_problem(plugin: Any, relay: pluggy.HookRelay) -> tuple[str | None, list[str]]:
    """Why ``plugin``'s hook functions make it unusable (``None`` when nothing does), and the names of its hook
    functions left unmarked (never called: a warning, not a refusal); ``relay`` is the plugin manager's ``hook``."""
    # hook implementations: functions marked with hookimpl.  Unknown: a marked one no hook specifies, or one named
    # hicache_register_* (a misspelt hook); a module may import hicache_core or name other helpers hicache_*
    try:  # an attribute that raises when read is that plugin's bug, not the registry's
        funcs = {n: f for n in dir(plugin) if n.startswith("hicache_")
                 and callable(f := getattr(plugin, n, None)) and not isinstance(f, (type, types.ModuleType))}
        marked = {n for n, f in funcs.items() if getattr(f, f"{hookspecs.PROJECT}_impl", None) is not None}
    except Exception as exc:
        return f"its attributes could not be read: {type(exc).__name__}: {exc}", []
    unknown = [n for n in funcs if not hasattr(relay, n) and (n in marked or n.startswith("hicache_register_"))]
    if unknown:
        hooks = [n for n in dir(relay) if n.startswith("hicache_")]
        near = {n: difflib.get_close_matches(n, hooks, n=1) for n in unknown}
        hint = "; ".join(f"did you mean {m[0]!r} for {n!r}?" for n, m in near.items() if m)
        return f"implements unknown hooks {unknown}" + (f" ({hint})" if hint else ""), []
    misfit = [why for n in sorted(marked) if hasattr(relay, n) and (why := _hook_signature_error(n, funcs[n]))]
    if misfit:  # pluggy's own refusal names neither the parameter it wants nor how to write the hook
        return "; ".join(misfit), []
    return None, [n for n in funcs if hasattr(relay, n) and n not in marked]


def _check_registrations(layouts: list[Layout], infos: list[StrategyInfo]) -> None:
    """Refuse what one plugin's hooks registered (each layout and strategy, then its own duplicates), so that entering
    them into the registry cannot fail half-way; a strategy's ``layouts`` or ``sharded`` given as a list is replaced
    in ``infos`` by the same registration with tuples.

    :raises TypeError, ValueError: the first refusal."""
    for lay in layouts:
        _check_layout(lay)
    for i, info in enumerate(infos):
        _check_strategy(info)
        if not isinstance(info.layouts, tuple) or not isinstance(info.sharded, tuple):  # lists: as tuples
            infos[i] = replace(info, layouts=tuple(info.layouts), sharded=tuple(info.sharded))
    _check_own_duplicates(layouts, infos)

"""The strategy registry: plugins found through entry points, resolved by key.

``create_registry()`` builds a fresh :class:`Registry` (a new pluggy manager,
nothing cached at import).  Plugins are loaded from the ``hicache`` entry-point
group in a fixed order (entry-point name, then distribution), so results never
depend on install order.  A plugin that fails to import or whose hook raises is
logged, recorded and skipped, unless the allow-list names it explicitly.

Environment switches (read when a registry is created):

``HICACHE_PLUGINS``
    comma-separated allow-list of entry-point names; others are not loaded.
``HICACHE_DISABLE_PLUGINS``
    comma-separated block-list of entry-point names.
``HICACHE_STRATEGY``
    strategy name preferred wherever it is a candidate (see :meth:`Registry.resolve`);
    a name no plugin registers makes every resolution raise :class:`ResolutionError`.

Two plugins registering the same layout name, strategy name or exact key do not
break the registry: the names and keys involved are recorded in
:attr:`Registry.conflicts` and raise :class:`DuplicateRegistrationError` when a
pool asks for them; everything else keeps working.
``HICACHE_TRACE``
    ``1`` logs every resolution (and pluggy hook calls) at INFO level.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import sys
import threading
import types
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

import pluggy

from . import hookspecs
from .envflags import OFF
from .errors import (ConfigError, DuplicateRegistrationError, PluginLoadError, RegistryError, ResolutionError,
                     SpecError, UnknownLayoutError)
from .layout import Layout
from .logonce import log_once
from .spec import PoolSpec
from .strategy import ANY_LAYOUT, Strategy, StrategyInfo

if sys.version_info >= (3, 10):
    from importlib.metadata import EntryPoint, entry_points
else:  # pragma: no cover - exercised only on Python 3.9
    from importlib_metadata import EntryPoint, entry_points

__all__ = ["ENTRY_POINT_GROUP", "PluginRecord", "Conflict", "Resolution", "Registry", "create_registry"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hicache"
#: Where layouts and io_backends come from, for the errors about a name nothing installed provides.
PLUGINS_COME_FROM = (f"(plugins register through entry points of the {ENTRY_POINT_GROUP!r} group; `hicache plugins` "
                     f"lists them; a plugin whose entry points changed needs a reinstall)")
#: How a rejection reason starts where the strategy's factory or ``supports()`` raised (a plugin's bug, not a verdict).
LOAD_FAILED = "failed to load: "
ENV_ALLOW = "HICACHE_PLUGINS"
#: The entry-point name of hicache-core's own plugin (:mod:`hicache_core.builtin`).
BUILTIN_PLUGIN = "core"
ENV_BLOCK = "HICACHE_DISABLE_PLUGINS"
ENV_STRATEGY = "HICACHE_STRATEGY"
ENV_TRACE = "HICACHE_TRACE"


@dataclass
class PluginRecord:
    """One plugin: where it came from and what it registered (or why it broke)."""

    name: str
    dist: str
    version: str
    error: str | None = None
    layouts: list[str] = field(default_factory=list)
    strategies: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.dist} {self.version}"


@dataclass
class Conflict:
    """One name or key that several plugins registered; unusable until all but one are removed.

    :param kind: ``"layout"`` (a layout name), ``"strategy"`` (a strategy name) or
        ``"key"`` (an exact ``(layout, io_backend, sharded)`` registration).
    :param name: the layout or strategy name, or ``"(layout='x', io_backend='y', sharded=False)"``.
    :param plugins: every plugin that registered it, first registration first.
    :param details: what each plugin registered under it, parallel to ``plugins``
        (e.g. the strategy name of each side of a key conflict).
    """

    kind: str
    name: str
    plugins: list[PluginRecord]
    details: list[str] = field(default_factory=list)
    infos: list[StrategyInfo] = field(default_factory=list, repr=False)  # strategy conflicts: every side

    @property
    def entry_points(self) -> list[str]:
        """Entry-point names of the plugins involved: what ``HICACHE_DISABLE_PLUGINS`` takes."""
        return [p.name for p in self.plugins]

    @property
    def message(self) -> str:
        sides = " and ".join(
            f"{p.label} (entry point {p.name!r}{', ' + d if d else ''})"
            for p, d in zip(self.plugins, self.details or [""] * len(self.plugins))
        )
        what = {"layout": "layout", "strategy": "strategy name", "key": "key"}[self.kind]
        shown = self.name if self.kind == "key" else repr(self.name)
        return (f"{what} {shown} is registered by {sides}; it cannot be used until all but one are removed: "
                f"uninstall one distribution or set {ENV_BLOCK}={self.entry_points[-1]} "
                f"(or {' / '.join(self.entry_points[:-1])})")


@dataclass(frozen=True)
class Resolution:
    """The outcome of resolving a key: the chosen strategy and every rejection on the way."""

    layout: Layout
    info: StrategyInfo
    strategy: Strategy
    provider: PluginRecord
    rejected: tuple[tuple[str, str], ...]


def _csv(value: str | None) -> set[str] | None:
    """The names of a comma-separated list, or ``None`` when it names none (unset, blank or only commas: a
    ``HICACHE_PLUGINS=","`` is no allow-list, not one that allows nothing)."""
    names = {x.strip() for x in (value or "").split(",") if x.strip()}
    return names or None


def _ep_dist(ep: EntryPoint) -> tuple[str, str]:
    """``(distribution name, version)`` of an entry point; ``("<unknown>", "?")`` where its metadata cannot say (a
    half-removed install must not stop the other plugins from loading: the name is part of the sort key)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown>", "?"
    try:
        name, version = dist.metadata["Name"], dist.version
    except Exception:  # metadata missing or unreadable
        return "<unknown>", "?"
    return (name if isinstance(name, str) and name else "<unknown>",
            version if isinstance(version, str) and version else "?")


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


#: How a resolution that names a strategy (``override``) refuses one whose registration has no candidate for the key.
NOT_A_CANDIDATE = "not a candidate for this key"


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """``"did you mean: a, b?"`` naming up to three of ``options`` close to ``name``, or ``""``."""
    near = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"did you mean: {', '.join(near)}?" if near else ""


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


def _got(value: object) -> str:
    """``got TYPE REPR`` for a refusal's message, the repr cut to 40 characters."""
    text = repr(value)
    return f"got {type(value).__name__} {text if len(text) <= 40 else text[:40] + '...'}"


class Registry:
    """Layouts and strategies from every loaded plugin, with provenance."""

    def __init__(self, *, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginRecord] = []
        self.layouts: dict[str, tuple[Layout, PluginRecord]] = {}
        self.strategies: dict[str, tuple[StrategyInfo, PluginRecord]] = {}
        self._exact: dict[tuple[str, str, bool], str] = {}
        #: entry-point names :meth:`load_entry_points` left out by the allow- or block-list
        self.skipped: list[str] = []
        #: every duplicate registration, in the order found (see :class:`Conflict`)
        self.conflicts: list[Conflict] = []
        self.trace = self.env.get(ENV_TRACE, "").strip().lower() not in ("", *OFF)
        if self.trace:
            self.pm.trace.root.setwriter(lambda msg: logger.info("pluggy: %s", msg.rstrip()))
            self.pm.enable_tracing()

    # -- loading ----------------------------------------------------------------
    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Load every plugin of ``group``, honouring the allow- and block-lists."""
        allow, block = _csv(self.env.get(ENV_ALLOW)), _csv(self.env.get(ENV_BLOCK)) or set()
        eps = sorted(entry_points(group=group), key=lambda ep: (ep.name, _ep_dist(ep)[0]))
        for ep in eps:
            if ep.name in block or (allow is not None and ep.name not in allow):
                logger.info("hicache plugin %r skipped by %s/%s", ep.name, ENV_ALLOW, ENV_BLOCK)
                self.skipped.append(ep.name)
                continue
            dist, version = _ep_dist(ep)
            record = PluginRecord(ep.name, dist, version)
            try:
                plugin = ep.load()
            except (Exception, SystemExit) as exc:  # a broken plugin (one exiting on import too) breaks no other
                why = f"import failed: {type(exc).__name__}: {exc}"
                if isinstance(exc, (ImportError, AttributeError)):  # a module or object the entry point names is gone
                    who = "its distribution" if dist == "<unknown>" else dist
                    why += (f" (entry point {ep.name} = {ep.value}: if the plugin's code moved, reinstall {who}: "
                            f"entry points are read when it is installed, -e installs too)")
                self._broken(record, why, explicit=allow is not None)
                continue
            self.add_plugin(plugin, record, explicit=allow is not None)
        if BUILTIN_PLUGIN in self.skipped:  # the allowed or blocked plugins may still load, but nothing can be compared
            log_once(logger, logging.WARNING,
                     f"hicache's {BUILTIN_PLUGIN!r} plugin is not loaded: its reference, direct and auto io_backends are "
                     f"missing, and `hicache verify` and the conformance kit compare every strategy with reference; "
                     f"{self.core_fix()}")
        unknown = block - {ep.name for ep in eps}
        if unknown:  # a typo (or a distribution's name) leaves the plugin it meant to switch off on
            names = sorted(ep.name for ep in eps)
            hints = [f"{u!r}: {h}" for u in sorted(unknown) if (h := did_you_mean(u, names))]
            log_once(logger, logging.WARNING,
                     f"{ENV_BLOCK} names plugins that are not installed: {sorted(unknown)} (nothing switched off for "
                     f"them); it takes entry-point names: {names}" + "".join(f"; {h}" for h in hints))
        if allow:
            missing = allow - {p.name for p in self.plugins} - block  # blocked as well: the block list wins
            if missing:
                names = [ep.name for ep in eps]
                hints = [h for m in sorted(missing) if (h := did_you_mean(m, names))]
                raise PluginLoadError(
                    f"{ENV_ALLOW} names plugins that are not installed: {sorted(missing)}; "
                    f"installed: {sorted(names)}" + "".join(f"; {h}" for h in hints) + f" {PLUGINS_COME_FROM}"
                )

    def core_fix(self) -> str:
        """How to load hicache's own plugin (:data:`BUILTIN_PLUGIN`) where the environment's lists leave it out, or
        where it failed to load."""
        if BUILTIN_PLUGIN in (_csv(self.env.get(ENV_BLOCK)) or set()):  # the block list wins over the allow list
            return f"take {BUILTIN_PLUGIN} off {ENV_BLOCK}={self.env[ENV_BLOCK]!r}"
        allow = _csv(self.env.get(ENV_ALLOW))
        if allow is not None and BUILTIN_PLUGIN not in allow:
            return f"add {BUILTIN_PLUGIN} to {ENV_ALLOW}={self.env[ENV_ALLOW]!r}"
        rec = next((p for p in self.plugins if p.name == BUILTIN_PLUGIN), None)
        if rec is None:
            return "its entry point is not installed: reinstall hicache-core"
        return f"it failed to load{f' ({rec.error})' if rec.error else ''}: see `hicache plugins`, and reinstall hicache-core"

    def add_plugin(self, plugin: Any, record: PluginRecord, *, explicit: bool = False) -> None:
        """Register one plugin object and run its registration hooks.

        A plugin whose hooks raise, or that implements an unknown ``hicache_*``
        hook, is recorded as broken and everything it registered is withdrawn.
        """
        self.plugins.append(record)
        if self.pm.is_registered(plugin):  # one object under two entry-point names (or passed twice)
            first = (self.pm.get_name(plugin) or "?").rsplit("#", 1)[0]  # pluggy's name: entry point#n (below)
            self._broken(record, f"it is the same plugin object as entry point {first!r}, already loaded (two entry "
                         f"points naming one module); remove one of them, or set {ENV_BLOCK}={record.name}", explicit,
                         append=False)
            return
        # hook implementations: functions marked with hookimpl.  Unknown: a marked one no hook specifies, or one named
        # hicache_register_* (a misspelt hook); a module may import hicache_core or name other helpers hicache_*
        try:  # an attribute that raises when read is that plugin's bug, not the registry's
            funcs = {n: f for n in dir(plugin) if n.startswith("hicache_")
                     and callable(f := getattr(plugin, n, None)) and not isinstance(f, (type, types.ModuleType))}
            marked = {n for n, f in funcs.items() if getattr(f, f"{hookspecs.PROJECT}_impl", None) is not None}
        except Exception as exc:
            self._broken(record, f"its attributes could not be read: {type(exc).__name__}: {exc}", explicit,
                         append=False)
            return
        unknown = [n for n in funcs if not hasattr(self.pm.hook, n) and (n in marked or n.startswith("hicache_register_"))]
        if unknown:
            hooks = [n for n in dir(self.pm.hook) if n.startswith("hicache_")]
            near = {n: difflib.get_close_matches(n, hooks, n=1) for n in unknown}
            hint = "; ".join(f"did you mean {m[0]!r} for {n!r}?" for n, m in near.items() if m)
            self._broken(record, f"implements unknown hooks {unknown}" + (f" ({hint})" if hint else ""), explicit,
                         append=False)
            return
        misfit = [why for n in sorted(marked) if hasattr(self.pm.hook, n) and (why := _hook_signature_error(n, funcs[n]))]
        if misfit:  # pluggy's own refusal names neither the parameter it wants nor how to write the hook
            self._broken(record, "; ".join(misfit), explicit, append=False)
            return
        bare = [n for n in funcs if hasattr(self.pm.hook, n) and n not in marked]
        if bare:
            logger.warning("hicache plugin %r (%s): %s not marked with @hicache_core.hookimpl: never called",
                           record.name, record.label, bare)
        # two phases: the hooks' registrations are collected, and enter the registry only when every hook succeeded
        # (a plugin failing half-way leaves no layout, strategy or conflict of its own behind)
        layouts: list[Layout] = []
        infos: list[StrategyInfo] = []
        # pluggy's name for it is the registry's own (entry-point names may repeat across distributions: two
        # plugins called alike both load, instead of the second failing on pluggy's name table)
        pm_name = f"{record.name}#{len(self.plugins)}"
        try:
            self.pm.register(plugin, name=pm_name)
            self.pm.check_pending()
            self._call(plugin, "hicache_register_layouts", layouts.append)
            self._call(plugin, "hicache_register_strategies", infos.append)
            for lay in layouts:  # checked here, so that entering them below cannot fail half-way
                _check_layout(lay)
            for i, info in enumerate(infos):
                _check_strategy(info)
                if not isinstance(info.layouts, tuple) or not isinstance(info.sharded, tuple):  # lists: as tuples
                    infos[i] = replace(info, layouts=tuple(info.layouts), sharded=tuple(info.sharded))
            _check_own_duplicates(layouts, infos)
        except Exception as exc:
            if self.pm.is_registered(plugin):  # this registration's (an object registered before returned above)
                self.pm.unregister(plugin)
            self._broken(record, f"registration failed: {type(exc).__name__}: {exc}", explicit, append=False)
            return
        for lay in layouts:
            self._add_layout(lay, record)
        for info in infos:
            self._add_strategy(info, record)

    def _call(self, plugin: Any, hook: str, register: Any) -> None:
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin is plugin:
                _IN_HOOK.depth = getattr(_IN_HOOK, "depth", 0) + 1
                try:
                    returned = impl.function(register=register)
                finally:
                    _IN_HOOK.depth -= 1
                if returned is not None:  # e.g. a list of layouts, returned instead of registered: nothing would be
                    raise TypeError(f"{hook} returned {type(returned).__name__} {returned!r} instead of None; call "
                                    "register(x) once per layout or strategy (a returned value is not registered)")

    def _broken(self, record: PluginRecord, why: str, explicit: bool, *, append: bool = True) -> None:
        record.error = why
        if append:
            self.plugins.append(record)
        if explicit:
            raise PluginLoadError(f"hicache plugin {record.name!r} ({record.label}) was requested but {why}")
        logger.warning("hicache plugin %r (%s) skipped: %s", record.name, record.label, why)

    def _conflict(self, kind: str, name: str, first: tuple[PluginRecord, str] | None,
                  record: PluginRecord, detail: str = "") -> Conflict:
        """Record (or extend) the conflict on ``name``; ``first`` is the registration it collides with."""
        for c in self.conflicts:
            if c.kind == kind and c.name == name:
                break
        else:
            assert first is not None
            c = Conflict(kind, name, [first[0]], [first[1]])
            self.conflicts.append(c)
        c.plugins.append(record)
        c.details.append(detail)
        logger.warning("hicache: %s", c.message)
        return c

    def _conflict_on(self, kind: str, name: str) -> Conflict | None:
        return next((c for c in self.conflicts if c.kind == kind and c.name == name), None)

    def _add_layout(self, layout: Layout, record: PluginRecord) -> None:
        if layout.name in self.layouts or self._conflict_on("layout", layout.name):
            first = self.layouts.pop(layout.name, None)
            self._conflict("layout", layout.name, first and (first[1], ""), record)
            return
        self.layouts[layout.name] = (layout, record)
        record.layouts.append(layout.name)

    def _add_strategy(self, info: StrategyInfo, record: PluginRecord) -> None:
        if info.name in self.strategies or self._conflict_on("strategy", info.name):
            first = self.strategies.pop(info.name, None)
            self._exact = {k: v for k, v in self._exact.items() if v != info.name}
            c = self._conflict("strategy", info.name, first and (first[1], ""), record)
            c.infos += ([first[0]] if first else []) + [info]
            return
        if not info.generic:
            # each key once: layouts=("a", "a") or sharded=(False, False) is one registration, not a conflict
            for layout in dict.fromkeys(info.layouts):
                for sharded in dict.fromkeys(info.sharded):
                    key = (layout, info.io_backend, sharded)
                    if key in self._exact or self._conflict_on("key", _key_name(key)):
                        first_name = self._exact.get(key)
                        owner = (self.strategies[first_name][1], f"strategy {first_name!r}") if first_name else None
                        self._conflict("key", _key_name(key), owner, record, f"strategy {info.name!r}")
                    else:
                        self._exact[key] = info.name
        self.strategies[info.name] = (info, record)
        record.strategies.append(info.name)

    def conflict_for(self, layout: str, io_backend: str, sharded: bool) -> Conflict | None:
        """The conflict that makes the key ``(layout, io_backend, sharded)`` unusable, if any.

        A key is involved when its layout name is contested, when it is an exact key
        two strategies registered, or when a contested strategy name would be a
        candidate for it.
        """
        key = (layout, io_backend, sharded)
        for c in self.conflicts:
            if (c.kind == "layout" and c.name == layout) or (c.kind == "key" and c.name == _key_name(key)):
                return c
            if c.kind == "strategy" and any(
                i.io_backend == io_backend and sharded in i.sharded and (i.generic or layout in i.layouts)
                for i in c.infos
            ):
                return c
        return None

    # -- queries ---------------------------------------------------------------
    @property
    def io_backends(self) -> list[str]:
        return sorted({info.io_backend for info, _ in self.strategies.values()})

    def layout(self, name: str) -> Layout:
        """The layout called ``name``.

        :raises DuplicateRegistrationError: two plugins registered ``name``.
        :raises UnknownLayoutError: no plugin did; the message lists what is installed.
        """
        self._check_layout_name(name)
        conflict = self._conflict_on("layout", name)
        if conflict is not None:
            raise DuplicateRegistrationError(conflict.message)
        if name not in self.layouts:
            raise UnknownLayoutError(self.unknown_name("layout", name, self.layouts))
        return self.layouts[name][0]

    def candidates(self, layout: str, io_backend: str, sharded: bool) -> list[StrategyInfo]:
        """Strategies for a key, best first: the exact registration, then generic ones by name."""
        out: list[StrategyInfo] = []
        exact = self._exact.get((layout, io_backend, sharded))
        if exact:
            out.append(self.strategies[exact][0])
        out += sorted(
            (i for i, _ in self.strategies.values() if i.generic and i.io_backend == io_backend and sharded in i.sharded),
            key=lambda i: i.name,
        )
        return out

    def unknown_name(self, what: str, name: str, known: Iterable[str]) -> str:
        """The message for a ``what`` (layout, io_backend) called ``name`` that no installed plugin provides: where
        plugins come from, the inventory, and the names of ``known`` close to ``name``."""
        hint = did_you_mean(name, known)
        return f"unknown {what} {name!r}.\n{PLUGINS_COME_FROM}\n{self.inventory()}" + (f"\n{hint}" if hint else "")

    def inventory(self) -> str:
        """Installed layouts and io_backends with their distributions, for error messages."""
        lines = ["installed layouts:"]
        lines += [f"  {n} ({rec.label})" for n, (_, rec) in sorted(self.layouts.items())] or ["  (none)"]
        lines.append("installed io_backends:")
        by_backend: dict[str, set[str]] = {}
        for info, rec in self.strategies.values():
            by_backend.setdefault(info.io_backend, set()).add(rec.label)
        lines += [f"  {b} ({', '.join(sorted(d))})" for b, d in sorted(by_backend.items())] or ["  (none)"]
        broken = [p for p in self.plugins if p.error]
        if broken:
            lines.append("broken plugins (skipped):")
            lines += [f"  {p.name} ({p.label}): {p.error}" for p in broken]
        if self.conflicts:
            lines.append("conflicting registrations (unusable until one side is removed):")
            lines += [f"  {c.message}" for c in self.conflicts]
        return "\n".join(lines)

    def try_resolve(
        self, spec: PoolSpec, layout: str, io_backend: str, *, override: str | None = None,
        options: Mapping[str, Any] | None = None, errors: list[Exception] | None = None,
    ) -> tuple[Resolution | None, list[tuple[str, str]]]:
        """Resolve without raising: ``(resolution or None, [(strategy name, rejection reason)])``.

        ``options`` are passed to the chosen strategy's factory as keyword arguments
        (e.g. ``programs`` for kernel strategies).  ``errors``, where given, receives the exception of each candidate
        that failed to load (its rejection reason names it too).

        :raises SpecError: ``spec`` is not a :class:`PoolSpec`.
        :raises UnknownLayoutError: ``layout`` is not a str, or no installed layout's name.
        :raises ResolutionError: ``io_backend`` or ``override`` is not a str.
        """
        self.check_key(spec, layout, io_backend, override)
        lay = self.layout(layout)
        key_sharded = spec.sharded
        conflict = self.conflict_for(layout, io_backend, key_sharded)
        if conflict is not None:
            raise DuplicateRegistrationError(conflict.message)
        cands = self.candidates(layout, io_backend, key_sharded)
        rejected: list[tuple[str, str]] = []
        owner = self.layouts[layout][1]
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
            env_pick = self.env.get(ENV_STRATEGY, "").strip()
            if env_pick and env_pick not in self.strategies and self._conflict_on("strategy", env_pick) is None:
                return None, [(env_pick, f"{ENV_STRATEGY}={env_pick!r} names no registered strategy; registered: "
                                         f"{sorted(self.strategies)}. Fix or unset {ENV_STRATEGY}")]
            if env_pick and any(c.name == env_pick for c in cands):
                cands = [c for c in cands if c.name == env_pick]
        else:
            picked = [c for c in cands if c.name == override]
            if not picked:
                refusal = f"{NOT_A_CANDIDATE}; candidates: {[c.name for c in cands]}"
                if not cands:
                    refusal += f" ({self._no_candidate(layout, io_backend, key_sharded)})"
                return None, [(override, refusal)]
            cands = picked
        for info in cands:
            try:
                strategy = info.factory(**(options or {}))
                if hasattr(strategy, "use_registry"):  # composite strategies resolve their parts here
                    strategy.use_registry(self)
                why = strategy.supports(spec, lay)
                wrong = _contract_problem(why, "supports()")
                if wrong:
                    prov = self.strategies[info.name][1]
                    why = f"{wrong} (a bug of plugin {prov.name!r}, {prov.label})"
            except Exception as exc:  # a broken factory rejects its strategy, not the registry
                why = f"{LOAD_FAILED}{type(exc).__name__}: {exc}"
                logger.debug("hicache: strategy %s %s", info.name, why, exc_info=True)  # the traceback, at -vv
                if errors is not None:
                    errors.append(exc)
            if why:
                rejected.append((info.name, why))
                continue
            res = Resolution(lay, info, strategy, self.strategies[info.name][1], tuple(rejected))
            if self.trace:
                logger.info(
                    "hicache: (%s, %s, sharded=%s) %s -> %s from %s",
                    layout, io_backend, key_sharded, spec.describe(), info.name, res.provider.label,
                )
            return res, rejected
        if not cands:
            rejected.append(("(none)", self._no_candidate(layout, io_backend, key_sharded)))
        return None, rejected

    def _no_candidate(self, layout: str, io_backend: str, sharded: bool) -> str:
        """Why no strategy is a candidate for a key: no plugin provides the io_backend, or its strategies for the
        layout serve the other kind of pool only (their registration's ``sharded``), or none serves the layout."""
        if io_backend not in self.io_backends:
            return f"no installed plugin provides io_backend {io_backend!r} {PLUGINS_COME_FROM}"
        other = [i.name for i in self.candidates(layout, io_backend, not sharded)]
        if other:
            kind = "unsharded" if sharded else "sharded"
            return (f"{', '.join(other)} {'serves' if len(other) == 1 else 'serve'} {kind} pools only (registered "
                    f"with sharded=({not sharded},)); add {sharded} to its registration's sharded to serve these")
        return f"no strategy is registered for io_backend {io_backend!r} and this layout"

    def _check_layout_name(self, name: object) -> None:
        """:raises UnknownLayoutError: ``name`` is not a str (the message lists the installed layouts)."""
        if not isinstance(name, str):
            known = ", ".join(sorted(self.layouts)) or "none installed"
            raise UnknownLayoutError(f"layout must be a str naming an installed layout ({known}), {_got(name)}")

    def check_key(self, spec: object, layout: object, io_backend: object, override: object = None) -> None:
        """A key of the right types, else an error naming the argument, what it takes and what was passed (a name
        that is not a str failed inside difflib, a spec that is not a PoolSpec on its first attribute).

        :raises SpecError: ``spec`` is not a :class:`PoolSpec`.
        :raises UnknownLayoutError: ``layout`` is not a str.
        :raises ResolutionError: ``io_backend`` is not a str, or ``override`` neither None nor a str."""
        if not isinstance(spec, PoolSpec):
            raise SpecError(f"spec must be a PoolSpec (PoolSpec.mha(...), PoolSpec.mla(...) or PoolSpec(...)), "
                            f"{_got(spec)}")
        self._check_layout_name(layout)
        if not isinstance(io_backend, str):
            known = ", ".join(self.io_backends) or "none installed"
            raise ResolutionError(f"io_backend must be a str naming an installed io_backend ({known}), "
                                  f"{_got(io_backend)}")
        if override is not None and not isinstance(override, str):
            raise ResolutionError(f"strategy (the override) must be None or a str naming a registered strategy, "
                                  f"{_got(override)}")

    def resolve(
        self, spec: PoolSpec, layout: str, io_backend: str, *, override: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Resolution:
        """The strategy serving ``(layout, io_backend, spec.sharded)`` for ``spec``.

        :param override: a strategy name to use instead of the default pick; it
            must be a candidate for the key.  ``HICACHE_STRATEGY`` does the same
            wherever it names a candidate.
        :param options: keyword arguments for the strategy factory.
        :raises UnknownLayoutError: the layout is not installed.
        :raises ResolutionError: nothing serves the key; the message lists each
            rejection, the installed plugins and the nearest working alternatives.
        """
        errors: list[Exception] = []
        res, rejected = self.try_resolve(spec, layout, io_backend, override=override, options=options, errors=errors)
        if res is not None:
            return res
        lines = [f"no strategy serves (layout={layout!r}, io_backend={io_backend!r}, sharded={spec.sharded}) "
                 f"for {spec.describe()}:"]
        lines += [f"  {name}: {why}" for name, why in rejected]
        alts = self.alternatives(spec, layout, io_backend, options)
        if alts or not options:
            lines.append("nearest working alternatives: " + ("; ".join(alts) if alts else "(none)"))
        else:  # options are one strategy's own: a misspelt one fails every other key too
            alts = self.alternatives(spec, layout, io_backend)
            lines.append(f"nearest working alternatives (none takes strategy_options {sorted(options)}; without them): "
                         + ("; ".join(alts) if alts else "(none)"))
        if BUILTIN_PLUGIN in self.skipped:
            lines.append(f"note: {BUILTIN_PLUGIN!r}, the plugin of the generic backends (reference, direct, auto), is "
                         f"left out: {self.core_fix()}")
        lines.append(self.inventory())
        if io_backend not in self.io_backends and (hint := did_you_mean(io_backend, self.io_backends)):
            lines.append(hint)
        config = next((e for e in errors if isinstance(e, ConfigError)), None)
        # a setting that made a candidate fail to load is the cause (a caller may tell the user's setting apart)
        raise ResolutionError("\n".join(lines)) from config

    def alternatives(self, spec: PoolSpec, layout: str, io_backend: str,
                     options: Mapping[str, Any] | None = None) -> list[str]:
        """Keys that do resolve for ``spec`` (with ``options``): same layout other backends, then same backend other
        layouts.

        :raises SpecError, UnknownLayoutError, ResolutionError: as :meth:`check_key`."""
        self.check_key(spec, layout, io_backend)
        out = []
        pairs = [(layout, b) for b in self.io_backends if b != io_backend]
        pairs += [(lay, io_backend) for lay in sorted(self.layouts) if lay != layout]
        for lay, backend in pairs:
            if lay not in self.layouts or self.conflict_for(lay, backend, spec.sharded) is not None:
                continue
            res, _ = self.try_resolve(spec, lay, backend, options=options)
            if res is not None:
                out.append(f"layout={lay!r}, io_backend={backend!r} ({res.info.name})")
        return out


def _key_name(key: tuple[str, str, bool]) -> str:
    layout, io_backend, sharded = key
    return f"(layout={layout!r}, io_backend={io_backend!r}, sharded={sharded})"


def create_registry(
    *,
    entry_points: bool = True,
    plugins: Iterable[tuple[str, Any]] = (),
    env: Mapping[str, str] | None = None,
) -> Registry:
    """A fresh registry.

    :param entry_points: load plugins from the ``hicache`` entry-point group.
    :param plugins: extra ``(name, plugin object)`` pairs registered after them
        (tests use this; production code should install a distribution).
    :param env: environment to read switches from (default ``os.environ``).
    """
    reg = Registry(env=env)
    if entry_points:
        reg.load_entry_points()
    for name, plugin in plugins:
        reg.add_plugin(plugin, PluginRecord(name, "<local>", "-"))
    return reg


_default: Registry | None = None
#: Re-entrant: a re-entry the checks in :func:`default_registry` missed would recurse and fail, not wait for itself.
_DEFAULT_LOCK = threading.RLock()
#: ``depth``: registration hooks running in this thread (:meth:`Registry._call`).
_IN_HOOK = threading.local()
#: ``on``: this thread is creating the default registry (importing plugins and running their hooks).
_CREATING = threading.local()


def default_registry() -> Registry:
    """The process-wide registry, created on first use.

    :raises RegistryError: called from a plugin's registration hook (creating the default registry would run that
        hook again, and wait for itself; a hook gets what it needs through its ``register`` argument), or while this
        thread creates the default registry (a plugin module calling it when imported)."""
    global _default
    if getattr(_IN_HOOK, "depth", 0):
        raise RegistryError("default_registry() was called from a plugin's registration hook; a hook must not use "
                            "a registry: it registers through its register argument")
    if getattr(_CREATING, "on", False):  # e.g. a plugin module calling it when imported: it would wait for itself
        raise RegistryError("default_registry() was called while the default registry was being created (by a "
                            "plugin's import or hook); call it later, from the code that uses a pool")
    reg = _default
    if reg is not None:
        return reg
    with _DEFAULT_LOCK:
        if _default is None:
            _CREATING.on = True
            try:
                _default = create_registry()
            finally:
                _CREATING.on = False
        return _default


def reset_default_registry() -> None:
    """Forget the process-wide registry (after installing a plugin at run time, or in tests)."""
    global _default
    _default = None


__all__ += ["default_registry", "reset_default_registry", "ENV_ALLOW", "ENV_BLOCK", "ENV_STRATEGY", "ENV_TRACE"]

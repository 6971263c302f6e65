"""The :class:`Registry`: plugins loaded into one pluggy manager, their layouts and strategies, conflicts, lookups.

Part of :mod:`hicache_core.registry` (whose docstring tells the environment switches); import it from there.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Iterable, Mapping

import pluggy

from .. import hookspecs
from ..envflags import OFF
from ..errors import DuplicateRegistrationError, PluginLoadError, ResolutionError, SpecError, UnknownLayoutError
from ..layout import Layout
from ..logonce import log_once
from ..spec import PoolSpec
from ..strategy import StrategyInfo
from .checks import _check_registrations, _hook_problem
from .discovery import _check_lists, _csv, _entry_points_in_order, _ep_dist, _import_failure
from .records import (BUILTIN_PLUGIN, ENTRY_POINT_GROUP, ENV_ALLOW, ENV_BLOCK, ENV_TRACE, PLUGINS_COME_FROM, Conflict,
                      PluginRecord, Resolution, _got, _key_name, did_you_mean)
from .resolution import _alternatives, _try_resolve, _unresolved

#: The registry's logger (the package's name, which users configure; ``HICACHE_TRACE`` logs through it too).
logger = logging.getLogger("hicache_core.registry")

#: ``depth``: registration hooks running in this thread (:meth:`Registry._call`).
_IN_HOOK = threading.local()


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
        eps = _entry_points_in_order(group)
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
                self._broken(record, _import_failure(ep, dist, exc), explicit=allow is not None)
                continue
            self.add_plugin(plugin, record, explicit=allow is not None)
        if BUILTIN_PLUGIN in self.skipped:  # the allowed or blocked plugins may still load, but nothing can be compared
            log_once(logger, logging.WARNING,
                     f"hicache's {BUILTIN_PLUGIN!r} plugin is not loaded: its reference, direct and auto io_backends are "
                     f"missing, and `hicache verify` and the conformance kit compare every strategy with reference; "
                     f"{self.core_fix()}")
        _check_lists(eps, allow, block, self.plugins)

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
        why, bare = _hook_problem(plugin, self.pm.hook)
        if why:
            self._broken(record, why, explicit, append=False)
            return
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
            _check_registrations(layouts, infos)  # checked here, so that entering them below cannot fail half-way
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
        return _try_resolve(self, spec, layout, io_backend, override, options, errors)

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
        _unresolved(self, spec, layout, io_backend, options, rejected, errors)

    def alternatives(self, spec: PoolSpec, layout: str, io_backend: str,
                     options: Mapping[str, Any] | None = None) -> list[str]:
        """Keys that do resolve for ``spec`` (with ``options``): same layout other backends, then same backend other
        layouts.

        :raises SpecError, UnknownLayoutError, ResolutionError: as :meth:`check_key`."""
        return _alternatives(self, spec, layout, io_backend, options)

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
    strategy name preferred wherever it is a candidate (see :meth:`Registry.resolve`).
``HICACHE_TRACE``
    ``1`` logs every resolution (and pluggy hook calls) at INFO level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import pluggy

from . import hookspecs
from .errors import DuplicateRegistrationError, PluginLoadError, ResolutionError, UnknownLayoutError
from .layout import Layout
from .spec import PoolSpec
from .strategy import ANY_LAYOUT, Strategy, StrategyInfo

if sys.version_info >= (3, 10):
    from importlib.metadata import EntryPoint, entry_points
else:  # pragma: no cover - exercised only on Python 3.9
    from importlib_metadata import EntryPoint, entry_points

__all__ = ["ENTRY_POINT_GROUP", "PluginRecord", "Resolution", "Registry", "create_registry"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hicache"
ENV_ALLOW = "HICACHE_PLUGINS"
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


@dataclass(frozen=True)
class Resolution:
    """The outcome of resolving a key: the chosen strategy and every rejection on the way."""

    layout: Layout
    info: StrategyInfo
    strategy: Strategy
    provider: PluginRecord
    rejected: tuple[tuple[str, str], ...]


def _csv(value: str | None) -> set[str] | None:
    if value is None or not value.strip():
        return None
    return {x.strip() for x in value.split(",") if x.strip()}


def _ep_dist(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown>", "?"
    return dist.metadata["Name"], dist.version


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
        self.trace = self.env.get(ENV_TRACE, "") not in ("", "0")
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
                continue
            dist, version = _ep_dist(ep)
            record = PluginRecord(ep.name, dist, version)
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not break the others
                self._broken(record, f"import failed: {type(exc).__name__}: {exc}", explicit=allow is not None)
                continue
            self.add_plugin(plugin, record, explicit=allow is not None)
        if allow:
            missing = allow - {p.name for p in self.plugins}
            if missing:
                raise PluginLoadError(
                    f"{ENV_ALLOW} names plugins that are not installed: {sorted(missing)}; "
                    f"installed: {sorted(ep.name for ep in eps)}"
                )

    def add_plugin(self, plugin: Any, record: PluginRecord, *, explicit: bool = False) -> None:
        """Register one plugin object and run its registration hooks.

        A plugin whose hooks raise, or that implements an unknown ``hicache_*``
        hook, is recorded as broken and everything it registered is withdrawn.
        """
        self.plugins.append(record)
        unknown = [n for n in dir(plugin) if n.startswith("hicache_") and not hasattr(self.pm.hook, n)]
        if unknown:
            self._broken(record, f"implements unknown hooks {unknown}", explicit, append=False)
            return
        try:
            self.pm.register(plugin, name=record.name)
            self.pm.check_pending()
            self._call(plugin, "hicache_register_layouts", lambda lay: self._add_layout(lay, record))
            self._call(plugin, "hicache_register_strategies", lambda info: self._add_strategy(info, record))
        except DuplicateRegistrationError:
            raise
        except Exception as exc:
            self._withdraw(record, plugin)
            self._broken(record, f"registration failed: {type(exc).__name__}: {exc}", explicit, append=False)

    def _call(self, plugin: Any, hook: str, register: Any) -> None:
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin is plugin:
                impl.function(register=register)

    def _broken(self, record: PluginRecord, why: str, explicit: bool, *, append: bool = True) -> None:
        record.error = why
        if append:
            self.plugins.append(record)
        if explicit:
            raise PluginLoadError(f"hicache plugin {record.name!r} ({record.label}) was requested but {why}")
        logger.warning("hicache plugin %r (%s) skipped: %s", record.name, record.label, why)

    def _withdraw(self, record: PluginRecord, plugin: Any) -> None:
        for name in record.layouts:
            self.layouts.pop(name, None)
        for name in record.strategies:
            self.strategies.pop(name, None)
        self._exact = {k: v for k, v in self._exact.items() if v not in record.strategies}
        record.layouts.clear()
        record.strategies.clear()
        if self.pm.is_registered(plugin):
            self.pm.unregister(plugin)

    def _add_layout(self, layout: Layout, record: PluginRecord) -> None:
        if layout.name in self.layouts:
            other = self.layouts[layout.name][1]
            raise DuplicateRegistrationError(
                f"layout {layout.name!r} is registered by both {other.label} (plugin {other.name!r}) and "
                f"{record.label} (plugin {record.name!r}); uninstall one or block it with {ENV_BLOCK}"
            )
        self.layouts[layout.name] = (layout, record)
        record.layouts.append(layout.name)

    def _add_strategy(self, info: StrategyInfo, record: PluginRecord) -> None:
        if info.name in self.strategies:
            other = self.strategies[info.name][1]
            raise DuplicateRegistrationError(
                f"strategy name {info.name!r} is registered by both {other.label} and {record.label}"
            )
        if not info.generic:
            for layout in info.layouts:
                for sharded in info.sharded:
                    key = (layout, info.io_backend, sharded)
                    if key in self._exact:
                        other = self.strategies[self._exact[key]][1]
                        raise DuplicateRegistrationError(
                            f"key (layout={layout!r}, io_backend={info.io_backend!r}, sharded={sharded}) is "
                            f"registered by both {other.label} (strategy {self._exact[key]!r}) and {record.label} "
                            f"(strategy {info.name!r}); uninstall one or block it with {ENV_BLOCK}"
                        )
            for layout in info.layouts:
                for sharded in info.sharded:
                    self._exact[(layout, info.io_backend, sharded)] = info.name
        self.strategies[info.name] = (info, record)
        record.strategies.append(info.name)

    # -- queries ---------------------------------------------------------------
    @property
    def io_backends(self) -> list[str]:
        return sorted({info.io_backend for info, _ in self.strategies.values()})

    def layout(self, name: str) -> Layout:
        """The layout called ``name``; :class:`UnknownLayoutError` lists what is installed."""
        if name not in self.layouts:
            raise UnknownLayoutError(f"unknown layout {name!r}.\n{self.inventory()}")
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
        return "\n".join(lines)

    def try_resolve(
        self, spec: PoolSpec, layout: str, io_backend: str, *, override: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> tuple[Resolution | None, list[tuple[str, str]]]:
        """Resolve without raising: ``(resolution or None, [(strategy name, rejection reason)])``.

        ``options`` are passed to the chosen strategy's factory as keyword arguments
        (e.g. ``programs`` for kernel strategies).
        """
        lay = self.layout(layout)
        key_sharded = spec.sharded
        cands = self.candidates(layout, io_backend, key_sharded)
        rejected: list[tuple[str, str]] = []
        reason = lay.check(spec)
        if reason:
            return None, [(f"layout {layout}", reason)]
        if override is None:
            env_pick = self.env.get(ENV_STRATEGY)
            if env_pick and any(c.name == env_pick for c in cands):
                cands = [c for c in cands if c.name == env_pick]
        else:
            picked = [c for c in cands if c.name == override]
            if not picked:
                return None, [(override, f"not a candidate for this key; candidates: {[c.name for c in cands]}")]
            cands = picked
        for info in cands:
            try:
                strategy = info.factory(**(options or {}))
                why = strategy.supports(spec, lay)
            except Exception as exc:  # a broken factory rejects its strategy, not the registry
                why = f"failed to load: {type(exc).__name__}: {exc}"
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
            rejected.append(("(none)", f"no strategy is registered for io_backend {io_backend!r} and this layout"))
        return None, rejected

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
        res, rejected = self.try_resolve(spec, layout, io_backend, override=override, options=options)
        if res is not None:
            return res
        lines = [f"no strategy serves (layout={layout!r}, io_backend={io_backend!r}, sharded={spec.sharded}) "
                 f"for {spec.describe()}:"]
        lines += [f"  {name}: {why}" for name, why in rejected]
        alts = self.alternatives(spec, layout, io_backend)
        lines.append("nearest working alternatives: " + (", ".join(alts) if alts else "(none)"))
        lines.append(self.inventory())
        raise ResolutionError("\n".join(lines))

    def alternatives(self, spec: PoolSpec, layout: str, io_backend: str) -> list[str]:
        """Keys that do resolve for ``spec``: same layout other backends, then same backend other layouts."""
        out = []
        pairs = [(layout, b) for b in self.io_backends if b != io_backend]
        pairs += [(lay, io_backend) for lay in sorted(self.layouts) if lay != layout]
        for lay, backend in pairs:
            if lay not in self.layouts:
                continue
            res, _ = self.try_resolve(spec, lay, backend)
            if res is not None:
                out.append(f"--layout {lay} --io-backend {backend} ({res.info.name})")
        return out


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
_DEFAULT_LOCK = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry, created on first use."""
    global _default
    if _default is None:
        with _DEFAULT_LOCK:
            if _default is None:
                _default = create_registry()
    return _default


def reset_default_registry() -> None:
    """Forget the process-wide registry (after installing a plugin at run time, or in tests)."""
    global _default
    _default = None


__all__ += ["default_registry", "reset_default_registry", "ENV_ALLOW", "ENV_BLOCK", "ENV_STRATEGY", "ENV_TRACE"]

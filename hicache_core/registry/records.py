"""The registry's names and records: environment switches, plugin records, conflicts and resolutions.

Part of :mod:`hicache_core.registry`, which re-exports every name here (import them from there).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable

from ..layout import Layout
from ..strategy import Strategy, StrategyInfo

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
#: How a resolution that names a strategy (``override``) refuses one whose registration has no candidate for the key.
NOT_A_CANDIDATE = "not a candidate for this key"


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


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """``"did you mean: a, b?"`` naming up to three of ``options`` close to ``name``, or ``""``."""
    near = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"did you mean: {', '.join(near)}?" if near else ""


def _got(value: object) -> str:
    """``got TYPE REPR`` for a refusal's message, the repr cut to 40 characters."""
    text = repr(value)
    return f"got {type(value).__name__} {text if len(text) <= 40 else text[:40] + '...'}"


def _key_name(key: tuple[str, str, bool]) -> str:
    layout, io_backend, sharded = key
    return f"(layout={layout!r}, io_backend={io_backend!r}, sharded={sharded})"

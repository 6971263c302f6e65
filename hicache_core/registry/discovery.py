"""Plugin discovery: the ``hicache`` entry points in load order, and what the allow- and block-lists leave out.

The registry lists entry points through this module's ``entry_points`` (:func:`_entry_points_in_order`): a test that
adds entry points replaces that name here.  Part of :mod:`hicache_core.registry`.
"""

from __future__ import annotations

import logging
import sys

from ..errors import PluginLoadError
from ..logonce import log_once
from .records import ENV_ALLOW, ENV_BLOCK, PLUGINS_COME_FROM, PluginRecord, did_you_mean

if sys.version_info >= (3, 10):
    from importlib.metadata import EntryPoint, entry_points
else:  # pragma: no cover - exercised only on Python 3.9
    from importlib_metadata import EntryPoint, entry_points

#: The registry's logger (the package's name, which users configure; ``HICACHE_TRACE`` logs through it too).
logger = logging.getLogger("hicache_core.registry")


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


def _entry_points_in_order(group: str) -> list[EntryPoint]:
    """The entry points of ``group`` by entry-point name, then distribution: the load order, whatever the install
    order."""
    return sorted(entry_points(group=group), key=lambda ep: (ep.name, _ep_dist(ep)[0]))


def _import_failure(ep: EntryPoint, dist: str, exc: BaseException) -> str:
    """Why the plugin of ``ep`` (from distribution ``dist``) is broken, its import having raised ``exc``."""
    why = f"import failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, (ImportError, AttributeError)):  # a module or object the entry point names is gone
        who = "its distribution" if dist == "<unknown>" else dist
        why += (f" (entry point {ep.name} = {ep.value}: if the plugin's code moved, reinstall {who}: "
                f"entry points are read when it is installed, -e installs too)")
    return why


def _check_lists(eps: list[EntryPoint], allow: set[str] | None, block: set[str], plugins: list[PluginRecord]) -> None:
    """After loading ``eps``: warn where the block-list names no installed plugin (a typo, or a distribution's name,
    leaves the plugin it meant to switch off on), and refuse an allow-list naming a plugin that did not load.

    :param plugins: the plugins recorded (broken ones too).
    :raises PluginLoadError: the allow-list names plugins that are not installed."""
    unknown = block - {ep.name for ep in eps}
    if unknown:  # a typo (or a distribution's name) leaves the plugin it meant to switch off on
        names = sorted(ep.name for ep in eps)
        hints = [f"{u!r}: {h}" for u in sorted(unknown) if (h := did_you_mean(u, names))]
        log_once(logger, logging.WARNING,
                 f"{ENV_BLOCK} names plugins that are not installed: {sorted(unknown)} (nothing switched off for "
                 f"them); it takes entry-point names: {names}" + "".join(f"; {h}" for h in hints))
    if allow:
        missing = allow - {p.name for p in plugins} - block  # blocked as well: the block list wins
        if missing:
            names = [ep.name for ep in eps]
            hints = [h for m in sorted(missing) if (h := did_you_mean(m, names))]
            raise PluginLoadError(
                f"{ENV_ALLOW} names plugins that are not installed: {sorted(missing)}; "
                f"installed: {sorted(names)}" + "".join(f"; {h}" for h in hints) + f" {PLUGINS_COME_FROM}"
            )

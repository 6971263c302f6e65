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

import threading
from typing import Any, Iterable, Mapping

from ..errors import RegistryError

# The package's modules, by role: records (names, PluginRecord, Conflict, Resolution), checks (what plugins hand in),
# discovery (entry points, the allow- and block-lists), core (Registry), resolution (try_resolve's and resolve's
# work).  Every name of the former single module (hicache_core/registry.py) stays importable from here; entry points
# are looked up in discovery, so a test that replaces ``entry_points`` patches it there, not here.
from .checks import (  # noqa: F401
    _check_layout, _check_own_duplicates, _check_strategy, _contract_problem, _hook_signature_error, _name_problem)
from .core import _IN_HOOK, Registry
from .discovery import EntryPoint, _csv, _ep_dist, entry_points  # noqa: F401
from .records import (  # noqa: F401
    BUILTIN_PLUGIN, ENTRY_POINT_GROUP, ENV_ALLOW, ENV_BLOCK, ENV_STRATEGY, ENV_TRACE, LOAD_FAILED, NOT_A_CANDIDATE,
    PLUGINS_COME_FROM, Conflict, PluginRecord, Resolution, _got, _key_name, did_you_mean)

__all__ = ["ENTRY_POINT_GROUP", "PluginRecord", "Conflict", "Resolution", "Registry", "create_registry",
           "default_registry", "reset_default_registry", "ENV_ALLOW", "ENV_BLOCK", "ENV_STRATEGY", "ENV_TRACE"]



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

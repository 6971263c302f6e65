"""Hook specifications of the ``hicache`` pluggy project.

Plugins are modules (or objects) with ``@hookimpl`` functions, found through the
``hicache`` entry-point group.  The core's own generic backends register through
the same group.  Both hooks receive a ``register`` callback: the core owns the
table, so it detects duplicates, records which distribution provided what, and
can list and explain it.  Plugin modules must stay light: no Triton import and
no CUDA initialisation at registration time.
"""

from __future__ import annotations

from typing import Callable

import pluggy

from .layout import Layout
from .strategy import StrategyInfo

__all__ = ["hookspec", "hookimpl", "PROJECT", "hicache_register_layouts", "hicache_register_strategies"]

PROJECT = "hicache"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    """Register host layout descriptors.

    Call ``register(layout)`` once per :class:`~hicache_core.layout.Layout`.
    A layout name registered twice raises
    :class:`~hicache_core.errors.DuplicateRegistrationError` naming both
    distributions.

    :param register: the core's callback; returns nothing.
    """


@hookspec
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    """Register transfer strategies.

    Call ``register(info)`` once per :class:`~hicache_core.strategy.StrategyInfo`.
    Each ``(layout, io_backend, sharded)`` key may have one exact registration;
    generic strategies (layout ``"*"``) are candidates for every layout and lose
    to an exact registration unless the user overrides.  Strategy names are
    unique across all plugins.

    :param register: the core's callback; returns nothing.
    """

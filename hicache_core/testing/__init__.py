"""Conformance kit: checks every registered strategy against the ``reference`` backend.

Run it against whatever is installed with ``pytest --pyargs hicache_core.testing``
(filters: ``--hicache-layout``, ``--hicache-io-backend``, ``--hicache-device``).
"""

from typing import Callable

from ..hookspecs import hookimpl
from ..layout import Layout
from ..strategy import StrategyInfo
from .conformance import CASES, INDEX_VARIANTS, Case, check_strategy, make_device_buffers

__all__ = ["CASES", "INDEX_VARIANTS", "Case", "check_strategy", "make_device_buffers", "strategies_plugin",
           "layouts_plugin"]


def strategies_plugin(*infos: StrategyInfo) -> object:
    """A plugin object registering ``infos``: ``create_registry(plugins=[("name", strategies_plugin(...))])``
    builds a registry with strategies defined in a test, next to (or instead of) the installed ones."""

    class Plugin:
        @hookimpl
        def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
            for info in infos:
                register(info)

    return Plugin()


def layouts_plugin(*layouts: Layout | object) -> object:
    """A plugin object registering ``layouts`` (anything, so that tests can register what the registry must refuse):
    ``create_registry(plugins=[("name", layouts_plugin(MyLayout()))])``."""

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register: Callable[[object], None]) -> None:
            for lay in layouts:
                register(lay)

    return Plugin()

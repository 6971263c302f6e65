"""Conformance kit: checks every registered strategy against the ``reference`` backend.

Run it against whatever is installed with ``pytest --pyargs hicache_core.testing``
(filters: ``--hicache-layout``, ``--hicache-io-backend``, ``--hicache-device``).
"""

from typing import Callable

from ..hookspecs import hookimpl
from ..strategy import StrategyInfo
from .conformance import CASES, INDEX_VARIANTS, Case, check_strategy, make_device_buffers

__all__ = ["CASES", "INDEX_VARIANTS", "Case", "check_strategy", "make_device_buffers", "strategies_plugin"]


def strategies_plugin(*infos: StrategyInfo) -> object:
    """A plugin object registering ``infos``: ``create_registry(plugins=[("name", strategies_plugin(...))])``
    builds a registry with strategies defined in a test, next to (or instead of) the installed ones."""

    class Plugin:
        @hookimpl
        def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
            for info in infos:
                register(info)

    return Plugin()

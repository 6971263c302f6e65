"""The core's own plugin: generic ``reference`` and ``direct`` strategies for any layout.

Registered through the ``hicache`` entry-point group like every other plugin.
"""

from __future__ import annotations

from typing import Callable

from .hookspecs import hookimpl
from .strategy import ANY_LAYOUT, Strategy, StrategyInfo

__all__ = ["hicache_register_strategies"]


def _reference() -> Strategy:
    from .backends.reference import ReferenceStrategy

    return ReferenceStrategy()


def _direct() -> Strategy:
    from .backends.direct import DirectStrategy

    return DirectStrategy()


@hookimpl
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(StrategyInfo("core.reference", "reference", (ANY_LAYOUT,), _reference,
                          description="torch indexing on any device; the oracle"))
    register(StrategyInfo("core.direct", "direct", (ANY_LAYOUT,), _direct,
                          description="copy-engine copies over coalesced runs derived from layout strides"))
